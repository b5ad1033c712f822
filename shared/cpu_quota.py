"""A node's share of the machine's CPU time: a cgroup with a CFS quota around the engine and
the workers it spawns (`TESSERA_CPU_QUOTA`, in cores).

Pinning gives a node whole cores; a quota gives it any share (three nodes on two cores get
2/3 of a core each, and none can take another's time, which pinned nodes sharing a core
would). In containers the runtime does this (`cpus:` in compose.yaml); a local cluster run as
root does it here, through cgroup v1's `cpu` controller or cgroup v2's `cpu.max`. Where
neither can be written the engine says so and runs without a quota.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000
"""A short period: a node past its quota waits at most the rest of 10 ms, not of 100 ms
(the default), which would show as a stall in its requests' time per token."""


def _v1() -> Path | None:
    d = ROOT / "cpu"
    return d if (d / "cpu.cfs_quota_us").exists() and os.access(d, os.W_OK) else None


def _v2() -> Path | None:
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
    except (OSError, StopIteration):
        return None
    d = ROOT / line[3:].lstrip("/")
    controllers = d / "cgroup.subtree_control"
    try:
        if "cpu" not in controllers.read_text().split():
            controllers.write_text("+cpu")
    except OSError:
        return None
    return d


def supported() -> bool:
    """Whether this process could put itself under a quota."""
    return _v1() is not None or _v2() is not None


@contextmanager
def cpu_quota(cores: float, name: str) -> Iterator[bool]:
    """Run the block (and every process spawned in it) within `cores` of CPU time; yields
    whether the quota holds. The cgroup is removed on exit (its processes must have ended)."""
    if cores <= 0:
        yield False
        return
    quota_us = max(1000, int(cores * PERIOD_US))
    v1 = _v1()
    parent = v1 or _v2()
    if parent is None:
        log.warning("no writable cgroup: running without the CPU quota of %.2f cores", cores)
        yield False
        return
    group = parent / f"tessera-{name}-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        if v1 is not None:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (group / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        log.warning("could not set a CPU quota of %.2f cores (%s): running without it", cores, e)
        _remove(group, parent)
        yield False
        return
    log.info("CPU quota: %.2f cores (%d us every %d us) in %s", cores, quota_us, PERIOD_US, group)
    try:
        yield True
    finally:
        _remove(group, parent)


def _remove(group: Path, parent: Path) -> None:
    """Move this process, and whatever it spawned that is still there (multiprocessing's
    resource tracker outlives the engine's service), back to the parent; then remove it."""
    try:
        pids = {str(os.getpid()), *(group / "cgroup.procs").read_text().split()}
        for pid in pids:
            try:
                (parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # a process that has just ended
        group.rmdir()
    except OSError as e:
        log.warning("could not remove %s: %s", group, e)
