"""A node whose engine is vLLM (`TESSERA_ENGINE_BACKEND=vllm`) serves a registered model through
the whole stack: registration materializes the torch checkpoint, the engine starts a vLLM
worker on it (`services/engine/vllm_engine`), and the OpenAI API's parameters reach vLLM.

vLLM pins versions the project's own environment does not take (FastAPI, llguidance), so it is
not in the `test` extra: these tests run in a vLLM node's environment ("vLLM nodes" in
docs/deploy.md; here, vLLM's CPU build): `make test-vllm` builds it and runs them, as CI does. They
skip where vLLM is not installed (the main suite's environment).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from ops.localcluster import LocalCluster
from shared.artifact import TORCH_MANIFEST, torch_checkpoint
from shared.messages import Artifact
from tests.conftest import start_cluster
from tests.helpers.cluster import engine_workers, register

# Looked up, not imported: the engine's workers import vLLM, not the tests.
pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason="vLLM is not installed in this environment (docs/deploy.md: vLLM nodes)"
)

NAME = "smollm-vllm"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    # A vLLM cold start compiles the model (torch.compile, C++ by inductor): on two busy cores it
    # took 3 of the gateway's 5 minutes for a placement, so the first request may wait longer.
    c = start_cluster(
        tmp_path_factory.mktemp("vllm-node"),
        model_store,
        TESSERA_ENGINE_BACKEND="vllm",
        TESSERA_PLACEMENT_TIMEOUT_S="900",
    )
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def artifact(vllm_cluster: LocalCluster) -> Artifact:
    record = register(vllm_cluster, NAME)
    return msgspec.convert(record["artifact"], Artifact)


@pytest.fixture(scope="module")
def client(vllm_cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vllm_cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


def test_a_vllm_node_answers_greedy_and_streamed_alike(
    vllm_cluster: LocalCluster, artifact: Artifact, client: openai.OpenAI
) -> None:
    assert (torch_checkpoint(artifact) / TORCH_MANIFEST).is_file(), "registration on a vLLM node writes the checkpoint"
    greedy = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"repetition_penalty": 1.0}}
    whole = client.chat.completions.create(model=NAME, messages=QUESTION, **greedy)  # type: ignore[arg-type]
    text = whole.choices[0].message.content or ""
    assert "Paris" in text, text
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= 12
    assert engine_workers(vllm_cluster, "/vllm/"), "no engine worker runs vLLM"
    stream = client.chat.completions.create(model=NAME, messages=QUESTION, stream=True, **greedy)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_the_openai_parameters_reach_vllm(artifact: Artifact, client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Write a sentence about the sea."}]

    def sample(seed: int) -> str:
        r = client.chat.completions.create(model=NAME, messages=ask, temperature=1.0, seed=seed, max_tokens=16)  # type: ignore[arg-type]
        return r.choices[0].message.content or ""

    assert sample(7) == sample(7), "a seed gives the same sample"
    assert len({sample(s) for s in (1, 2, 3)}) > 1, "different seeds give different samples"

    r = client.chat.completions.create(model=NAME, messages=ask, max_tokens=5, temperature=0.0)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 5

    lp = client.chat.completions.create(
        model=NAME,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = lp.choices[0].logprobs.content if lp.choices[0].logprobs else None
    assert content and len(content) == lp.usage.completion_tokens  # type: ignore[union-attr]
    for token in content:
        assert token.logprob <= 0.0 and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        # Greedy: the token taken is the most likely one.
        assert abs(token.top_logprobs[0].logprob - token.logprob) < 1e-4

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    j = client.chat.completions.create(
        model=NAME,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    answer = json.loads(j.choices[0].message.content or "")
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)

    banned = client.chat.completions.create(
        model=NAME,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0.0,
        stop=["Paris"],
    )
    assert "Paris" not in (banned.choices[0].message.content or "") and banned.choices[0].finish_reason == "stop"


def test_a_crowd_is_served_in_one_batch(artifact: Artifact, client: openai.OpenAI) -> None:
    topics = ["a fox", "rain", "the moon", "a city", "a lighthouse", "mountains"]

    def ask(topic: str) -> tuple[str, str | None]:
        r = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": f"One sentence about {topic}."}],
            max_tokens=24,
            temperature=0.0,
        )
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    with ThreadPoolExecutor(len(topics)) as pool:
        answers = list(pool.map(ask, topics))
    assert all(text and finish in ("stop", "length") for text, finish in answers), answers
    alone = ask(topics[0])
    assert answers[0] == alone, "a request in a crowd gets what it gets alone (greedy)"


def test_lora_adapters_and_the_base_share_a_vllm_batch_each_with_its_own_answer(
    vllm_cluster: LocalCluster, artifact: Artifact, tmp_path: Path
) -> None:
    """Two adapters (PEFT's layout, written here) registered on the running model: the engine,
    built without LoRA, drains and is built again LoRA-able; each adapter's greedy tokens are
    transformers' with that adapter merged into the weights, and requests for both adapters and
    the base at once each get their own answer (vLLM applies each row's adapter in one step)."""
    from tests.helpers.adapters import merged_greedy, write_adapter

    checkpoint = torch_checkpoint(artifact)
    for name, seed in (("vllm-ad-a", 1), ("vllm-ad-b", 2)):
        r = httpx.post(
            f"{vllm_cluster.base_url}/admin/models/{NAME}/adapters",
            json={"name": name, "source": str(write_adapter(checkpoint, tmp_path / name, seed=seed))},
            timeout=300,
        )
        assert r.status_code == 201, r.text
    prompt = "The capital of France is"
    ids = httpx.post(f"{vllm_cluster.base_url}/tokenize", json={"model": NAME, "prompt": prompt}, timeout=30).json()

    def complete(model: str) -> str:
        r = httpx.post(
            f"{vllm_cluster.base_url}/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "repetition_penalty": 1.0,
            },
            timeout=900,
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        return str(r.json()["choices"][0]["text"])

    def text_of(tokens: list[int]) -> str:
        r = httpx.post(f"{vllm_cluster.base_url}/detokenize", json={"model": NAME, "tokens": tokens}, timeout=30)
        return str(r.json()["prompt"])

    alone = {m: complete(m) for m in ("vllm-ad-a", "vllm-ad-b", NAME)}
    for name in ("vllm-ad-a", "vllm-ad-b"):
        expected = text_of(merged_greedy(checkpoint, tmp_path / name, ids["tokens"], 8))
        assert alone[name] == expected, (name, alone[name], expected)
    assert alone[NAME] == text_of(merged_greedy(checkpoint, None, ids["tokens"], 8))
    assert len(set(alone.values())) == 3
    crowd = ["vllm-ad-a", "vllm-ad-b", NAME] * 2
    with ThreadPoolExecutor(len(crowd)) as pool:
        answers = list(pool.map(complete, crowd))
    for model, answer in zip(crowd, answers, strict=True):
        assert answer == alone[model], (model, answer, alone[model])
