"""The torch worker's batch on a tiny Llama with random weights and a byte-level tokenizer made
here, so that the same checks run on the host and, replayed from CUDA graphs, on a GPU (where
no GGUF travels): plain rows sampled on the device beside rows the host picks after the step
(a grammar, logprobs, penalties), all in one batch. On the real model the host's batch is
checked against the one-request path in `tests/e2e/test_torch_engine.py`."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch engine needs torch (the `test` extra installs it)")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from cuda_ext import TensorArena  # noqa: E402
from services.engine.torch_engine.batching import ContinuousBatcher  # noqa: E402
from services.engine.torch_engine.engine import TorchEngine  # noqa: E402
from services.loader.torch_checkpoint import write_checkpoint  # noqa: E402
from shared.messages import FinishReason, Guide, SamplingParams, TokenLogprob  # noqa: E402

DEVICES = [
    pytest.param("cpu", id="host"),
    pytest.param(
        "cuda",
        id="gpu",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
        ],
    ),
]


def tiny_checkpoint(dest: Path) -> Path:
    """A 2-layer Llama over the 256 bytes and an end of turn, random float32 weights."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<|im_end|>"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=vocab["<|im_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    return write_checkpoint(dest, tensors, config, tokenizer, "random weights")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(params=DEVICES)
def engine(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[TorchEngine]:
    e = TorchEngine.start(checkpoint, TensorArena(64 << 20, device=request.param))
    try:
        yield e
    finally:
        e.close()


Outcome = dict[str, tuple[list[int], list[TokenLogprob | None], FinishReason | None]]


def run(batch: ContinuousBatcher, requests: dict[str, tuple[list[int], SamplingParams]]) -> Outcome:
    for rid, (prompt, params) in requests.items():
        batch.add(rid, prompt, params)
    out: Outcome = {}
    deadline = time.monotonic() + 120
    while not all(out.get(rid, ([], [], None))[2] is not None for rid in requests):
        assert time.monotonic() < deadline, f"the batch never ended: {out}"
        for step in batch.steps(0.05):
            assert not step.error, step.error
            tokens, logprobs, _ = out.setdefault(step.request_id, ([], [], None))
            out[step.request_id] = (
                tokens + [t for t, _ in step.tokens],
                logprobs + [lp for _, lp in step.tokens],
                step.finish,
            )
    return out


def test_plain_and_host_picked_rows_share_a_batch_on_every_device(engine: TorchEngine) -> None:
    prompt = engine.tokenizer("hello there", add_special_tokens=False)["input_ids"]
    n = 12
    requests = {
        "greedy": (prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)),
        "nucleus": (prompt, SamplingParams(max_tokens=n, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True)),
        "top-k": (prompt, SamplingParams(max_tokens=n, temperature=1.2, top_k=5, min_p=0.01, seed=4, ignore_eos=True)),
        "logprobs": (prompt, SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True)),
        "penalised": (
            prompt,
            SamplingParams(
                max_tokens=n, temperature=0.0, repetition_penalty=3.0, presence_penalty=2.0, ignore_eos=True
            ),
        ),
        "digits": (prompt, SamplingParams(max_tokens=n, temperature=0.0, guide=Guide(kind="regex", spec="[0-9]{3}"))),
    }
    batch = ContinuousBatcher(engine, max_batch=8, kv_tokens=256)
    try:
        assert batch.sampling.graphed is (engine.device.type == "cuda")
        first = run(batch, requests)
        # Its KV cache, for the node's true-up: keys and values of every layer for at least
        # the tokens it was made for; on a GPU within what torch's allocator holds there.
        cfg = engine.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * engine.model.dtype.itemsize
        assert batch.kv_bytes >= 256 * per_token
        if engine.device.type == "cuda":
            assert batch.device_bytes() >= batch.kv_bytes
        else:
            assert batch.device_bytes() == 0
        # Again on the same batch (on a GPU, now from the graphs captured the first time).
        again = run(batch, {f"{rid}+": r for rid, r in requests.items()})
    finally:
        batch.close()
    for got in (first, {rid.removesuffix("+"): v for rid, v in again.items()}):
        for rid in ("greedy", "nucleus", "top-k", "logprobs", "penalised"):
            tokens, _, finish = got[rid]
            assert len(tokens) == n and finish is FinishReason.LENGTH, rid
        # The grammar, applied on the host after the step, took: three digits, then the end.
        tokens, _, finish = got["digits"]
        assert re.fullmatch("[0-9]{3}", engine.tokenizer.decode(tokens)) and finish is FinishReason.STOP
        tokens, logprobs, _ = got["logprobs"]
        for token, lp in zip(tokens, logprobs, strict=True):
            assert lp is not None and lp.token == token and lp.logprob <= 0.0 and len(lp.top) == 2
            assert lp.top[0][0] == token  # greedy: the most likely token is the one taken
        penalised = got["penalised"][0]
        assert len(set(penalised)) > len(penalised) // 2, "a repetition penalty of 3 repeats little"
    # Rows are their requests' own: seeded and greedy rows pick the same tokens both times.
    for rid in ("greedy", "nucleus", "top-k", "logprobs", "penalised", "digits"):
        assert first[rid][0] == again[f"{rid}+"][0], rid


def test_a_gated_batch_takes_a_turn_per_step_and_holds_nothing_once_its_requests_end(checkpoint: Path) -> None:
    """Each step passes the node's gate (`StepGate.turn`, held across the library's calls);
    once no request goes on, the batch neither holds a turn nor stays posted, so another
    instance's iteration runs at once."""
    import math
    import multiprocessing

    from services.engine.step_gate import StepGate

    gate = StepGate(multiprocessing.get_context("spawn"), capacity=1)
    mine, other = gate.claim(), gate.claim()
    engine = TorchEngine.start(checkpoint, TensorArena(64 << 20, device="cpu"))
    batch = ContinuousBatcher(engine, max_batch=4, kv_tokens=256, gate=gate, gate_slot=mine)
    try:
        prompt = engine.tokenizer("hi", add_special_tokens=False)["input_ids"]
        out = run(batch, {"a": (prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))})
        assert len(out["a"][0]) == 6
        with batch.sampling.lock:
            assert not batch.sampling.holding
        assert gate._holding[mine] == 0 and gate._deadlines[mine] == math.inf
        assert gate.enter(other, 0.0)  # nobody holds the node's one turn
        gate.leave(other)
    finally:
        batch.close()
        engine.close()
