"""A node whose engine is torch (`TESSERA_ENGINE_BACKEND=torch`) serves a registered model
through the whole stack: registration materializes the torch checkpoint, the gateway renders
and tokenizes, the scheduler places, the engine starts a torch worker (its weights in the
tensor arena), and the tokens come back; greedy decoding is transformers' own for the prompt
ids the gateway computed, streamed or not, and a start after scale to zero finds the model
resident."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("torch", reason="the torch engine needs torch (the `test` extra installs it)")

import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from ops.localcluster import LocalCluster, default_model_path
from services.gateway.tokenizers import Tokenizers
from shared.artifact import TORCH_MANIFEST, torch_checkpoint, torch_tensor_bytes
from shared.messages import Artifact
from tests.conftest import start_cluster
from tests.helpers.cluster import cold_starts, engine_workers, loaded_models, metric, register, wait_for

pytestmark = pytest.mark.usefixtures("torch_on_one_thread")  # transformers' reference runs here

NAME = "smollm-torch"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"repetition_penalty": 1.0}}
"""Plain greedy decoding (the platform's default repetition penalty of 1.1 off)."""


def float32_bytes() -> tuple[int, int]:
    """The default model's weights in float32 (as its torch checkpoint holds them), and its
    embedding's share of them."""
    tensors = GGUFReader(default_model_path()).tensors
    embedding = next(int(t.n_elements) for t in tensors if t.name == EMBEDDING)
    return 4 * sum(int(t.n_elements) for t in tensors), 4 * embedding


EMBEDDING = "token_embd.weight"
WEIGHTS, EMBEDDING_BYTES = float32_bytes()
ARENA_BYTES = WEIGHTS + EMBEDDING_BYTES // 2
"""The node's arena: room for one model's weights, not for a second embedding beside them."""


@pytest.fixture(scope="module")
def torch_cluster(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    c = start_cluster(
        tmp_path_factory.mktemp("torch-node"),
        model_store,
        TESSERA_ENGINE_BACKEND="torch",
        TESSERA_TORCH_ARENA_BYTES=str(ARENA_BYTES),
        TESSERA_MEMORY_WAIT_S="2",  # a start the arena cannot take is refused soon
        # A torch worker's intra-op pool at one thread: at two, beside the suite's other worker
        # on two cores, its OpenMP barriers wait on descheduled threads (tests/helpers/torch_threads.py).
        TESSERA_INFERENCE_THREADS="1",
    )
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def artifact(torch_cluster: LocalCluster) -> Artifact:
    record = register(torch_cluster, NAME, keep_alive_s=1.0)
    return msgspec.convert(record["artifact"], Artifact)


@pytest.fixture(scope="module")
def client(torch_cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{torch_cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def gateway_prompt_ids(artifact: Artifact) -> list[int]:
    """The prompt's ids exactly as the gateway renders and tokenizes it."""

    async def ids() -> tuple[int, ...]:
        tokenizers = Tokenizers()
        tok = await tokenizers.get(artifact)
        return await tokenizers.encode(tok, await tokenizers.render_chat(tok, QUESTION))

    return list(asyncio.run(ids()))


def transformers_greedy(checkpoint: Path, prompt: list[int]) -> tuple[str, int, str]:
    """transformers' own greedy completion of `prompt` from the checkpoint: its text, its
    tokens and its finish reason (an end-of-turn token is not part of the completion). Worked
    out once per checkpoint and prompt: the tests of the default model's artifact share it."""
    return _transformers_greedy(checkpoint, tuple(prompt))


@functools.cache
def _transformers_greedy(checkpoint: Path, prompt: tuple[int, ...]) -> tuple[str, int, str]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with torch.inference_mode():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=MAX_TOKENS, do_sample=False)
    ids = out[0, len(prompt) :].tolist()
    ends = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    finish = "length"
    for i, token in enumerate(ids):
        if token in ends:
            ids, finish = ids[:i], "stop"
            break
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids), finish


def arena_reserved(cluster: LocalCluster) -> float:
    """What the node's memory manager has reserved for the node's arena."""
    return metric(cluster, "memory_manager@node-0", "tessera_memory_region_bytes", region="weights:node-arena")


ALIGNMENT_SLACK = 256 * 300
"""The arena aligns each of the model's 272 tensors to 256 bytes."""


def torch_workers(cluster: LocalCluster) -> list[int]:
    """The engine's child processes that run torch (libtorch mapped: an OpenVINO worker never
    loads it)."""
    return engine_workers(cluster, "libtorch")


def test_a_torch_node_serves_transformers_greedy_text_streamed_or_not_and_restarts_resident(
    torch_cluster: LocalCluster, artifact: Artifact, client: openai.OpenAI
) -> None:
    checkpoint = torch_checkpoint(artifact)
    assert (checkpoint / TORCH_MANIFEST).is_file(), "registration on a torch node materializes the checkpoint"
    prompt = gateway_prompt_ids(artifact)
    expected, tokens, finish = transformers_greedy(checkpoint, prompt)
    assert expected.strip(), "the reference completion is empty: the prompt proves nothing"

    reply = client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == finish
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), tokens)
    workers = torch_workers(torch_cluster)
    assert workers, "no engine worker runs torch"
    # A GPU machine's image may hold no OpenVINO: neither the torch node's engine nor its
    # torch workers load it, having served (tests/integration/test_floors.py checks the imports).
    for pid in [torch_cluster.procs["engine@node-0"].pid, *workers]:
        assert "libopenvino" not in Path(f"/proc/{pid}/maps").read_text(), f"process {pid} loaded OpenVINO"

    stream = client.chat.completions.create(model=NAME, messages=QUESTION, stream=True, **GREEDY)  # type: ignore[arg-type, call-overload]
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([d for d in deltas if d]) >= 2, f"one piece is no stream: {deltas}"
    assert "".join(deltas) == expected

    # Scaled to zero, the model's worker stays bound with its weights in the arena: the next
    # request starts it again without loading anything, and it answers the same.
    wait_for(lambda: NAME not in loaded_models(torch_cluster), 30, f"{NAME} to scale to zero")
    again = client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
    assert again.choices[0].message.content == expected
    starts = wait_for(lambda: (s := cold_starts(torch_cluster, NAME)) and len(s) >= 2 and s, 30, "two cold starts")
    assert {str(s["source"]) for s in starts} >= {"store", "resident"}, starts


def test_a_torch_start_after_its_worker_died_finds_the_weights_in_the_node_arena(
    torch_cluster: LocalCluster, artifact: Artifact, client: openai.OpenAI
) -> None:
    """A torch node stages the torch checkpoint through its loader like a blob (`Tier.TORCH`):
    its first start read the store and the cache filled behind it. The weights are in the
    node's one arena, which the engine owns and its workers map: a start after every worker
    died binds a new one to them, reading none (source "arena")."""
    expected = client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY).choices[0].message.content  # type: ignore[arg-type, call-overload]
    wait_for(
        lambda: metric(torch_cluster, "loader@node-0", "tessera_loader_host_cache_entries") >= 1,
        60,
        "the loader to hold the torch checkpoint in host memory",
    )
    copy = torch_cluster.host_cache / "node-0" / artifact.artifact_id / "torch"
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == {
        p.name: p.read_bytes() for p in torch_checkpoint(artifact).iterdir()
    }
    for pid in torch_workers(torch_cluster):  # the bound worker among them
        os.kill(pid, signal.SIGKILL)
    weights = sum(torch_tensor_bytes(artifact).values())
    wait_for(
        lambda: metric(torch_cluster, "engine@node-0", "tessera_engine_arena_bytes", state="idle") >= weights,
        30,
        "the dead worker's weights reported idle in the node's arena",
    )
    # Idle, they still take the node's memory until evicted: the memory manager counts them.
    assert arena_reserved(torch_cluster) >= weights
    before = len(cold_starts(torch_cluster, NAME))

    def answered() -> str | None:
        try:
            reply = client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
        except openai.APIStatusError:
            return None  # a request that met the dying worker: the node answers the next
        return reply.choices[0].message.content

    assert wait_for(answered, 120, "an answer after the workers died") == expected
    starts = wait_for(lambda: (s := cold_starts(torch_cluster, NAME)) and len(s) > before and s, 30, "a new start")
    assert starts[0]["source"] == "arena", starts[0]  # newest first


def test_a_crowd_on_a_torch_node_runs_in_one_batch_and_each_gets_its_own_answer(
    torch_cluster: LocalCluster, artifact: Artifact, client: openai.OpenAI
) -> None:
    """Five requests at once (the test cluster admits six): each gets transformers' greedy text (a row's neighbours change
    nothing), and the engine counts them run in batches of more than one."""
    expected, _, _ = transformers_greedy(torch_checkpoint(artifact), gateway_prompt_ids(artifact))

    def batched() -> float:
        port = torch_cluster.procs["engine@node-0"].http_port
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "tessera_engine_batched_requests_total" and s.labels.get("batch") != "1"
        )

    before = batched()
    with ThreadPoolExecutor(5) as pool:
        replies = list(
            pool.map(
                lambda _: client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY),  # type: ignore[arg-type, call-overload]
                range(5),
            )
        )
    assert [r.choices[0].message.content for r in replies] == [expected] * 5
    assert batched() - before >= 2, "no two of five concurrent requests shared a step"


def test_a_torch_node_enforces_structured_output(client: openai.OpenAI, artifact: Artifact) -> None:
    """`response_format` with a JSON schema, through the gateway, on a torch node: the reply
    parses and has exactly the schema's fields (llguidance on the torch worker's batch)."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 30}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=NAME,
        messages=QUESTION,
        max_tokens=60,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
    )
    assert reply.choices[0].finish_reason == "stop"
    parsed = json.loads(reply.choices[0].message.content or "")
    assert set(parsed) == {"answer", "sure"} and isinstance(parsed["sure"], bool)


def test_a_model_sharing_a_resident_models_tensors_binds_them_from_the_node_arena(
    torch_cluster: LocalCluster, artifact: Artifact, client: openai.OpenAI, tmp_path: Path
) -> None:
    """Tangram §3.1 within a node: a second artifact with the same tensors (the default GGUF
    with bytes appended: a stand-in for a fine-tune sharing its base) starts on another torch
    worker, reading none of them (they are in the node's arena, which every worker maps), and
    answers as the first does; the first stays resident on its own worker."""
    expected, _, _ = transformers_greedy(torch_checkpoint(artifact), gateway_prompt_ids(artifact))

    def worker_of(model: str) -> int:
        status = httpx.get(f"{torch_cluster.base_url}/admin/instances", timeout=10).json()
        return next(i["worker_pid"] for n in status["nodes"] for i in n["instances"] if i["model"] == model)

    first = client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
    assert first.choices[0].message.content == expected
    pid = worker_of(NAME)
    wait_for(lambda: NAME not in loaded_models(torch_cluster), 30, f"{NAME} to scale to zero")

    variant = tmp_path / "variant.gguf"
    shutil.copyfile(default_model_path(), variant)
    with variant.open("ab") as f:
        f.write(b"tessera-variant")
    record = register(torch_cluster, "smollm-torch-variant", keep_alive_s=1.0, source=str(variant))
    assert record["artifact"]["artifact_id"] != artifact.artifact_id  # type: ignore[index]  (another artifact)
    reply = client.chat.completions.create(model="smollm-torch-variant", messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
    assert reply.choices[0].message.content == expected
    assert worker_of("smollm-torch-variant") != pid  # the first model's worker stays bound to it
    (start,) = wait_for(lambda: cold_starts(torch_cluster, "smollm-torch-variant"), 30, "the variant's cold start")
    assert start["source"] == "arena", start
    # Both workers hold the same tensors (the first model's worker is still bound): once.
    weights = sum(torch_tensor_bytes(artifact).values())
    assert metric(torch_cluster, "engine@node-0", "tessera_engine_arena_bytes", state="held") == weights
    assert weights <= arena_reserved(torch_cluster) < weights + ALIGNMENT_SLACK  # reserved once too

    # Both idle now: the node says either would start here reading nothing (the scheduler's
    # affinity), and the first model comes back on its own worker.
    wait_for(lambda: "smollm-torch-variant" not in loaded_models(torch_cluster), 30, "the variant to scale to zero")
    both = {artifact.artifact_id, record["artifact"]["artifact_id"]}  # type: ignore[index]

    def resident() -> set[str]:
        (node,) = httpx.get(f"{torch_cluster.base_url}/admin/instances", timeout=10).json()["nodes"]
        return set(node["resident"])

    wait_for(lambda: both <= resident(), 30, "both artifacts reported resident", detail=resident)
    again = client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
    assert again.choices[0].message.content == expected
    assert worker_of(NAME) == pid


def test_a_fine_tune_beside_an_idle_base_is_reported_partly_resident(
    torch_cluster: LocalCluster, artifact: Artifact, client: openai.OpenAI
) -> None:
    """The scheduler's affinity counts resident bytes (Tangram eq. 3): an artifact in the store
    whose tensors are the base's but one (its embedding's digest changed: a fine-tune that
    retrained it) is reported by the node, once the base's worker is idle, with the share of
    its bytes the node's arena holds; before it was ever started there."""
    client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
    wait_for(lambda: NAME not in loaded_models(torch_cluster), 30, f"{NAME} to scale to zero")
    manifest = json.loads((torch_checkpoint(artifact) / TORCH_MANIFEST).read_text())
    changed = manifest["tensors"][0]
    changed["digest"] = "0" * len(changed["digest"])
    sizes = torch_tensor_bytes(artifact)
    expected = 1 - sizes[next(iter(sizes))] / sum(sizes.values())
    # Only the manifest is read to match tensors; it is written whole (renamed into place).
    tune = Path(artifact.path).parent / "tune-of-smollm-torch"
    (tune / "torch").mkdir(parents=True)
    try:
        (tune / "torch" / "manifest.tmp").write_text(json.dumps(manifest))
        (tune / "torch" / "manifest.tmp").rename(tune / "torch" / TORCH_MANIFEST)

        def reusable() -> dict[str, float]:
            (node,) = httpx.get(f"{torch_cluster.base_url}/admin/instances", timeout=10).json()["nodes"]
            return dict(node["reusable"])

        shares = wait_for(lambda: "tune-of-smollm-torch" in reusable() and reusable(), 30, "the tune reported")
        assert shares["tune-of-smollm-torch"] == pytest.approx(expected, abs=1e-3)
        assert 0.5 < expected < 1.0  # the embedding is big, but not all of it
        assert artifact.artifact_id not in shares  # whole: reported resident, not partly
    finally:
        shutil.rmtree(tune)


def test_a_model_the_arena_has_no_room_for_stops_idle_ones_and_copies_only_its_own_tensors(
    torch_cluster: LocalCluster, artifact: Artifact, client: openai.OpenAI, tmp_path: Path
) -> None:
    """Tangram §3.1-3.2 in a full arena: a model whose embedding differs (the GGUF's first
    embedding block changed: a fine-tune of it) finds room for only half an embedding beside
    the idle models. The idle ones are stopped; their shared tensors stay for it and only the
    embedding is copied; the old embedding is evicted for it, and the memory manager's
    reservation for the arena follows. While it serves, the first model, needing its own
    embedding back, is refused with a clear 503: the models in use leave no room."""
    weights = sum(torch_tensor_bytes(artifact).values())
    assert weights + ALIGNMENT_SLACK < ARENA_BYTES < weights + EMBEDDING_BYTES  # the premise
    client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
    wait_for(lambda: NAME not in loaded_models(torch_cluster), 30, f"{NAME} to scale to zero")

    tune = tmp_path / "tune.gguf"
    shutil.copyfile(default_model_path(), tune)
    embedding = next(t for t in GGUFReader(tune).tensors if t.name == EMBEDDING)
    with tune.open("r+b") as f:  # the first Q8_0 block's values (after its 2-byte scale), each +1
        f.seek(int(embedding.data_offset) + 2)
        values = f.read(32)
        f.seek(int(embedding.data_offset) + 2)
        f.write(bytes((v + 1) % 256 for v in values))
    record = register(torch_cluster, "smollm-torch-tune", keep_alive_s=1.0, source=str(tune))
    tuned = torch_tensor_bytes(msgspec.convert(record["artifact"], Artifact))
    own = {d: n for d, n in tuned.items() if d not in torch_tensor_bytes(artifact)}
    assert 0 < sum(own.values()) <= EMBEDDING_BYTES  # the embedding alone differs

    def loads(how: str) -> float:
        return metric(torch_cluster, "engine@node-0", "tessera_engine_arena_load_bytes_total", how=how)

    copied, reused = loads("copied"), loads("reused")
    reply = client.chat.completions.create(model="smollm-torch-tune", messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
    # Its own embedding, copied in (or streamed in behind its first forward pass): its text is
    # transformers' for the tune's weights.
    tune_artifact = msgspec.convert(record["artifact"], Artifact)
    expected, _, _ = transformers_greedy(torch_checkpoint(tune_artifact), gateway_prompt_ids(tune_artifact))
    assert reply.choices[0].message.content == expected
    assert loads("copied") - copied == sum(own.values())
    assert loads("reused") - reused == weights - sum(own.values())
    (node,) = httpx.get(f"{torch_cluster.base_url}/admin/instances", timeout=10).json()["nodes"]
    assert artifact.artifact_id not in node["resident"]  # stopped, and its embedding evicted
    assert metric(torch_cluster, "engine@node-0", "tessera_engine_arena_bytes", state="idle") == 0
    assert weights <= arena_reserved(torch_cluster) < weights + ALIGNMENT_SLACK

    busy = client.chat.completions.create(
        model="smollm-torch-tune",
        messages=QUESTION,
        stream=True,
        max_tokens=4000,
        extra_body={"ignore_eos": True},
    )
    try:
        next(c for c in busy if c.choices and c.choices[0].delta.content)  # serving now
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model=NAME, messages=QUESTION, **GREEDY)  # type: ignore[arg-type, call-overload]
        assert refused.value.status_code == 503, refused.value
        assert "tensor arena" in str(refused.value.message), refused.value.message
    finally:
        busy.close()


def test_a_torch_node_serves_a_hugging_face_checkpoint_as_transformers_does(
    torch_cluster: LocalCluster, client: openai.OpenAI, tiny_checkpoint: Path
) -> None:
    """A Hugging Face checkpoint directory registered on a torch node is loaded as it is (its
    tensors in the node's dtype, no conversion to another format): greedy text is transformers'
    own on the checkpoint directory the user gave."""
    checkpoint = tiny_checkpoint
    record = register(torch_cluster, "torch-hf", keep_alive_s=1.0, source=str(checkpoint))
    hf_artifact = msgspec.convert(record["artifact"], Artifact)
    assert hf_artifact.source_format == "hf"
    expected, tokens, finish = transformers_greedy(checkpoint, gateway_prompt_ids(hf_artifact))
    answer = client.chat.completions.create(model="torch-hf", messages=QUESTION, **GREEDY)  # type: ignore[call-overload]
    assert answer.choices[0].message.content == expected
    assert answer.usage.completion_tokens == tokens and answer.choices[0].finish_reason == finish


def test_lora_adapters_and_the_base_share_a_torch_batch_each_with_its_own_answer(
    torch_cluster: LocalCluster, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """Adapters on a Hugging Face base served by a torch node (issue 34): one registered before
    the base's start (its batch is built LoRA-able for it), one after on linears the batch was
    not built for (the batch drains and is built again); each adapter's greedy tokens are
    transformers' with that adapter merged into the weights, and requests for both adapters
    and the base at once each get their own answer (each row its own adapter in one step)."""
    from tests.helpers.adapters import merged_greedy, write_adapter

    base = "torch-lora"
    record = register(torch_cluster, base, source=str(tiny_checkpoint))
    checkpoint = torch_checkpoint(msgspec.convert(record["artifact"], Artifact))
    prompt = "The capital of France is"
    ids = httpx.post(f"{torch_cluster.base_url}/tokenize", json={"model": base, "prompt": prompt}, timeout=30).json()

    def add(name: str, seed: int, targets: tuple[str, ...]) -> None:
        source = write_adapter(checkpoint, tmp_path / name, seed=seed, targets=targets)
        r = httpx.post(
            f"{torch_cluster.base_url}/admin/models/{base}/adapters",
            json={"name": name, "source": str(source)},
            timeout=300,
        )
        assert r.status_code == 201, r.text

    def complete(model: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(
            f"{torch_cluster.base_url}/v1/completions", json={**body, "repetition_penalty": 1.0}, timeout=300
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        return str(r.json()["choices"][0]["text"])

    def text_of(tokens: list[int]) -> str:
        r = httpx.post(f"{torch_cluster.base_url}/detokenize", json={"model": base, "tokens": tokens}, timeout=30)
        return str(r.json()["prompt"])

    try:
        add("torch-ad-a", 1, ("q_proj", "v_proj"))
        alone = {base: complete(base), "torch-ad-a": complete("torch-ad-a")}
        add("torch-ad-b", 2, ("q_proj", "up_proj", "down_proj"))  # the running batch has no up_proj update
        alone["torch-ad-b"] = complete("torch-ad-b")
        assert alone[base] == text_of(merged_greedy(checkpoint, None, ids["tokens"], 8))
        for name in ("torch-ad-a", "torch-ad-b"):
            expected = text_of(merged_greedy(checkpoint, tmp_path / name, ids["tokens"], 8))
            assert alone[name] == expected, (name, alone[name], expected)
        assert len(set(alone.values())) == 3
        crowd = ["torch-ad-a", "torch-ad-b", base] * 2
        with ThreadPoolExecutor(len(crowd)) as pool:
            answers = list(pool.map(complete, crowd))
        assert answers == [alone[m] for m in crowd]
    finally:
        httpx.delete(f"{torch_cluster.base_url}/admin/models/{base}?cascade=true", timeout=30)
