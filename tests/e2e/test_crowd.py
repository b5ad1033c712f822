"""Serving a crowd on the continuous-batching core (real engine, real model): a crowd of 64
streams is served with none refused, short requests pass a long one, a client that goes away
stops its generation, a request without `max_tokens` ends at the model's cap, and greedy
output is the library pipeline's own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ops.localcluster import DEFAULT_MODEL_NAME, LocalCluster, default_model_path
from tests.conftest import start_cluster
from tests.helpers.cluster import metric, on_the_core, wait_for

ENGINE = "engine@node-0"
CAPPED = "capped"
CAP = 9


@pytest.fixture(scope="module")
def crowd(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    # The gateway's own admission limits (not the small ones of the shared test cluster).
    c = start_cluster(
        tmp_path_factory.mktemp("crowd"), model_store, TESSERA_MAX_INFLIGHT="256", TESSERA_MAX_WAITING="1024"
    )
    try:
        c.register_default_model()
        r = httpx.post(
            f"{c.base_url}/admin/models",
            timeout=600,
            json={"name": CAPPED, "source": str(default_model_path()), "max_tokens": CAP, "temperature": 0.0},
        )
        assert r.status_code == 201, r.text
        yield c
    finally:
        c.stop()


def _client(c: LocalCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{c.base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=600,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=128, max_keepalive_connections=128)
        ),
    )


async def _on_the_core(c: LocalCluster) -> None:
    await asyncio.to_thread(on_the_core, c, DEFAULT_MODEL_NAME)


async def _stream(client: openai.AsyncOpenAI, prompt: str, tokens: int) -> tuple[int, str | None]:
    """Completion tokens and finish reason of one streamed chat request."""
    stream = await client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    used, reason = 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
    return used, reason


async def test_sixty_four_concurrent_streams_all_complete_with_none_refused(crowd: LocalCluster) -> None:
    client = _client(crowd)
    await _on_the_core(crowd)
    rejected_before = metric(crowd, "gateway", "tessera_gateway_rejected_total")
    kv_before = metric(crowd, ENGINE, "tessera_engine_kv_allocated_bytes", model=DEFAULT_MODEL_NAME)
    results = await asyncio.gather(*(_stream(client, f"Tell me about the number {i}.", 24) for i in range(64)))
    assert results == [(24, "length")] * 64
    assert metric(crowd, "gateway", "tessera_gateway_rejected_total") == rejected_before
    # The core's KV cache grew to hold the crowd (allocated as admitted requests need it).
    kv_after = metric(crowd, ENGINE, "tessera_engine_kv_allocated_bytes", model=DEFAULT_MODEL_NAME)
    assert kv_after > kv_before


async def test_short_requests_finish_before_a_long_one_started_first(crowd: LocalCluster) -> None:
    client = _client(crowd)
    await _on_the_core(crowd)
    finished: list[str] = []

    async def long() -> None:
        assert await _stream(client, "Write a very long story.", 400) == (400, "length")
        finished.append("long")

    async def short(i: int) -> None:
        assert await _stream(client, f"Say hello {i}.", 8) == (8, "length")
        finished.append(f"short-{i}")

    long_task = asyncio.create_task(long())
    decoded = metric(crowd, ENGINE, "tessera_engine_decoded_tokens_total")
    await asyncio.to_thread(
        wait_for,
        lambda: metric(crowd, ENGINE, "tessera_engine_decoded_tokens_total") > decoded,
        60,
        "the long request to start decoding",
    )
    await asyncio.gather(*(short(i) for i in range(8)))
    await long_task
    assert finished[-1] == "long", finished


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_goes_away_stops_its_generation(crowd: LocalCluster, stream: bool) -> None:
    await _on_the_core(crowd)
    cancelled = metric(crowd, ENGINE, "tessera_engine_requests_total", finish_reason="cancelled")
    decoded = metric(crowd, ENGINE, "tessera_engine_decoded_tokens_total")
    body = {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    async with httpx.AsyncClient(base_url=crowd.base_url, timeout=600) as http:
        request = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        await asyncio.to_thread(
            wait_for,
            lambda: metric(crowd, ENGINE, "tessera_engine_decoded_tokens_total") >= decoded + 8,
            60,
            "the generation to be under way",
        )
        request.cancel()  # closes the connection: the client is gone
        with pytest.raises(asyncio.CancelledError):
            await request
    await asyncio.to_thread(
        wait_for,
        lambda: metric(crowd, ENGINE, "tessera_engine_requests_total", finish_reason="cancelled") > cancelled,
        60,
        "the engine to end the generation as cancelled",
    )
    stopped_at = metric(crowd, ENGINE, "tessera_engine_decoded_tokens_total")
    assert stopped_at - decoded < 4000 / 4
    # Nothing more is decoded for it: the next request's tokens are all that is added.
    r = await _client(crowd).chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == 3
    assert metric(crowd, ENGINE, "tessera_engine_decoded_tokens_total") == stopped_at + 3


async def test_a_request_without_max_tokens_ends_at_the_models_cap(crowd: LocalCluster) -> None:
    models = {m["name"]: m for m in httpx.get(f"{crowd.base_url}/admin/models", timeout=10).json()}
    assert models[CAPPED]["defaults"]["max_tokens"] == CAP
    assert (
        models[DEFAULT_MODEL_NAME]["defaults"]["max_tokens"] < models[DEFAULT_MODEL_NAME]["artifact"]["context_length"]
    )
    r = await _client(crowd).chat.completions.create(
        model=CAPPED,
        messages=[{"role": "user", "content": "Write a long essay about the sea."}],
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.usage.completion_tokens == CAP
    assert r.choices[0].finish_reason == "length"


async def test_max_tokens_beyond_the_context_is_a_clear_400(crowd: LocalCluster) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await _client(crowd).chat.completions.create(
            model=CAPPED, messages=[{"role": "user", "content": "Hi"}], max_tokens=100_000
        )
    assert e.value.code == "context_length_exceeded"


async def test_greedy_output_is_the_library_pipelines_own(crowd: LocalCluster) -> None:
    import openvino_genai as ov_genai

    await _on_the_core(crowd)
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    r = await _client(crowd).completions.create(
        model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body={"repetition_penalty": 1.0}
    )
    ours = r.choices[0].text
    models = {m["name"]: m for m in httpx.get(f"{crowd.base_url}/admin/models", timeout=10).json()}
    path = models[DEFAULT_MODEL_NAME]["artifact"]["path"]
    scheduler = ov_genai.SchedulerConfig()
    scheduler.num_kv_blocks = 64
    scheduler.cache_size = 0
    pipe = ov_genai.ContinuousBatchingPipeline(path, scheduler, "CPU", {"INFERENCE_NUM_THREADS": 1})
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = 24
    config.apply_chat_template = False  # the prompt is already rendered, as /v1/completions takes it
    result = await asyncio.to_thread(lambda: pipe.generate([prompt], [config])[0])
    theirs = result.m_generation_ids[0]  # the text, for a text prompt
    assert ours and ours == theirs


def test_the_detokenizer_decodes_a_crowds_windows_together_as_it_would_each_alone(crowd: LocalCluster) -> None:
    from services.engine.instance import Detokenizer

    models = {m["name"]: m for m in httpx.get(f"{crowd.base_url}/admin/models", timeout=10).json()}
    detok = Detokenizer(models[DEFAULT_MODEL_NAME]["artifact"]["path"])
    # Mixed lengths (one run per length), an empty window, and a special token (skipped).
    seqs = [[504, 3575, 282], [], [28, 1349], [3327, 2114, 30], [detok.eos_token_id, 42], [7]]
    alone = [detok.decode(s) for s in seqs]
    assert detok.decode_many(seqs) == alone
    assert any(alone) and alone[1] == ""
