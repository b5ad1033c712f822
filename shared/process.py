"""Child processes that do not outlive their parent.

Light on purpose: a spawned engine worker imports it before anything else, and
`subprocess.Popen(preexec_fn=...)` runs it in the child between fork and exec.
"""

from __future__ import annotations

import ctypes
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
