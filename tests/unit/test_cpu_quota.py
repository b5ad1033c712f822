"""A node's CPU quota (services/engine/cpu_quota.py): a cgroup with the quota around the
process while it runs, gone afterwards (run in a child process: tests/integration/test_cpu_quota.py);
here, none asked for is none applied."""

from __future__ import annotations

from shared.cpu_quota import cpu_quota

CHILD = r"""
import json, pathlib, sys
from shared.cpu_quota import cpu_quota, ROOT
def group():
    for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
        hid, ctrl, path = line.split(":", 2)
        if "cpu" in ctrl.split(",") or hid == "0":
            if path.strip("/") and "tessera-" in path:
                return path
    return ""
with cpu_quota(0.5, "test") as ok:
    inside = group()
    d = ROOT / ("cpu" if (ROOT / "cpu" / "cpu.cfs_quota_us").exists() else "") / inside.lstrip("/")
    quota = (d / "cpu.cfs_quota_us").read_text().strip() if (d / "cpu.cfs_quota_us").exists() \
        else (d / "cpu.max").read_text().split()[0]
print(json.dumps({"ok": ok, "inside": inside, "quota": int(quota), "after": group(), "exists": d.exists()}))
"""


def test_no_quota_asked_for_is_none_applied() -> None:
    with cpu_quota(0, "none") as ok:
        assert ok is False
