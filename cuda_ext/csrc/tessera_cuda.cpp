// Tessera's CUDA extension: the arena's device allocation, its CUDA IPC handle, and batched
// host-to-device copies on several streams, with an event per group and stream.
//
// It calls the CUDA driver API through dlopen("libcuda.so.1"), so it builds with a plain C++
// compiler and no CUDA toolkit (the driver is what a GPU node always has) and loads anywhere:
// on a machine without a driver every call answers TSR_NO_DRIVER. The Python side
// (cuda_ext/native.py) binds it with ctypes: a process that only holds the arena (the engine's
// own, which imports no torch) needs nothing else. Every function returns a CUresult (0 is
// success); tsr_error turns one into its message.
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

namespace {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUstream = void*;
using CUevent = void*;
struct CUipcMemHandle {
  char reserved[64];
};

constexpr CUresult TSR_NO_DRIVER = 100;  // CUDA_ERROR_NO_DEVICE: what a host without a GPU is
constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;
constexpr unsigned CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1;

struct Driver {
  CUresult (*Init)(unsigned);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*MemAlloc)(CUdeviceptr*, size_t);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*MemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*IpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*IpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned);
  CUresult (*IpcCloseMemHandle)(CUdeviceptr);
  CUresult (*EventCreate)(CUevent*, unsigned);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventSynchronize)(CUevent);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*MemHostAlloc)(void**, size_t, unsigned);
  CUresult (*MemFreeHost)(void*);
  CUresult (*StreamCreate)(CUstream*, unsigned);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*StreamSynchronize)(CUstream);
};

Driver driver;
bool loaded = false;
CUresult load_status = TSR_NO_DRIVER;
std::once_flag load_once;
std::vector<CUcontext> contexts;  // the primary context of each device initialised, by ordinal
std::mutex contexts_lock;

template <typename F>
bool symbol(void* lib, F*& out, const char* name, const char* fallback = nullptr) {
  void* p = dlsym(lib, name);
  if (p == nullptr && fallback != nullptr) p = dlsym(lib, fallback);
  out = reinterpret_cast<F*>(p);
  return p != nullptr;
}

void load() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return;
  Driver d{};
  // The _v2 entry points are the current ABI (64-bit sizes); cuda.h maps the plain names to them.
  bool ok = symbol(lib, d.Init, "cuInit") && symbol(lib, d.DeviceGet, "cuDeviceGet") &&
            symbol(lib, d.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") &&
            symbol(lib, d.CtxSetCurrent, "cuCtxSetCurrent") &&
            symbol(lib, d.MemAlloc, "cuMemAlloc_v2", "cuMemAlloc") &&
            symbol(lib, d.MemFree, "cuMemFree_v2", "cuMemFree") &&
            symbol(lib, d.MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync") &&
            symbol(lib, d.MemcpyDtoH, "cuMemcpyDtoH_v2", "cuMemcpyDtoH") &&
            symbol(lib, d.IpcGetMemHandle, "cuIpcGetMemHandle") &&
            symbol(lib, d.IpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle") &&
            symbol(lib, d.IpcCloseMemHandle, "cuIpcCloseMemHandle") &&
            symbol(lib, d.EventCreate, "cuEventCreate") && symbol(lib, d.EventRecord, "cuEventRecord") &&
            symbol(lib, d.EventSynchronize, "cuEventSynchronize") &&
            symbol(lib, d.EventDestroy, "cuEventDestroy_v2", "cuEventDestroy") &&
            symbol(lib, d.StreamWaitEvent, "cuStreamWaitEvent") &&
            symbol(lib, d.GetErrorString, "cuGetErrorString") &&
            symbol(lib, d.MemHostAlloc, "cuMemHostAlloc") && symbol(lib, d.MemFreeHost, "cuMemFreeHost") &&
            symbol(lib, d.StreamCreate, "cuStreamCreate") &&
            symbol(lib, d.StreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy") &&
            symbol(lib, d.StreamSynchronize, "cuStreamSynchronize");
  if (!ok) return;
  driver = d;
  loaded = true;
  load_status = driver.Init(0);
}

// Make `device`'s primary context (the one torch and the CUDA runtime use) current on this thread.
CUresult use(int device) {
  std::call_once(load_once, load);
  if (!loaded || load_status != 0) return load_status;
  std::lock_guard<std::mutex> guard(contexts_lock);
  if (device < 0) return 101;  // CUDA_ERROR_INVALID_DEVICE
  if (static_cast<size_t>(device) >= contexts.size()) contexts.resize(device + 1, nullptr);
  if (contexts[device] == nullptr) {
    CUdevice dev;
    CUresult r = driver.DeviceGet(&dev, device);
    if (r != 0) return r;
    r = driver.DevicePrimaryCtxRetain(&contexts[device], dev);
    if (r != 0) return r;
  }
  return driver.CtxSetCurrent(contexts[device]);
}

}  // namespace

extern "C" {

// The driver's message for `code`, into `out` (always terminated).
void tsr_error(int code, char* out, size_t size) {
  if (size == 0) return;
  const char* text = nullptr;
  if (code == TSR_NO_DRIVER && !loaded) text = "no CUDA driver (libcuda.so.1 not loadable)";
  else if (loaded && driver.GetErrorString(code, &text) != 0) text = nullptr;
  if (text == nullptr) {
    std::snprintf(out, size, "CUDA error %d", code);
  } else {
    std::snprintf(out, size, "%s", text);
  }
}

int tsr_init(int device) { return use(device); }

int tsr_alloc(int device, size_t nbytes, uint64_t* ptr) {
  CUresult r = use(device);
  if (r != 0) return r;
  CUdeviceptr p = 0;
  r = driver.MemAlloc(&p, nbytes);
  *ptr = p;
  return r;
}

int tsr_free(int device, uint64_t ptr) {
  CUresult r = use(device);
  return r != 0 ? r : driver.MemFree(ptr);
}

// `out` receives the 64 bytes another process passes to tsr_ipc_open.
int tsr_ipc_export(int device, uint64_t ptr, char* out) {
  CUresult r = use(device);
  if (r != 0) return r;
  CUipcMemHandle handle;
  r = driver.IpcGetMemHandle(&handle, ptr);
  if (r == 0) std::memcpy(out, handle.reserved, sizeof handle.reserved);
  return r;
}

int tsr_ipc_open(int device, const char* handle_bytes, uint64_t* ptr) {
  CUresult r = use(device);
  if (r != 0) return r;
  CUipcMemHandle handle;
  std::memcpy(handle.reserved, handle_bytes, sizeof handle.reserved);
  CUdeviceptr p = 0;
  r = driver.IpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  *ptr = p;
  return r;
}

int tsr_ipc_close(int device, uint64_t ptr) {
  CUresult r = use(device);
  return r != 0 ? r : driver.IpcCloseMemHandle(ptr);
}

// Copy `n` spans (host `src[i]`, pinned for the copy to be asynchronous, into device `dst[i]`,
// `size[i]` bytes; span i belongs to group `group[i]`, groups non-decreasing) in chunks of
// `chunk` bytes, round-robin on `streams`, after the work already queued on `after`. For each
// group g and stream s that carried a chunk of it, events[g * nstreams + s] is an event recorded
// after that group's copies (0 where none): the caller waits on those for group g and destroys
// them with tsr_event_destroy. One call issues every copy with no interpreter between them.
int tsr_copy_batch(int device, int n, const uint64_t* src, const uint64_t* dst, const uint64_t* size,
                   const int* group, int ngroups, const uint64_t* streams, int nstreams, uint64_t after,
                   uint64_t chunk, uint64_t* events) {
  CUresult r = use(device);
  if (r != 0) return r;
  if (nstreams <= 0 || chunk == 0) return 1;  // CUDA_ERROR_INVALID_VALUE
  std::memset(events, 0, sizeof(uint64_t) * static_cast<size_t>(ngroups) * nstreams);
  // The copies must not overwrite a range before what `after` queued on it (its last reader,
  // when a range was freed and handed out again) is done.
  CUevent ready = nullptr;
  if ((r = driver.EventCreate(&ready, CU_EVENT_DISABLE_TIMING)) != 0) return r;
  if ((r = driver.EventRecord(ready, reinterpret_cast<CUstream>(after))) != 0) goto done;
  for (int s = 0; s < nstreams; ++s) {
    if ((r = driver.StreamWaitEvent(reinterpret_cast<CUstream>(streams[s]), ready, 0)) != 0) goto done;
  }
  {
    std::vector<char> used(nstreams, 0);
    int turn = 0;
    int current = n > 0 ? group[0] : 0;
    auto close_group = [&](int g) -> CUresult {
      for (int s = 0; s < nstreams; ++s) {
        if (!used[s]) continue;
        CUevent e = nullptr;
        CUresult rr = driver.EventCreate(&e, CU_EVENT_DISABLE_TIMING);
        if (rr != 0) return rr;
        events[static_cast<size_t>(g) * nstreams + s] = reinterpret_cast<uint64_t>(e);
        if ((rr = driver.EventRecord(e, reinterpret_cast<CUstream>(streams[s]))) != 0) return rr;
        used[s] = 0;
      }
      return 0;
    };
    for (int i = 0; i < n; ++i) {
      if (group[i] < current || group[i] >= ngroups) {
        r = 1;
        goto done;
      }
      if (group[i] != current) {
        if ((r = close_group(current)) != 0) goto done;
        current = group[i];
      }
      for (uint64_t at = 0; at < size[i]; at += chunk) {
        uint64_t len = size[i] - at < chunk ? size[i] - at : chunk;
        r = driver.MemcpyHtoDAsync(dst[i] + at, reinterpret_cast<const char*>(src[i]) + at, len,
                                   reinterpret_cast<CUstream>(streams[turn]));
        if (r != 0) goto done;
        used[turn] = 1;
        turn = (turn + 1) % nstreams;
      }
    }
    if (n > 0) r = close_group(current);
  }
done:
  driver.EventDestroy(ready);  // safe while queued: the driver frees it once it has fired
  return r;
}

int tsr_event_wait(int device, uint64_t stream, uint64_t event) {
  CUresult r = use(device);
  return r != 0 ? r : driver.StreamWaitEvent(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUevent>(event), 0);
}

int tsr_event_synchronize(int device, uint64_t event) {
  CUresult r = use(device);
  return r != 0 ? r : driver.EventSynchronize(reinterpret_cast<CUevent>(event));
}

int tsr_event_destroy(int device, uint64_t event) {
  CUresult r = use(device);
  return r != 0 ? r : driver.EventDestroy(reinterpret_cast<CUevent>(event));
}

// Copy `n` spans from pageable host memory (a file's mapping: the host cache's checkpoint) into
// device memory, synchronously, at pinned speed: `threads` threads each copy chunks of `chunk`
// bytes into pinned staging buffers of their own (two each, alternating) and send each buffer to
// the device on their own stream as soon as it is full. The driver's own path for pageable
// memory stages through one small buffer, one copy at a time (≈ 7 GB/s on an H100 host); this
// keeps the link busy while the CPUs fill the next buffers (ServerlessLLM's loader does the same).
//
// With `progress` (else null), spans are counted as they land, in order: once every chunk of
// spans 0..k-1 is known copied (its buffer's event passed), k is stored there, so that another
// process mapping that word (the worker computing with these tensors: TIDAL's streaming) may read
// them. Chunks are handed out in span order, so the count trails the copy by the few chunks in
// flight.
int tsr_copy_pageable_counted(int device, int n, const uint64_t* src, const uint64_t* dst, const uint64_t* size,
                              int threads, uint64_t chunk, int64_t* progress) {
  CUresult r = use(device);
  if (r != 0) return r;
  if (threads <= 0 || chunk == 0) return 1;
  struct Piece {
    const char* src;
    CUdeviceptr dst;
    size_t len;
    int span;
  };
  std::vector<Piece> pieces;
  std::vector<std::atomic<int64_t>> left(static_cast<size_t>(std::max(n, 0)));
  for (int i = 0; i < n; ++i) {
    int64_t count = 0;
    for (uint64_t at = 0; at < size[i]; at += chunk, ++count) {
      pieces.push_back({reinterpret_cast<const char*>(src[i]) + at, dst[i] + at,
                        static_cast<size_t>(std::min<uint64_t>(chunk, size[i] - at)), i});
    }
    left[i].store(count);
  }
  std::mutex counting;
  int counted = 0;  // spans 0..counted-1 are in (guarded by `counting`)
  auto landed = [&](int span) {
    if (progress == nullptr || left[span].fetch_sub(1) != 1) return;
    std::lock_guard<std::mutex> guard(counting);
    while (counted < n && left[counted].load() == 0) ++counted;
    __atomic_store_n(progress, static_cast<int64_t>(counted), __ATOMIC_RELEASE);
  };
  if (progress != nullptr) {
    std::lock_guard<std::mutex> guard(counting);  // empty spans are in already
    while (counted < n && left[counted].load() == 0) ++counted;
    __atomic_store_n(progress, static_cast<int64_t>(counted), __ATOMIC_RELEASE);
  }
  int workers = std::max(1, std::min<int>(threads, static_cast<int>(pieces.size())));
  std::atomic<size_t> next{0};
  std::atomic<int> failure{0};
  CUcontext ctx;
  {
    std::lock_guard<std::mutex> guard(contexts_lock);  // another device's first use may grow the table
    ctx = contexts[device];
  }
  auto work = [&]() {
    CUresult rr = driver.CtxSetCurrent(ctx);
    CUstream stream = nullptr;
    void* buffers[2] = {nullptr, nullptr};
    CUevent done[2] = {nullptr, nullptr};
    if (rr == 0) rr = driver.StreamCreate(&stream, 0x1 /* CU_STREAM_NON_BLOCKING */);
    for (int b = 0; b < 2 && rr == 0; ++b) {
      rr = driver.MemHostAlloc(&buffers[b], chunk, 0);
      if (rr == 0) rr = driver.EventCreate(&done[b], CU_EVENT_DISABLE_TIMING);
    }
    int held[2] = {-1, -1};  // the span of the chunk each buffer last sent (-1: none in flight)
    for (int turn = 0; rr == 0 && failure.load() == 0; turn ^= 1) {
      size_t i = next.fetch_add(1);
      if (i >= pieces.size()) break;
      // The buffer's last copy must be done before it is written again.
      if (held[turn] >= 0) {
        if ((rr = driver.EventSynchronize(done[turn])) != 0) break;
        landed(held[turn]);
        held[turn] = -1;
      }
      std::memcpy(buffers[turn], pieces[i].src, pieces[i].len);
      if ((rr = driver.MemcpyHtoDAsync(pieces[i].dst, buffers[turn], pieces[i].len, stream)) != 0) break;
      if ((rr = driver.EventRecord(done[turn], stream)) != 0) break;
      held[turn] = pieces[i].span;
    }
    if (stream != nullptr) {
      CUresult s2 = driver.StreamSynchronize(stream);
      if (rr == 0) rr = s2;
      driver.StreamDestroy(stream);
      for (int b = 0; b < 2 && rr == 0; ++b) {
        if (held[b] >= 0) landed(held[b]);
      }
    }
    for (int b = 0; b < 2; ++b) {
      if (done[b] != nullptr) driver.EventDestroy(done[b]);
      if (buffers[b] != nullptr) driver.MemFreeHost(buffers[b]);
    }
    if (rr != 0) {
      int expected = 0;
      failure.compare_exchange_strong(expected, rr);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < workers; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  return failure.load();
}

int tsr_copy_pageable(int device, int n, const uint64_t* src, const uint64_t* dst, const uint64_t* size,
                      int threads, uint64_t chunk) {
  return tsr_copy_pageable_counted(device, n, src, dst, size, threads, chunk, nullptr);
}

// Device to host, synchronous: for checks (a process that opened the arena reads what another wrote).
int tsr_read(int device, uint64_t src, void* dst, size_t nbytes) {
  CUresult r = use(device);
  return r != 0 ? r : driver.MemcpyDtoH(dst, src, nbytes);
}

}  // extern "C"
