"""LoRA adapters served on their base (issue 34), on the real OpenVINO engine: an adapter made
here with PEFT on the tiny Hugging Face checkpoint (`tests/helpers/adapters.py`) is registered
on that checkpoint and requested by its own name. Its answer is the library's own greedy
answer for that adapter on the base's exported IR (an in-process OpenVINO GenAI pipeline built
as `tests/integration/test_adapter_genai.py` builds it, on the store's IR, at the adapter's
scale), not the base's; requests for two adapters and the base at once each get their own
answer; an adapter idle its keep-alive is dropped from its base's instance and comes back on
its next request with no new start of its base; an adapter registered while its base is warm,
on linears the base's core was not built to update, is served right (the core is built again
for it, the instance stays); a pinned adapter keeps its base warm and stays loaded (issue 35)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from ops.localcluster import LocalCluster
from tests.conftest import TEST_ENV
from tests.helpers.adapters import LLAMA_TARGETS, make_adapter
from tests.helpers.cluster import cold_starts, on_the_core, register, wait_for

BASE = "lora-serve"
PROMPT = "The capital of France is"
TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-serve")
    return {name: make_adapter(tiny_checkpoint, root / name, seed=seed) for name, seed in (("ad-a", 1), ("ad-b", 2))}


@pytest.fixture(scope="module")
def base(cluster: LocalCluster, tiny_checkpoint: Path, adapters: dict[str, Path]) -> Iterator[dict[str, Any]]:
    record = register(cluster, BASE, source=str(tiny_checkpoint))
    for name, source in adapters.items():
        r = httpx.post(
            f"{cluster.base_url}/admin/models/{BASE}/adapters",
            json={"name": name, "source": str(source)},
            timeout=300,
        )
        assert r.status_code == 201, r.text
    yield record
    httpx.delete(f"{cluster.base_url}/admin/models/{BASE}?cascade=true", timeout=30)


def _complete(cluster: LocalCluster, model: str, stream: bool = False) -> tuple[str, str]:
    """(the answer's `model`, its text), greedy, `TOKENS` tokens, without the checkpoint's
    default repetition penalty (the library's plain greedy is what it is compared with)."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "repetition_penalty": 1.0,
    }
    if not stream:
        r = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["model"], r.json()["choices"][0]["text"]
    import json

    text, named = "", ""
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                named = event["model"]
                text += "".join(c["text"] for c in event["choices"])
    return named, text


def _library_greedy(cluster: LocalCluster, base: dict[str, Any], adapter: dict[str, Any] | None) -> str:
    """OpenVINO GenAI's own greedy text on the store's IR of the base, with `adapter` (its kept
    file, at its manifest's scale) or none, from the ids the gateway sends for `PROMPT`."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    ids = httpx.post(f"{cluster.base_url}/tokenize", json={"model": BASE, "prompt": PROMPT}, timeout=30).json()
    ir = base["artifact"]["path"]
    kept = (
        {"ad": ov_genai.Adapter(str(Path(adapter["adapter"]["path"]) / "adapter_model.safetensors"))} if adapter else {}
    )
    scheduler = ov_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False
    pipe = ov_genai.ContinuousBatchingPipeline(
        ir,
        ov_genai.Tokenizer(ir),
        scheduler,
        "CPU",
        **({"adapters": ov_genai.AdapterConfig(kept["ad"])} if kept else {}),
    )
    config = ov_genai.GenerationConfig(max_new_tokens=TOKENS, do_sample=False, ignore_eos=True)
    config.adapters = (
        ov_genai.AdapterConfig(kept["ad"], adapter["adapter"]["scale"]) if adapter else ov_genai.AdapterConfig()
    )
    [result] = pipe.generate([ov.Tensor(np.asarray([ids["tokens"]], dtype=np.int64))], [config])
    tokens = [int(t) for t in result.m_generation_ids[0]]
    assert len(tokens) == TOKENS
    return str(ov_genai.Tokenizer(ir).decode(tokens))


def _adapter(cluster: LocalCluster, name: str) -> dict[str, Any]:
    listed = httpx.get(f"{cluster.base_url}/admin/models/{BASE}/adapters", timeout=10).json()
    return next(a for a in listed if a["name"] == name)


def _cached(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    """The node's host-cache entries, by key."""
    [node_cache] = httpx.get(f"{cluster.base_url}/admin/cache", timeout=10).json()
    return {e["artifact_id"]: e for e in node_cache["entries"]}


def test_an_adapter_gives_the_librarys_greedy_answer_for_it_not_its_bases(
    cluster: LocalCluster, base: dict[str, Any]
) -> None:
    named, text = _complete(cluster, "ad-a")
    assert named == "ad-a"
    base_named, base_text = _complete(cluster, BASE)
    assert base_named == BASE
    assert text != base_text  # the adapter is applied
    assert text == _library_greedy(cluster, base, _adapter(cluster, "ad-a"))
    assert base_text == _library_greedy(cluster, base, None)
    # Streamed, and as a chat: served on the adapter, named by it.
    assert _complete(cluster, "ad-a", stream=True) == ("ad-a", text)
    r = httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        json={"model": "ad-a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": False},
        timeout=300,
    )
    assert r.status_code == 200 and r.json()["model"] == "ad-a", r.text
    r = httpx.post(
        f"{cluster.base_url}/v1/responses", json={"model": "ad-a", "input": "Hi", "max_output_tokens": 3}, timeout=300
    )
    assert r.status_code == 200 and r.json()["model"] == "ad-a", r.text
    # Its start on the warm base was recorded as an adapter's, read from the store.
    [start] = wait_for(lambda: cold_starts(cluster, "ad-a"), 30, "the adapter's start record")
    assert start["tier"] == "adapter" and start["source"] == "store"
    phases = cast(dict[str, float], start["phases"])
    assert phases["load_s"] >= 0 and phases["apply_s"] > 0  # applying is a pass of the pipeline


def test_two_adapters_and_the_base_at_once_each_get_their_own_answer(
    cluster: LocalCluster, base: dict[str, Any]
) -> None:
    alone = {m: _complete(cluster, m)[1] for m in ("ad-a", "ad-b", BASE)}
    assert len(set(alone.values())) == 3
    # As many at once as the suite's gateway admits (TEST_ENV's TESSERA_MAX_INFLIGHT), so that
    # none waits in its one-place line or is turned away with a 429.
    crowd = ["ad-a", "ad-b", BASE] * (int(TEST_ENV["TESSERA_MAX_INFLIGHT"]) // 3)
    with ThreadPoolExecutor(len(crowd)) as pool:
        answers = list(pool.map(lambda m: _complete(cluster, m), crowd))
    assert [named for named, _ in answers] == crowd
    # Greedy in a batch may differ from greedy alone in late tokens (kernels round differently at
    # another batch width), so each answer is judged by whose answer alone it follows furthest:
    # its own adapter's (an adapter applied to another group's rows would follow that one).
    for m, (_, text) in zip(crowd, answers, strict=True):
        follows = {other: _shared(text, alone[other]) for other in alone}
        assert max(follows, key=lambda o: follows[o]) == m and follows[m] > 0, (m, text, alone)


def _shared(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _instance(cluster: LocalCluster, model: str = BASE) -> dict[str, Any] | None:
    nodes = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()["nodes"]
    return next((i for n in nodes for i in n["instances"] if i["model"] == model), None)


def test_an_adapter_idle_its_keep_alive_comes_back_without_restarting_its_base(
    cluster: LocalCluster, base: dict[str, Any], adapters: dict[str, Path]
) -> None:
    r = httpx.post(
        f"{cluster.base_url}/admin/models/{BASE}/adapters",
        json={"name": "ad-short", "source": str(adapters["ad-b"]), "keep_alive_s": 1},
        timeout=300,
    )
    assert r.status_code == 201, r.text
    try:
        first = _complete(cluster, "ad-short")
        assert first[0] == "ad-short"
        # Its first start read the store's copy; the node's host cache filled behind it.
        key = f"adapter-{_adapter(cluster, 'ad-short')['adapter']['adapter_id']}"
        wait_for(lambda: key in _cached(cluster), 30, "the adapter's host-cache copy")
        base_starts = len(cold_starts(cluster, BASE))
        inst = wait_for(lambda: _instance(cluster), 30, "the base's instance")
        # Listed from the heartbeat after its request, and dropped a second idle later: it may
        # be gone before a read. That it was dropped and read again shows in its two starts.
        wait_for(
            lambda: "ad-short" not in ((_instance(cluster) or {}).get("adapters", ["ad-short"])),
            60,
            "ad-short dropped from its base's instance",
            detail=lambda: _instance(cluster),
        )
        again = _complete(cluster, "ad-short")
        assert again == first
        now = _instance(cluster)
        assert now is not None and now["worker_pid"] == inst["worker_pid"] and now["loaded_at"] == inst["loaded_at"]
        assert len(cold_starts(cluster, BASE)) == base_starts  # its base did not start again
        starts = wait_for(lambda: len(s := cold_starts(cluster, "ad-short")) >= 2 and s, 30, "two adapter starts")
        assert [s["tier"] for s in starts] == ["adapter", "adapter"]
        # Its second start read the copy its first left in the node's host cache, listed there.
        assert starts[0]["source"] == "host"
        entry = _cached(cluster)[key]
        assert entry["tier"] == "adapter" and entry["uses"] >= 2
    finally:
        httpx.delete(f"{cluster.base_url}/admin/models/{BASE}/adapters/ad-short", timeout=10)


def test_an_adapter_registered_on_a_warm_base_is_served_right(
    cluster: LocalCluster, base: dict[str, Any], tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """The base serves from its core (built LoRA-able for the q/v adapters kept so far); an
    adapter on every linear is registered then: the library applies an adapter only on the
    linears its pipeline was built for, so the core is built again, and the answer is the
    library's for that adapter."""
    on_the_core(cluster, BASE)
    inst = wait_for(lambda: _instance(cluster), 30, "the base's instance")
    base_starts = len(cold_starts(cluster, BASE))
    wide = make_adapter(tiny_checkpoint, tmp_path / "wide", seed=5, targets=LLAMA_TARGETS)
    r = httpx.post(
        f"{cluster.base_url}/admin/models/{BASE}/adapters", json={"name": "ad-wide", "source": str(wide)}, timeout=300
    )
    assert r.status_code == 201, r.text
    try:
        named, text = _complete(cluster, "ad-wide")
        assert named == "ad-wide"
        assert text == _library_greedy(cluster, base, _adapter(cluster, "ad-wide"))
        assert text != _complete(cluster, BASE)[1]
        now = _instance(cluster)
        assert now is not None and now["worker_pid"] == inst["worker_pid"]
        assert len(cold_starts(cluster, BASE)) == base_starts
    finally:
        httpx.delete(f"{cluster.base_url}/admin/models/{BASE}/adapters/ad-wide", timeout=10)


def test_a_pinned_adapter_keeps_its_base_warm_and_stays_loaded_past_its_keep_alive(
    cluster: LocalCluster, tiny_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    """A base whose own keep-alive is a second, with an adapter pinned at registration: the
    scheduler starts the base with no request, the base outlives its keep-alive, and the pinned
    adapter stays loaded while an unpinned one used after it is dropped; unpinned, the base
    scales to zero."""
    pin_base = "lora-pin-base"
    register(cluster, pin_base, source=str(tiny_checkpoint), keep_alive_s=1)
    url = f"{cluster.base_url}/admin/models/{pin_base}/adapters"
    try:
        for name, extra in (("ad-pin", {"min_instances": 1}), ("ad-idle", {})):
            r = httpx.post(
                url, json={"name": name, "source": str(adapters["ad-a"]), "keep_alive_s": 1, **extra}, timeout=300
            )
            assert r.status_code == 201, r.text
        assert {a["name"]: a["min_instances"] for a in httpx.get(url, timeout=10).json()} == {
            "ad-pin": 1,
            "ad-idle": 0,
        }
        # Its engine's own view (a worker): the scheduler lists a start it ordered before that.
        first = wait_for(
            lambda: (i := _instance(cluster, pin_base)) is not None and i["worker_pid"] and i,
            120,
            "the pinned adapter's base started by itself",
        )
        assert _complete(cluster, "ad-pin")[0] == "ad-pin"
        assert _complete(cluster, "ad-idle")[0] == "ad-idle"
        # The unpinned adapter, used last, idles its second out and is dropped: by then the
        # pinned one and the base have been idle longer than their keep-alives.
        wait_for(
            lambda: "ad-idle" not in ((_instance(cluster, pin_base) or {}).get("adapters", ["ad-idle"])),
            60,
            "ad-idle dropped from its base's instance",
            detail=lambda: _instance(cluster, pin_base),
        )
        now = _instance(cluster, pin_base)
        assert now is not None and now["worker_pid"] == first["worker_pid"]
        assert "ad-pin" in now["adapters"]
        r = httpx.post(f"{cluster.base_url}/admin/models/ad-pin/unpin", timeout=10)
        assert r.status_code == 200 and r.json()["min_instances"] == 0, r.text
        wait_for(lambda: _instance(cluster, pin_base) is None, 60, "the base scaled to zero once unpinned")
    finally:
        httpx.delete(f"{cluster.base_url}/admin/models/{pin_base}?cascade=true", timeout=30)
