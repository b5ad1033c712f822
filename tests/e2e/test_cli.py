"""The `tessera` CLI against a running cluster with auth on: keys add/ls/rm and status find
the admin key where the cluster saved it; `tessera up` prints that key and a curl that works."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from ops import cli
from ops.localcluster import DEFAULT_MODEL_NAME, LocalCluster, default_model_path, free_port, load_admin_key
from tests.helpers.cluster import wait_for


@pytest.fixture(scope="module")
def secure(auth_cluster: LocalCluster) -> LocalCluster:
    return auth_cluster


@pytest.fixture
def tessera(secure: LocalCluster) -> Iterator[CliRunner]:
    # Wide enough that no table cell is cut; the console is the CLI's own, made at import.
    width = cli.console.width
    cli.console.width = 240
    yield CliRunner()
    cli.console.width = width


def run(runner: CliRunner, cluster: LocalCluster, *args: str) -> str:
    # No --admin-key: the CLI must find the key the cluster saved under its home.
    result = runner.invoke(
        cli.app, [*args, "--url", cluster.base_url, "--home", str(cluster.home)], env={"TESSERA_ADMIN_KEY": ""}
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_keys_add_ls_rm(tessera: CliRunner, secure: LocalCluster) -> None:
    out = run(tessera, secure, "keys", "add", "cli-key", "-m", DEFAULT_MODEL_NAME, "--rpm", "5", "--tpm", "9000")
    secret = out.strip().splitlines()[-1]
    assert secret.startswith("tsk-")
    models = httpx.get(f"{secure.base_url}/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
    assert models.status_code == 200

    listed = run(tessera, secure, "keys", "ls")
    row = next(line for line in listed.splitlines() if "cli-key" in line)
    assert DEFAULT_MODEL_NAME in row and " 5 " in row and "9000" in row
    assert secret not in listed

    again = tessera.invoke(
        cli.app,
        ["keys", "add", "cli-key", "--url", secure.base_url, "--home", str(secure.home)],
        env={"TESSERA_ADMIN_KEY": ""},
    )
    assert again.exit_code == 1 and "409" in again.output

    run(tessera, secure, "keys", "rm", "cli-key")
    assert "cli-key" not in run(tessera, secure, "keys", "ls")
    models = httpx.get(f"{secure.base_url}/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
    assert models.status_code == 401


def test_models_add_ls_rm(tessera: CliRunner, secure: LocalCluster) -> None:
    """A second name on the default GGUF (its artifact is already imported, so this is quick):
    registered with its SLOs and a sampling default, listed with them, served, removed."""
    out = run(
        tessera,
        secure,
        "models",
        "add",
        "cli-model",
        str(default_model_path()),
        "--keep-alive-s",
        "30",
        "--ttft-slo-s",
        "3",
        "--ttft-slo-per-token-s",
        "0",
        "--tpot-slo-s",
        "0.5",
        "--max-tokens",
        "7",
    )
    assert "registered cli-model" in out
    row = next(line for line in run(tessera, secure, "models", "ls").splitlines() if "cli-model" in line)
    assert " 30 " in row and " 3 " in row and "0.5" in row and "max_tokens 7" in row
    assert "gguf int4" in row  # the default GGUF's Q4_1 weights, as the artifact records them
    admin = {"Authorization": f"Bearer {load_admin_key(secure.home)}"}
    found = {m["name"]: m for m in httpx.get(f"{secure.base_url}/admin/models", headers=admin, timeout=10).json()}
    assert found["cli-model"]["ttft_slo_s"] == 3 and found["cli-model"]["ttft_slo_per_token_s"] == 0
    assert found["cli-model"]["defaults"]["max_tokens"] == 7

    assert "starting on node-0" in run(tessera, secure, "models", "scale", "cli-model", "1")
    assert "starting on none" in run(tessera, secure, "models", "scale", "cli-model", "1")  # it runs or starts there
    run(tessera, secure, "models", "rm", "cli-model")
    assert "cli-model" not in run(tessera, secure, "models", "ls")
    gone = tessera.invoke(
        cli.app,
        ["models", "rm", "cli-model", "--url", secure.base_url, "--home", str(secure.home)],
        env={"TESSERA_ADMIN_KEY": ""},
    )
    assert gone.exit_code == 1 and "404" in gone.output


def test_models_add_passes_the_weight_format_on(tessera: CliRunner, secure: LocalCluster) -> None:
    """`--weight-format` reaches the loader: a GGUF keeps its own quantization, so naming one is
    the loader's 400 (a checkpoint's export at a format: tests/e2e/test_formats.py)."""
    args = ["models", "add", "cli-wf", str(default_model_path()), "--weight-format", "int4"]
    where = ["--url", secure.base_url, "--home", str(secure.home)]
    refused = tessera.invoke(cli.app, [*args, *where], env={"TESSERA_ADMIN_KEY": ""})
    assert refused.exit_code == 1 and "400" in refused.output and "weight_format" in refused.output


def test_a_wrong_admin_key_is_refused_with_the_gateways_message(tessera: CliRunner, secure: LocalCluster) -> None:
    result = tessera.invoke(cli.app, ["keys", "ls", "--url", secure.base_url, "--admin-key", "tsk-nope"])
    assert result.exit_code == 1
    assert "401" in result.output and "Incorrect API key" in result.output


def test_status_shows_nodes_instances_memory_host_cache_and_cold_starts(
    tessera: CliRunner, secure: LocalCluster
) -> None:
    r = httpx.post(
        f"{secure.base_url}/v1/chat/completions",
        headers=secure.admin_headers,
        timeout=120,
        json={"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text

    def worker_pid() -> int:
        status = httpx.get(f"{secure.base_url}/admin/instances", headers=secure.admin_headers, timeout=10).json()
        return int(status["nodes"][0]["instances"][0]["worker_pid"])  # 0 until a heartbeat names it

    pid = wait_for(worker_pid, 10, "the heartbeat to name the instance's worker")

    loader = f"http://127.0.0.1:{secure.procs['loader@node-0'].http_port}"
    out = run(tessera, secure, "status", "--metrics", f"node-0={loader}")
    lines = out.splitlines()
    titles = {
        line.strip(): i for i, line in enumerate(lines) if line.strip() in ("nodes", "instances", "recent cold starts")
    }
    assert list(titles) == ["nodes", "instances", "recent cold starts"], out
    node_row = next(line for line in lines[titles["nodes"] : titles["instances"]] if "node-0" in line)
    # Memory from the heartbeat; the host cache (bytes / budget, models) from the loader's /metrics.
    assert re.search(r"\d+(\.\d)? [KMG]?i?B / \d+(\.\d)? [KMG]?i?B \(\d+ models\)", node_row), node_row
    instance_row = next(
        line for line in lines[titles["instances"] : titles["recent cold starts"]] if DEFAULT_MODEL_NAME in line
    )
    assert f" {pid} " in instance_row and ("start" in instance_row or "steady" in instance_row), instance_row
    assert any(DEFAULT_MODEL_NAME in line and "node-0" in line for line in lines[titles["recent cold starts"] :])


def test_up_prints_an_admin_key_saved_0600_and_a_curl_that_carries_it(tmp_path: Path, model_store: Path) -> None:
    port = free_port()
    home = tmp_path / "home"
    home.mkdir()
    (home / "store").symlink_to(model_store)  # the conversion the other tests made is reused
    log = tmp_path / "up.log"
    env = {**os.environ, "COLUMNS": "80", "TESSERA_AUTH": "on"}
    env.pop("TESSERA_ADMIN_KEY", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "up", "--port", str(port), "--home", str(home)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_for(
            lambda: "Ctrl-C stops everything" in log.read_text() or proc.poll() is not None,
            300,
            "tessera up to print that it is ready",
        )
        assert proc.poll() is None, log.read_text()
        text = log.read_text()
        saved = home / "admin_key"
        key = saved.read_text().strip()
        assert stat.S_IMODE(saved.stat().st_mode) == 0o600
        assert f"admin key: {key}" in text
        curl = next(line for line in text.splitlines() if line.startswith("curl "))
        assert f"Authorization: Bearer {key}" in curl
        # The printed line, run as printed but for a short answer (its body sets no max_tokens).
        argv = shlex.split(curl)
        body = argv.index("-d") + 1
        argv[body] = json.dumps({**json.loads(argv[body]), "max_tokens": 4})
        answer = subprocess.run(
            [*argv, "-s", "-w", "\n%{http_code}"], check=True, capture_output=True, text=True, timeout=120
        )
        assert answer.stdout.rstrip().endswith("200"), answer.stdout
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 401
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
