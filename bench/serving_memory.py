"""Resident memory of the serving processes in `bench/serving.py`: the peak of their summed RSS,
sampled in a thread."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

RSS_SAMPLE_S = 0.2


# --- resident memory -----------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident bytes of one process now (0 if it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def descendants(root: int) -> list[int]:
    """Every live descendant of `root`, from /proc (an engine's worker processes)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


class PeakSampler:
    """The peak of `read()`, sampled every `interval_s` in a thread while the block runs."""

    def __init__(self, read: Callable[[], int], interval_s: float = RSS_SAMPLE_S) -> None:
        self.read, self.interval_s = read, interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peak-sampler", daemon=True)

    def _loop(self) -> None:
        while True:
            self.peak = max(self.peak, self.read())
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class RssSampler(PeakSampler):
    """The peak of the summed resident memory of the serving processes, sampled every 0.2 s in
    a thread. `pids` is asked at every sample: an engine may spawn workers meanwhile."""

    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        super().__init__(lambda: sum(rss_bytes(p) for p in pids()))
