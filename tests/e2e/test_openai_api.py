"""The OpenAI API through the official `openai` client, against the real cluster and model."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from ops.localcluster import LocalCluster
from tests.helpers.cluster import metric, wait_for

CHAT = [{"role": "user", "content": "Name three colours."}]


def test_models_lists_the_registered_default_model(client: openai.OpenAI, model: str) -> None:
    ids = [m.id for m in client.models.list()]
    assert model in ids
    assert client.models.retrieve(model).id == model


def test_chat_completion_returns_text_usage_and_finish_reason(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The chat template wraps the message: the prompt is longer than its bare words.
    assert r.usage.prompt_tokens > 10


def test_max_tokens_ends_with_finish_reason_length(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_streaming_chat_yields_deltas_then_usage(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert chunks[0].choices[0].delta.role == "assistant"


def test_streaming_and_plain_greedy_outputs_agree(client: openai.OpenAI, model: str) -> None:
    plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == plain.choices[0].message.content


def test_same_seed_gives_same_sample(client: openai.OpenAI, model: str) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=12, temperature=1.0, top_p=0.95, seed=seed
        )
        return r.choices[0].message.content or ""

    assert sample(7) == sample(7)
    # ... and the seed and the temperature are not ignored: a greedy engine would give one
    # answer for every seed, and that answer would be the greedy one.
    samples = {seed: sample(seed) for seed in (1, 2, 3, 4)}
    greedy = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    assert len(set(samples.values())) > 1, samples
    assert any(s != greedy.choices[0].message.content for s in samples.values())


def test_stop_string_ends_the_completion_before_it(client: openai.OpenAI, model: str) -> None:
    free = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = free.choices[0].text
    assert len(text) > 2
    stop = text[1:3]  # a piece that the free run produced: the stopped run must end before it
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text
    assert text.startswith(r.choices[0].text)


def test_text_completion_streams(client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_unknown_model_is_404_in_openai_format(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"


@pytest.mark.parametrize(
    "body",
    [
        "{not json",
        '{"model": "x"}',
        '{"model": "SmolLM2-135M-Instruct", "messages": []}',
        '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "wizard", "content": "hi"}]}',
        '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}',
        '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
    ],
)
def test_malformed_body_is_400_in_openai_format(cluster: LocalCluster, body: str) -> None:
    r = httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"]


def test_prompt_plus_max_tokens_over_the_context_is_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=9000)
    assert e.value.code == "context_length_exceeded"
    assert "8192" in e.value.message


def test_more_choices_than_the_gateway_runs_at_once_is_400_with_a_clear_message(
    client: openai.OpenAI, model: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:  # 6 in flight in tests
        client.chat.completions.create(model=model, messages=CHAT, n=7, max_tokens=2)
    assert "more than this gateway runs at once" in e.value.message and e.value.param == "n"


def test_past_the_admission_limit_requests_wait_in_line_and_a_full_line_is_429(
    cluster: LocalCluster, model: str
) -> None:
    """Hold the gateway's whole admission limit (6 in tests) with open streams: the next
    request waits in line (1 place in tests) and is served once a stream ends; one more while
    the line is full is refused at once with 429 and Retry-After."""
    body = {"model": model, "messages": CHAT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=cluster.base_url, timeout=120) as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = []
        try:
            for _ in range(6):
                ctx = http.stream("POST", "/v1/chat/completions", json=body)
                resp = ctx.__enter__()
                held.append(ctx)
                assert resp.status_code == 200
            waiting = pool.submit(
                http.post, "/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 4}
            )
            wait_for(
                lambda: metric(cluster, "gateway", "tessera_gateway_waiting_requests") == 1,
                30,
                "the seventh request to wait in line",
            )
            r = http.post("/v1/chat/completions", json={**body, "stream": False})
            assert r.status_code == 429
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert not waiting.done()
            held.pop().__exit__(None, None, None)
            served = waiting.result(timeout=60)
            assert served.status_code == 200, served.text
            answer = served.json()
            assert answer["choices"][0]["message"]["content"]
            assert 1 <= answer["usage"]["completion_tokens"] <= 4
        finally:
            for ctx in held:
                ctx.__exit__(None, None, None)


def test_non_text_content_part_is_a_clear_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            max_tokens=4,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ],
        )
    assert "only 'text'" in e.value.message


def test_text_content_parts_are_joined(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        max_tokens=4,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": " hi"}]}],
    )
    assert r.choices[0].message.content is not None


def test_an_unsupported_parameter_is_a_400_that_names_it(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Once", max_tokens=4, suffix="the end.")
    assert "suffix" in e.value.message
    assert e.value.param == "suffix" and e.value.code == "unsupported_parameter"


def test_an_unknown_parameter_is_a_400_that_names_it_and_a_null_one_is_not(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, extra_body={"max_token": 16})
    assert e.value.param == "max_token" and e.value.code == "unsupported_parameter"
    r = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=2, metadata={"run": "7"}, extra_body={"max_token": None}
    )
    assert r.choices[0].finish_reason == "length"


def test_a_frequency_penalty_changes_a_repetitive_greedy_output(client: openai.OpenAI, model: str) -> None:
    # Greedy, no repetition penalty, after a prompt of one word forty times: the model goes on
    # repeating it (what it says to a question is its own, and differs between CPUs); strong
    # frequency and presence penalties (the library's, on the core) must steer it elsewhere.
    def text(**extra: float) -> str:
        r = client.completions.create(
            model=model,
            prompt="apple " * 40,
            max_tokens=32,
            temperature=0,
            extra_body={"repetition_penalty": 1.0, "ignore_eos": True},
            **extra,
        )
        return r.choices[0].text

    plain = text()
    penalized = text(frequency_penalty=2.0, presence_penalty=2.0)
    assert plain and penalized and plain != penalized

    # The penalty counts repeats: the penalized text repeats its most frequent word less.
    def most_repeats(s: str) -> int:
        words = s.lower().split()
        return max((words.count(w) for w in set(words)), default=0)

    assert most_repeats(penalized) < most_repeats(plain)


def test_tokenize_and_detokenize_round_trip_and_count_as_a_chat_request_does(
    cluster: LocalCluster, client: openai.OpenAI, model: str
) -> None:
    base = cluster.base_url
    r = httpx.post(f"{base}/tokenize", json={"model": model, "prompt": "The capital of France"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 8192
    back = httpx.post(f"{base}/detokenize", json={"model": model, "tokens": body["tokens"]}, timeout=30)
    assert back.status_code == 200 and back.json()["prompt"] == "The capital of France"
    # Messages are rendered as a chat request renders them: the same prompt token count.
    chat = httpx.post(f"{base}/tokenize", json={"model": model, "messages": CHAT}, timeout=30).json()
    answer = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1)
    assert answer.usage is not None and chat["count"] == answer.usage.prompt_tokens


def test_detokenize_refuses_ids_outside_the_vocabulary(cluster: LocalCluster, model: str) -> None:
    r = httpx.post(f"{cluster.base_url}/detokenize", json={"model": model, "tokens": [1, 10**7]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(f"{cluster.base_url}/tokenize", json={"model": "no-such-model", "prompt": "x"}, timeout=30)
    assert r.status_code == 404
    r = httpx.post(f"{cluster.base_url}/tokenize", json={"model": model}, timeout=30)
    assert r.status_code == 400


@pytest.mark.parametrize("stream", [False, True])
def test_echo_returns_the_prompt_ahead_of_the_completion(client: openai.OpenAI, model: str, stream: bool) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    if stream:
        text = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True
            )
            if c.choices
        )
    else:
        text = (
            client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True)
            .choices[0]
            .text
        )
    assert text == prompt + plain.choices[0].text
