"""`tessera up` (what `make up` runs): prints the URL and a curl line, serves, and Ctrl-C
stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from ops.localcluster import free_port
from tests.helpers.cluster import wait_for


def children_of(pid: int) -> set[int]:
    """Every live descendant of `pid`, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_up_serves_the_default_model_and_ctrl_c_leaves_no_process(tmp_path: Path, model_store: Path) -> None:
    port = free_port()
    log = tmp_path / "up.log"
    home = tmp_path / "home"
    # The store of the other tests already holds the conversion: link it in to reuse it.
    home.mkdir()
    (home / "store").symlink_to(model_store)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "up", "--port", str(port), "--home", str(home)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "80"},
        )
    try:
        wait_for(
            lambda: "Ctrl-C stops everything" in log.read_text() or proc.poll() is not None,
            300,
            "tessera up to print that it is ready",
        )
        assert proc.poll() is None, log.read_text()
        text = log.read_text()
        assert f"http://127.0.0.1:{port}/v1" in text
        curl = next(line for line in text.splitlines() if line.startswith("curl "))
        assert "SmolLM2-135M-Instruct" in curl and curl.rstrip().endswith("'")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
        started = children_of(proc.pid)
        assert len(started) >= 7  # nats, valkey and five services

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "no process left behind" in log.read_text()
        # Every process it started is gone (reaped, not a zombie) within a few seconds.
        wait_for(lambda: not {p for p in started if _alive(p)}, 15, "every started process to be gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
