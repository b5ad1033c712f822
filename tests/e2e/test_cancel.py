"""A client that leaves mid-stream stops the engine decoding (counted in decoded tokens)."""

from __future__ import annotations

import openai

from ops.localcluster import LocalCluster
from tests.helpers.cluster import metric, wait_for

ENGINE = "engine@node-0"
MAX_TOKENS = 3000


def test_disconnect_mid_stream_cancels_generation_in_the_engine(
    cluster: LocalCluster, client: openai.OpenAI, model: str
) -> None:
    cancelled_before = metric(cluster, ENGINE, "tessera_engine_requests_total", finish_reason="cancelled")
    decoded_before = metric(cluster, ENGINE, "tessera_engine_decoded_tokens_total")

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell a very long story."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},  # without a disconnect it would decode all 3000
    )
    received = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
        if received >= 5:
            break
    stream.close()

    wait_for(
        lambda: metric(cluster, ENGINE, "tessera_engine_requests_total", finish_reason="cancelled") > cancelled_before,
        60,
        "the engine to end the generation as cancelled",
    )
    decoded = metric(cluster, ENGINE, "tessera_engine_decoded_tokens_total") - decoded_before
    assert 5 <= decoded < MAX_TOKENS / 4, decoded

    # The engine is free again: the next request completes normally.
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.choices[0].message.content is not None
