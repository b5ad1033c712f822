"""Build llama.cpp's `llama-server` from source once and cache it: the benchmarks' peer.

    python -m bench.llama_server        # prints the binary's path (builds it the first time)

Why from source: the prebuilt llama.cpp (wheels, release binaries) dies on AMX code paths on
the machines these benchmarks ran on, so they build it with AMX off, AVX2 on and AVX-512 on
where the CPU has it (a binary with AVX-512 dies with SIGILL on an AVX2-only CPU), statically
linked so that the one binary is all a run needs. The source is the one vendored in the
llama-cpp-python sdist on PyPI (an ordinary `pip download`), so the version is pinned by one
number, `LLAMA_CPP_PYTHON_VERSION`, and the build is reproducible on a fresh clone.

The binary lives at `~/.cache/tessera/llama-server/<version>/llama-server`; the environment
variable `TESSERA_LLAMA_SERVER` overrides that path (it may name a binary built elsewhere).
A build takes about 6 minutes on 2 cores.

`LlamaServer` runs one server on loopback for a benchmark: started, polled until `/health`
answers, stopped by its PID (SIGTERM, then SIGKILL), and killed by the kernel if the
benchmark dies first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from ops.localcluster import free_port
from shared.process import die_with_parent

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
ENV_VAR = "TESSERA_LLAMA_SERVER"
# AMX off (the prebuilt code paths die here), AVX2 on, no curl (models are local files),
# static libraries so the binary is self-contained once copied into the cache.
BASE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
)
# What ggml's AVX-512 variant compiles with (-mavx512f/cd/vl/dq/bw): all of them, or it is off.
AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"})
FLAGS_FILE = "build-flags.txt"  # beside the cached binary: what it was configured with
BUILD_JOBS = 2
HEALTH_POLL_S = 0.005  # fine-grained: the cold-start benchmark times the wait for /health
STOP_GRACE_S = 10.0


def log(msg: str) -> None:
    print(f"[llama_server] {msg}", file=sys.stderr, flush=True)


def cpu_flags() -> set[str]:
    """The CPU's feature flags, from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_flags() -> tuple[str, ...]:
    """The configure flags for this machine: AVX-512 on only where the CPU has it. A binary
    built with it dies with SIGILL on a CPU without it (an AVX2-only EPYC, say) at model load."""
    avx512 = "ON" if AVX512_CPU_FLAGS <= cpu_flags() else "OFF"
    return (*BASE_FLAGS, f"-DGGML_AVX512={avx512}")


def cached_path() -> Path:
    """Where the binary is (or will be): `$TESSERA_LLAMA_SERVER`, else the versioned cache."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "tessera" / "llama-server" / LLAMA_CPP_PYTHON_VERSION / "llama-server"


def download_source(dest: Path) -> Path:
    """The llama.cpp source tree vendored in the llama-cpp-python sdist, unpacked under `dest`."""
    # `--no-binary llama-cpp-python` (not `:all:`): the sdist, not a wheel, for this package
    # only; with `:all:` pip also builds every build dependency of the sdist's metadata step
    # (scikit-build-core, hatchling, ...) from source, which takes minutes for nothing.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            "llama-cpp-python",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            "-d",
            str(dest),
        ],
        check=True,
    )
    (sdist,) = dest.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (source,) = dest.glob("llama_cpp_python-*/vendor/llama.cpp")
    return source


def build(source: Path) -> Path:
    """Configure and build only the `llama-server` target; returns the built binary."""
    build_dir = source / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *cmake_flags()], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", f"-j{BUILD_JOBS}"], check=True)
    binary = build_dir / "bin" / "llama-server"
    if not binary.is_file():
        raise RuntimeError(f"the build produced no {binary}")
    return binary


def install(binary: Path, target: Path) -> None:
    """Copy into the cache atomically (a temporary name, then rename), so that an interrupted
    copy never leaves a half-written binary that a later run would take as built; the flags it
    was built with go beside it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    shutil.copy2(binary, tmp)
    tmp.chmod(0o755)
    (target.parent / FLAGS_FILE).write_text("\n".join(cmake_flags()) + "\n")
    tmp.replace(target)


def built_for_this_cpu(target: Path) -> bool:
    """Whether the cached binary was configured as this machine needs (a home shared with a
    machine that has AVX-512 may hold a binary that dies here)."""
    try:
        return (target.parent / FLAGS_FILE).read_text().split() == list(cmake_flags())
    except OSError:
        return False


def ensure_llama_server() -> Path:
    """The cached `llama-server` binary, built from source the first time it is asked for."""
    target = cached_path()
    if os.environ.get(ENV_VAR):  # the user's binary, taken as it is
        if not (target.is_file() and os.access(target, os.X_OK)):
            raise FileNotFoundError(f"{ENV_VAR}={target} is not an executable file")
        return target
    if target.is_file() and os.access(target, os.X_OK) and built_for_this_cpu(target):
        return target
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool} on PATH")
    log(
        f"building llama-server from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s llama.cpp "
        f"(takes minutes) into {target}"
    )
    with tempfile.TemporaryDirectory(prefix="tessera-llama-build-") as tmp:
        install(build(download_source(Path(tmp))), target)
    log(f"built {target}")
    return target


class LlamaServer:
    """One `llama-server` on a free loopback port: `start()`, `wait_ready()`, `stop()`.

    Split in three so that a cold-start measurement can time the spawn and the load apart;
    as a context manager it starts, waits and always stops."""

    def __init__(self, gguf: Path | str, *, threads: int, ctx: int, parallel: int, extra: Sequence[str] = ()) -> None:
        self.binary = ensure_llama_server()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            str(self.binary),
            "-m",
            str(gguf),
            "-t",
            str(threads),
            "-c",
            str(ctx),
            "--parallel",
            str(parallel),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )

    def wait_ready(self, timeout_s: float = 120.0, http: httpx.Client | None = None) -> None:
        """Poll `/health` until it answers 200 (503 while loading; refused before it listens);
        fail fast, with its log, if the process died. A cold-start measurement passes a client
        made before its clock started (making one takes tens of milliseconds)."""
        assert self.proc is not None, "not started"
        if http is None:
            with httpx.Client() as own:
                return self.wait_ready(timeout_s, own)
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if http.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        raise TimeoutError(f"llama-server not ready within {timeout_s}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; by PID, only this server."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:].decode(errors="replace")

    def __enter__(self) -> LlamaServer:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main() -> int:
    print(ensure_llama_server())
    return 0


if __name__ == "__main__":
    sys.exit(main())
