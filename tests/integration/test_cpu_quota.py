"""A node's CPU quota (services/engine/cpu_quota.py): a cgroup with the quota around the
process while it runs, gone afterwards. Run in a child process so that pytest's own cgroup is
never touched; skipped where no cgroup can be written (then the engine runs without one)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shared.cpu_quota import PERIOD_US, supported

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


@pytest.mark.skipif(not supported(), reason="no writable cgroup here")
def test_the_engine_runs_in_a_cgroup_with_its_quota_and_removes_it() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"] and "tessera-test-" in r["inside"]
    assert r["quota"] == PERIOD_US // 2
    assert r["after"] == "" and not r["exists"]
