"""Child processes that do not outlive their parent.

Light on purpose: a spawned engine worker imports it before anything else, and
`subprocess.Popen(preexec_fn=...)` runs it in the child between fork and exec.
"""

from __future__ import annotations

import ctypes
import importlib
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent goes away (Linux's
    PR_SET_PDEATHSIG), so that a crashed supervisor, engine or benchmark never leaves a child
    holding cores or memory. Elsewhere (no prctl) it does nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def run_worker(entry: str, *args: object) -> None:
    """A spawned worker's first step, in the child: it dies with its parent and leaves SIGINT (a
    terminal's Ctrl-C reaches the whole process group) to the parent, which decides when it
    ends; then its entry function (`module:function`) is imported here, in the child, and called
    with `args`. The parent names the entry and never imports it (nor the runtime it loads)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    module, _, function = entry.partition(":")
    getattr(importlib.import_module(module), function)(*args)
