"""A model above the start tier's size rule (`LoaderSettings.start_tier_max_weight_bytes`,
bench/results/start_tier.json) is stored without a start tier and served from the
continuous-batching core from its first token, through every service: registration, a cold
start, a completion, and a request that needs the logits (served on the packed stateful tier).
The rule's limit is set to 0 here so that the default model stands in for a large one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ops.localcluster import LocalCluster, default_model_path
from tests.conftest import start_cluster
from tests.helpers.cluster import register, wait_for

MODEL = "core-first"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("core-first"), model_store, TESSERA_START_TIER_MAX_WEIGHT_BYTES="0")
    try:
        yield c
    finally:
        c.stop()


def test_a_model_above_the_start_tier_rule_is_stored_without_it_and_served_from_the_core(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # Its own artifact (the GGUF with bytes appended): the suite's shared store holds the
    # default model's with a start tier.
    variant = tmp_path / "core-first.gguf"
    variant.write_bytes(default_model_path().read_bytes() + b"core-first-test")
    reg = register(cluster, MODEL, source=str(variant))
    artifact = reg["artifact"]
    assert isinstance(artifact, dict) and artifact["start_tier"] is False, artifact
    assert not (Path(str(artifact["path"])) / "start").exists()

    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=180)
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, temperature=0
    )
    assert first.choices[0].message.content and first.usage is not None and first.usage.completion_tokens > 0

    def tier() -> str | None:
        status = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()
        tiers = [i["tier"] for n in status["nodes"] for i in n["instances"] if i["model"] == MODEL]
        return tiers[0] if tiers and tiers[0] != "start" else None

    assert wait_for(tier, 60, "the instance's tier to be reported") == "steady"  # the core's

    # A request that needs the logits runs on the packed stateful tier: every token follows
    # the bias (token 28 is a letter in SmolLM2's vocabulary; +100 makes it certain).
    biased = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={"28": 100}, logprobs=2
    )
    lp = biased.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert len(set(lp.tokens)) == 1, lp.tokens
