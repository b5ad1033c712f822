"""Build the CUDA extension (`csrc/tessera_cuda.cpp`) into `csrc/_tessera_cuda.so`.

`make install` runs `python -m cuda_ext.build --if-cuda`: it builds only where a CUDA driver is
present (elsewhere the arena runs on torch's own allocations, or host memory, with the same API).
The source calls the driver through dlopen, so a C++ compiler is all the build needs: no CUDA
toolkit, no torch headers. `python -m cuda_ext.build` builds anywhere (the tests check that the
source compiles and that a host without a driver gets a clear error from it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "tessera_cuda.cpp"
LIBRARY = Path(__file__).parent / "csrc" / "_tessera_cuda.so"


def driver_present() -> bool:
    """Whether this machine has a CUDA driver to load (what a GPU node has)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler (set CXX): the CUDA extension is not built")


def build(out: Path = LIBRARY) -> Path:
    """Compile the extension to `out` (atomically: a process loading the old one is not hurt)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    # libstdc++ linked in: the library loads in an image that has no C++ runtime (python:*-slim).
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-static-libstdc++", "-static-libgcc"]
    cmd = [compiler(), *flags, "-o", str(tmp), str(SOURCE), "-ldl"]
    subprocess.run(cmd, check=True)
    tmp.replace(out)
    return out


def ensure(out: Path = LIBRARY) -> Path:
    """The extension, built if it is missing or older than its source; one built elsewhere is
    used as it is where this machine has no compiler."""
    if out.exists() and (out.stat().st_mtime >= SOURCE.stat().st_mtime or not _has_compiler()):
        return out
    return build(out)


def _has_compiler() -> bool:
    try:
        compiler()
    except RuntimeError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--if-cuda", action="store_true", help="build only where a CUDA driver is present")
    parser.add_argument("--out", type=Path, default=LIBRARY)
    args = parser.parse_args(argv)
    if args.if_cuda and not driver_present():
        print("cuda_ext: no CUDA driver here, the extension is not built (the arena uses torch or host memory)")
        return 0
    print(f"cuda_ext: built {build(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
