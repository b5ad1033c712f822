"""logprobs, n, best_of, a list of prompts and logit_bias through the official client."""

from __future__ import annotations

import httpx
import openai
import pytest

from ops.localcluster import LocalCluster
from tests.helpers.cluster import on_the_core

CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.mark.parametrize("top", [0, 3])
def test_chat_logprobs_follow_the_tokens_chosen(client: openai.OpenAI, model: str, top: int) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=top,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0.0 and len(e.top_logprobs) == top
        if top:  # greedy: the chosen token is the most likely one, with the same logprob
            assert e.top_logprobs[0].token == e.token
            assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6
            assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)


def test_streamed_logprobs_add_up_to_the_text(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    text, tokens = "", ""
    for c in stream:
        if c.choices:
            text += c.choices[0].delta.content or ""
            tokens += "".join(e.token for e in (c.choices[0].logprobs.content or [])) if c.choices[0].logprobs else ""
    assert text and tokens == text


def test_completions_logprobs_in_the_legacy_shape(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs or []) == len(lp.tokens) and all(len(t) <= 2 for t in lp.top_logprobs or [])
    assert lp.text_offset and lp.text_offset[0] == 0


def test_n_gives_distinct_samples_and_streams_each_index(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=1.0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    seen: dict[int, str] = {}
    for c in client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=8,
        temperature=1.0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for choice in c.choices:
            seen[choice.index] = seen.get(choice.index, "") + (choice.delta.content or "")
        if c.usage is not None:
            assert c.usage.completion_tokens >= 2
    assert set(seen) == {0, 1} and all(seen.values())


def test_a_list_of_prompts_answers_each_in_order(cluster: LocalCluster, client: openai.OpenAI, model: str) -> None:
    # Both sides on the core: the start tier's greedy text may differ from the core's.
    on_the_core(cluster, model)
    prompts = ["The capital of France is", "1, 2, 3,"]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0)
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts
    ]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == alone


def test_best_of_returns_n_and_counts_every_candidate(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=8,
        temperature=1.0,
        best_of=3,
        n=1,
        extra_body={"ignore_eos": True},
    )
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    assert r.usage is not None and r.usage.completion_tokens == 3 * 8


def test_logit_bias_keeps_a_token_out(client: openai.OpenAI, model: str, cluster: LocalCluster) -> None:
    def first_token(**extra: object) -> str:
        r = client.chat.completions.create(
            model=model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, **extra
        )  # type: ignore[call-overload]
        return r.choices[0].logprobs.content[0].token  # type: ignore[union-attr, index]

    free = first_token()
    ids = httpx.post(f"{cluster.base_url}/tokenize", json={"model": model, "prompt": free}, timeout=30).json()["tokens"]
    assert len(ids) == 1
    assert first_token(logit_bias={str(ids[0]): -100}) != free
    with pytest.raises(openai.BadRequestError) as e:
        first_token(logit_bias={"99999999": 5})
    assert e.value.param == "logit_bias"
