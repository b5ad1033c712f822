"""A node's CPU quota (services/engine/cpu_quota.py): a cgroup with the quota around the
process while it runs, gone afterwards (run in a child process: tests/integration/test_cpu_quota.py);
here, none asked for is none applied."""

from __future__ import annotations

from shared.cpu_quota import cpu_quota


def test_no_quota_asked_for_is_none_applied() -> None:
    with cpu_quota(0, "none") as ok:
        assert ok is False
