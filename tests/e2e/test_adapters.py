"""LoRA adapters on a registered base (issue 34), registration side: an adapter made here with
PEFT on the tiny Hugging Face checkpoint (`tests/helpers/adapters.py`: nonzero B matrices, so
that it changes the base's greedy output) is registered on that checkpoint, kept checked in
the store beside the base's artifact, listed in `/v1/models` with its base as `parent`, and
removed; every adapter that does not fit is a 400 that says why, with nothing left in the
store; a base with adapters is removed only with `?cascade=true`; a key scoped to an adapter
may use it alone. Serving them: `test_adapter_serving.py`."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import Result
from typer.testing import CliRunner

from ops import cli
from ops.localcluster import DEFAULT_MODEL_NAME, LocalCluster
from tests.helpers.adapters import make_adapter
from tests.helpers.cluster import register

BASE = "lora-base"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    return make_adapter(checkpoint, tmp_path_factory.mktemp("lora-adapter") / "a", seed=1)


@pytest.fixture(scope="module")
def base(cluster: LocalCluster, checkpoint: Path) -> Iterator[dict[str, Any]]:
    record = register(cluster, BASE, source=str(checkpoint))
    yield record
    httpx.delete(f"{cluster.base_url}/admin/models/{BASE}?cascade=true", timeout=30)


def _add(cluster: LocalCluster, name: str, source: Path, base: str = BASE, **extra: object) -> httpx.Response:
    return httpx.post(
        f"{cluster.base_url}/admin/models/{base}/adapters",
        json={"name": name, "source": str(source), **extra},
        timeout=300,
    )


def _cards(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{cluster.base_url}/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    return {c["id"]: c for c in r.json()["data"]}


def _store_adapters(base: dict[str, Any]) -> set[str]:
    """Everything in the base artifact's adapters directory (temporary entries too)."""
    root = Path(base["artifact"]["path"]) / "adapters"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def test_an_adapter_registers_lists_under_its_base_and_is_removed(
    cluster: LocalCluster, base: dict[str, Any], adapter: Path
) -> None:
    r = _add(cluster, "lora-a", adapter, keep_alive_s=30, ttft_slo_s=3)
    assert r.status_code == 201, r.text
    record = r.json()
    assert record["base"] == BASE and record["keep_alive_s"] == 30 and record["ttft_slo_s"] == 3
    kept = record["adapter"]
    assert kept["base_artifact_id"] == base["artifact"]["artifact_id"]
    assert kept["rank"] == 8 and kept["alpha"] == 16 and kept["scale"] == 2.0
    assert kept["targets"] == ["q_proj", "v_proj"] and kept["layers"] == 2

    # The checked copy the engine will apply, and its manifest, beside the base's artifact.
    where = Path(kept["path"])
    assert where.parent == Path(base["artifact"]["path"]) / "adapters"
    weights = (where / "adapter_model.safetensors").read_bytes()
    assert weights == (adapter / "adapter_model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() == kept["sha256"] and len(weights) == kept["nbytes"]
    assert json.loads((where / "manifest.json").read_text())["adapter_id"] == kept["adapter_id"]
    assert json.loads((where / "adapter_config.json").read_text())["peft_type"] == "LORA"

    cards = _cards(cluster)
    assert cards["lora-a"]["parent"] == BASE and cards["lora-a"]["root"] == BASE
    assert cards[BASE]["parent"] is None
    one = httpx.get(f"{cluster.base_url}/v1/models/lora-a", timeout=10).json()
    assert one["id"] == "lora-a" and one["parent"] == BASE
    listed = httpx.get(f"{cluster.base_url}/admin/models/{BASE}/adapters", timeout=10).json()
    assert [a["name"] for a in listed] == ["lora-a"]

    # A second name on the same adapter shares the store's copy.
    again = _add(cluster, "lora-a2", adapter)
    assert again.status_code == 201, again.text
    assert again.json()["adapter"]["path"] == kept["path"]

    assert httpx.delete(f"{cluster.base_url}/admin/models/{BASE}/adapters/lora-a", timeout=10).status_code == 200
    assert httpx.delete(f"{cluster.base_url}/admin/models/{BASE}/adapters/lora-a", timeout=10).status_code == 404
    assert httpx.delete(f"{cluster.base_url}/admin/models/{BASE}/adapters/lora-a2", timeout=10).status_code == 200
    assert "lora-a" not in _cards(cluster)
    assert httpx.get(f"{cluster.base_url}/admin/models/{BASE}/adapters", timeout=10).json() == []


def test_an_adapter_shares_its_bases_tokenizer(cluster: LocalCluster, base: dict[str, Any], adapter: Path) -> None:
    assert _add(cluster, "lora-req", adapter).status_code == 201
    try:
        # Its base's tokenizer is its own: /tokenize serves it (as vLLM's does an adapter).
        ids = [
            httpx.post(f"{cluster.base_url}/tokenize", json={"model": m, "prompt": "Hi there"}, timeout=30).json()
            for m in ("lora-req", BASE)
        ]
        assert ids[0]["tokens"] and ids[0] == ids[1]
    finally:
        httpx.delete(f"{cluster.base_url}/admin/models/{BASE}/adapters/lora-req", timeout=10)


def _copy(adapter: Path, dest: Path) -> Path:
    shutil.copytree(adapter, dest)
    return dest


def _with_config(adapter: Path, dest: Path, **change: object) -> Path:
    _copy(adapter, dest)
    config = json.loads((dest / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps({**config, **change}))
    return dest


def _renamed(adapter: Path, dest: Path, old: str, new: str) -> Path:
    """The adapter with its `old` linears' matrices named as `new` ones (and its config too)."""
    from safetensors.numpy import load_file, save_file

    _with_config(adapter, dest, target_modules=[new])
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file(
        {k.replace(f".{old}.", f".{new}."): v for k, v in tensors.items() if f".{old}." in k},
        dest / "adapter_model.safetensors",
    )
    return dest


def _refused(cluster: LocalCluster, source: Path, base: str = BASE) -> dict[str, Any]:
    r = _add(cluster, "lora-bad", source, base=base)
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


def test_adapters_that_do_not_fit_are_400s_that_say_why_and_leave_nothing_in_the_store(
    cluster: LocalCluster, base: dict[str, Any], adapter: Path, checkpoint: Path, tmp_path: Path
) -> None:
    before = _store_adapters(base)

    error = _refused(cluster, adapter, base="no-such-base")
    assert error["param"] == "base" and "`no-such-base` is not registered" in error["message"]

    # A model directory, not an adapter.
    assert "no adapter_config.json" in _refused(cluster, checkpoint)["message"]
    # Another PEFT method's adapter.
    prompt = _with_config(adapter, tmp_path / "prompt", peft_type="PROMPT_TUNING")
    assert "not 'LORA'" in _refused(cluster, prompt)["message"]
    # A pickled adapter: no safetensors to read.
    pickled = _copy(adapter, tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    assert "safe_serialization=True" in _refused(cluster, pickled)["message"]
    # A rank that is not its tensors'.
    rank = _with_config(adapter, tmp_path / "rank", r=4)
    assert "rank 4 on this base needs 4×64" in _refused(cluster, rank)["message"]
    # A module the base has no linear of.
    fused = _renamed(adapter, tmp_path / "fused", "q_proj", "qkv_proj")
    assert "self_attn.qkv_proj, which a llama base does not have" in _refused(cluster, fused)["message"]
    # Made for another base: the tiny checkpoint's adapter on the default model (hidden 576,
    # read from its GGUF's metadata).
    error = _refused(cluster, adapter, base=DEFAULT_MODEL_NAME)
    assert error["param"] == "source" and "needs 8×576" in error["message"]
    # A truncated file.
    cut = _copy(adapter, tmp_path / "cut")
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[:-100])
    assert "truncated or corrupt" in _refused(cluster, cut)["message"]

    assert _store_adapters(base) == before
    assert "lora-bad" not in _cards(cluster)


def test_names_are_shared_with_models(cluster: LocalCluster, base: dict[str, Any], adapter: Path) -> None:
    r = _add(cluster, DEFAULT_MODEL_NAME, adapter)
    assert r.status_code == 409 and r.json()["error"]["param"] == "name"


def test_a_base_with_adapters_is_removed_only_with_cascade(
    cluster: LocalCluster, checkpoint: Path, adapter: Path
) -> None:
    register(cluster, "lora-base-2", source=str(checkpoint))
    assert _add(cluster, "lora-c1", adapter, base="lora-base-2").status_code == 201
    assert _add(cluster, "lora-c2", adapter, base="lora-base-2").status_code == 201

    r = httpx.delete(f"{cluster.base_url}/admin/models/lora-base-2", timeout=10)
    assert r.status_code == 409, r.text
    assert "lora-c1, lora-c2" in r.json()["error"]["message"] and "cascade=true" in r.json()["error"]["message"]
    assert {"lora-base-2", "lora-c1", "lora-c2"} <= set(_cards(cluster))

    r = httpx.delete(f"{cluster.base_url}/admin/models/lora-base-2?cascade=true", timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["adapters_removed"] == ["lora-c1", "lora-c2"]
    assert not {"lora-base-2", "lora-c1", "lora-c2"} & set(_cards(cluster))


def _cli(cluster: LocalCluster, *args: str) -> Result:
    # No --admin-key: the CLI finds the key the cluster saved under its home.
    return CliRunner().invoke(
        cli.app, [*args, "--url", cluster.base_url, "--home", str(cluster.home)], env={"TESSERA_ADMIN_KEY": ""}
    )


def _ok(result: Result) -> str:
    assert result.exit_code == 0, result.output
    return result.output


def test_the_cli_and_a_key_scoped_to_an_adapter(auth_cluster: LocalCluster, checkpoint: Path, adapter: Path) -> None:
    """With auth on: `tessera models add-adapter` registers, `models ls` shows the adapter under
    its base, and a key scoped to the adapter sees and may use the adapter alone, as a key
    scoped to a model does."""
    c = auth_cluster
    width, cli.console.width = cli.console.width, 240  # no table cell cut
    try:
        _ok(_cli(c, "models", "add", "lora-auth-base", str(checkpoint)))
        assert "registered adapter lora-k on lora-auth-base (rank 8, q_proj/v_proj)" in _ok(
            _cli(c, "models", "add-adapter", "lora-auth-base", "lora-k", str(adapter), "--keep-alive-s", "45")
        )
        rows = _ok(_cli(c, "models", "ls")).splitlines()
        base_at = next(i for i, line in enumerate(rows) if "lora-auth-base " in line)
        under = next(line for line in rows[base_at:] if "└ lora-k" in line)
        assert "LoRA r8" in under and " 45 " in under

        secret = _ok(_cli(c, "keys", "add", "adapter-key", "-m", "lora-k")).strip().splitlines()[-1]
        key = {"Authorization": f"Bearer {secret}"}
        listed = httpx.get(f"{c.base_url}/v1/models", headers=key, timeout=10).json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [("lora-k", "lora-auth-base")]
        assert httpx.get(f"{c.base_url}/v1/models/lora-k", headers=key, timeout=10).status_code == 200
        assert httpx.get(f"{c.base_url}/v1/models/lora-auth-base", headers=key, timeout=10).status_code == 403

        def chat(model: str) -> httpx.Response:
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            return httpx.post(f"{c.base_url}/v1/chat/completions", headers=key, json=body, timeout=60)

        # The key may use the adapter (served on its base, named by it), not the base.
        served = chat("lora-k")
        assert served.status_code == 200 and served.json()["model"] == "lora-k", served.text
        assert chat("lora-auth-base").status_code == 403

        refused = _cli(c, "models", "rm", "lora-auth-base")
        assert refused.exit_code == 1 and "409" in refused.output and "cascade" in refused.output
        assert "and its adapters lora-k" in _ok(_cli(c, "models", "rm", "lora-auth-base", "--cascade"))
        assert "lora-k" not in _ok(_cli(c, "models", "ls"))
    finally:
        cli.console.width = width
