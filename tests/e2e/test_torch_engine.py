"""The torch engine on the host with the real default model: the GGUF materialized once into a
torch checkpoint, started on the tensor arena's host fallback, generating with transformers'
model code; a second start finds every tensor resident and reads nothing."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch engine needs torch (the `test` extra installs it)")

import torch
from transformers import AutoModelForCausalLM

from cuda_ext import TensorArena
from services.engine.torch_engine.batching import STEP_TOKENS, ContinuousBatcher
from services.engine.torch_engine.engine import TorchEngine, read_manifest
from services.engine.torch_engine.guides import GuideError
from shared.messages import FinishReason, Guide, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


@pytest.fixture(scope="module")
def checkpoint(torch_checkpoint_f32: Path) -> Path:
    # float32: the host's matmuls (bf16 has no fast path on this CPU).
    return torch_checkpoint_f32


@pytest.fixture(scope="module")
def arena() -> TensorArena:
    return TensorArena(1 << 30, device="cpu")


@pytest.fixture
def engine(checkpoint: Path, arena: TensorArena) -> Iterator[TorchEngine]:
    engine = TorchEngine.start(checkpoint, arena)
    yield engine
    engine.close()


def solo(engine: TorchEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    """The one-request path's tokens."""
    return [t for t, _ in engine.steps(prompt, params)]


def test_the_materialized_checkpoint_names_every_tensor_with_its_digest(checkpoint: Path) -> None:
    specs = read_manifest(checkpoint)
    assert specs[0].name == "model.embed_tokens.weight"  # access order: the embedding is read first
    assert len({s.name for s in specs}) == len(specs) == 272  # 30 layers × 9 + embedding + norm (head tied)
    assert all(len(s.digest) == 64 and s.dtype == torch.float32 for s in specs)


def test_greedy_decoding_is_transformers_own(engine: TorchEngine, checkpoint: Path) -> None:
    prompt = engine.chat_ids(QUESTION)
    mine = solo(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0))
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = plain.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    theirs = out[0, len(prompt) :].tolist()
    n = min(len(mine), len(theirs))
    assert n >= 4 and mine[:n] == theirs[:n]
    assert "Paris" in engine.tokenizer.decode(mine, skip_special_tokens=True)


def test_a_seeded_sample_repeats_and_stops_at_its_length(engine: TorchEngine) -> None:
    prompt = engine.chat_ids(QUESTION)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    first, again = list(engine.steps(prompt, params)), list(engine.steps(prompt, params))
    assert first == again and len(first) == 8  # ignore_eos: it ends at its length


def test_a_start_after_scale_to_zero_reads_no_weight(checkpoint: Path, arena: TensorArena) -> None:
    cold = TorchEngine.start(checkpoint, arena)
    prompt = cold.chat_ids(QUESTION)
    expected = solo(cold, prompt, SamplingParams(max_tokens=6, temperature=0.0))
    cold.close()  # scaled to zero: resident, idle
    warm = TorchEngine.start(checkpoint, arena)
    try:
        assert warm.read_bytes == 0 and warm.bound.loaded.copied_bytes == 0
        assert warm.bound.loaded.reused_bytes == sum(s.nbytes for s in read_manifest(checkpoint))
        assert solo(warm, prompt, SamplingParams(max_tokens=6, temperature=0.0)) == expected
    finally:
        warm.close()


# --- the continuous batch (`batching.py`): transformers' paged-KV continuous batching, each
# token picked by the engine's own sampler -------------------------------------------------


Outcome = dict[str, tuple[list[int], list[Any], Any]]
"""Each request's tokens, logprobs and how it ended (None while it runs)."""


def take(batch: ContinuousBatcher, out: Outcome, timeout: float) -> int:
    """One look at the batch, added to `out`; how many requests stepped."""
    steps = batch.steps(timeout)
    for step in steps:
        assert not step.error, step.error
        tokens, logprobs, _ = out.setdefault(step.request_id, ([], [], None))
        tokens += [t for t, _ in step.tokens]
        logprobs += [lp for _, lp in step.tokens]
        out[step.request_id] = (tokens, logprobs, step.finish)
    return len(steps)


def run_batch(batch: ContinuousBatcher, until: set[str], out: Outcome | None = None) -> Outcome:
    """Look at the batch until every request in `until` has ended."""
    out = {} if out is None else out
    deadline = time.monotonic() + 300
    while not all(out.get(rid, (0, 0, None))[2] is not None for rid in until):
        assert time.monotonic() < deadline, "the batch never ended"
        take(batch, out, 0.05)
    return out


def test_a_crowd_in_one_batch_gets_what_each_request_gets_alone(engine: TorchEngine) -> None:
    """Greedy rows are transformers' greedy; a seeded sample is the one the request gets
    alone (its own sampler, not the batch's generator), with its logprobs, and so is a plain
    one (sampled with the others on the device, `row_sampling.py`); a request that joins
    a running batch and one that ends early leave the others untouched."""
    prompts = [
        engine.chat_ids([{"role": "user", "content": q}])
        for q in ("What is the capital of France?", "Name three colours.", "Count to five.")
    ]
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11, logprobs=2, ignore_eos=True)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    short = SamplingParams(max_tokens=3, temperature=0.0)
    plain = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, top_k=30, seed=5, ignore_eos=True)
    alone = {
        "p": solo(engine, prompts[0], plain),
        "g0": solo(engine, prompts[0], greedy),
        "g1": solo(engine, prompts[1], greedy),
        "short": solo(engine, prompts[2], short),
    }
    alone_sample = list(engine.steps(prompts[1], sampled))

    batch = ContinuousBatcher(engine, max_batch=8, kv_tokens=2048)
    try:
        batch.add("g0", prompts[0], greedy)
        batch.add("s", prompts[1], sampled)
        batch.add("short", prompts[2], short)
        batch.add("p", prompts[0], plain)
        got: Outcome = {}
        deadline = time.monotonic() + 60
        while not take(batch, got, 0.05):
            assert time.monotonic() < deadline, "no step within 60 s"
        batch.add("g1", prompts[1], greedy)  # joins the running batch
        got = run_batch(batch, {"g0", "s", "short", "g1", "p"}, got)
        assert batch.active == 0
    finally:
        batch.close()
    for rid in ("g0", "g1", "short", "p"):
        assert got[rid][0] == alone[rid], rid
    assert got["short"][2] is FinishReason.LENGTH and len(got["short"][0]) == 3
    tokens, logprobs, finish = got["s"]
    assert tokens == [t for t, _ in alone_sample] and finish is FinishReason.LENGTH
    for mine, theirs in zip(logprobs, [lp for _, lp in alone_sample], strict=True):
        assert mine is not None and theirs is not None and mine.token == theirs.token
        assert abs(mine.logprob - theirs.logprob) < 1e-3 and len(mine.top) == 2


def test_a_cancelled_request_leaves_the_batch_and_its_blocks_serve_the_next(engine: TorchEngine) -> None:
    """More requests than the batch holds at once queue and all end; a cancelled one yields
    nothing more, and the cache it held serves the requests after it."""
    prompt = engine.chat_ids(QUESTION)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # Room for about three requests' KV at a time: the later ones wait for blocks.
    batch = ContinuousBatcher(engine, max_batch=4, kv_tokens=160)
    try:
        batch.add("doomed", prompt, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
        deadline = time.monotonic() + 60
        while not take(batch, {}, 0.05):
            assert time.monotonic() < deadline, "no step within 60 s"
        batch.cancel("doomed")
        ids = {f"r{i}" for i in range(6)}
        for rid in sorted(ids):
            batch.add(rid, prompt, params)
        got = run_batch(batch, ids)
        assert "doomed" not in got and batch.active == 0
    finally:
        batch.close()
    expected = solo(engine, prompt, params)
    assert all(got[rid][0] == expected for rid in ids)


def test_structured_output_in_a_crowd_follows_each_requests_grammar(engine: TorchEngine) -> None:
    """A JSON schema, a regex and an EBNF choice, each enforced on its own row of one batch
    (llguidance), beside a plain row that still gets what it gets alone; a guide that does not
    compile fails that request at `add`, and the batch goes on."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "capital": {"type": "boolean"}},
        "required": ["city", "capital"],
        "additionalProperties": False,
    }
    ask = engine.chat_ids(
        [{"role": "user", "content": "Describe Paris as JSON: its name, and whether it is a capital."}]
    )
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = solo(engine, ask, plain)
    guided = {
        "json": SamplingParams(
            max_tokens=80, temperature=0.0, guide=Guide(kind="json_schema", spec=json.dumps(schema))
        ),
        "regex": SamplingParams(
            max_tokens=12, temperature=0.7, seed=3, guide=Guide(kind="regex", spec="[0-9]{3}-[a-z]{2}")
        ),
        "choice": SamplingParams(
            max_tokens=12, temperature=0.0, guide=Guide(kind="grammar", spec='root ::= "yes" | "no"')
        ),
    }
    batch = ContinuousBatcher(engine, max_batch=8, kv_tokens=2048)
    try:
        for rid, params in guided.items():
            batch.add(rid, ask, params)
        batch.add("plain", ask, plain)
        with pytest.raises(GuideError, match="regex"):
            batch.add("broken", ask, SamplingParams(max_tokens=4, guide=Guide(kind="regex", spec="[0-9")))
        got = run_batch(batch, {*guided, "plain"})
    finally:
        batch.close()
    text = {rid: engine.tokenizer.decode(got[rid][0], skip_special_tokens=True) for rid in guided}
    reply = json.loads(text["json"])
    assert set(reply) == {"city", "capital"} and isinstance(reply["capital"], bool), text["json"]
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text["regex"]), text["regex"]
    assert text["choice"] in {"yes", "no"}
    assert all(got[rid][2] is FinishReason.STOP for rid in guided)  # the grammar ended them
    assert got["plain"][0] == alone


def test_a_long_prompt_prefilled_in_chunks_beside_sampling_rows_changes_none_of_them(engine: TorchEngine) -> None:
    """A prompt longer than one step's tokens is prefilled over several steps; the rows of its
    chunks get no token, and the seeded rows sampling beside it must each still get exactly
    the sample they get alone (a row picked twice in a step would shift its generator). Three
    rows sample first and one of them ends, so that the chunk's row sits where a live row's
    pick was the step before. A request longer than the cache is refused at `add`, alone."""
    short = [engine.chat_ids([{"role": "user", "content": q}]) for q in ("Hi.", "Name a fruit.", "Name a river.")]
    story = " ".join(["The lighthouse keeper climbed the stairs and watched the sea."] * 260)
    long = engine.chat_ids([{"role": "user", "content": story + " Summarise."}])
    assert len(long) > STEP_TOKENS
    params = [
        SamplingParams(max_tokens=n, temperature=0.9, seed=40 + i, ignore_eos=True) for i, n in enumerate((2, 24, 24))
    ]
    alone = [[t for t, _ in engine.steps(p, q)] for p, q in zip(short, params, strict=True)]
    batch = ContinuousBatcher(engine, max_batch=8, kv_tokens=4096)
    try:
        with pytest.raises(ValueError, match="KV cache of 4096 tokens"):
            batch.add("huge", long, SamplingParams(max_tokens=4096))
        for i, (p, q) in enumerate(zip(short, params, strict=True)):
            batch.add(f"s{i}", p, q)
        got = run_batch(batch, {"s0"})  # the first row has ended; the two after it sample on
        assert got["s1"][2] is None and got["s2"][2] is None, (
            "the long rows ended too soon to test anything",
            {k: (len(v[0]), v[2]) for k, v in got.items()},
        )
        batch.add("long", long, SamplingParams(max_tokens=4, temperature=0.0))
        got = run_batch(batch, {"s1", "s2", "long"}, got)
    finally:
        batch.close()
    assert [got[f"s{i}"][0] for i in range(3)] == alone
    assert len(got["long"][0]) == 4
