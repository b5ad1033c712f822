"""The default model served by a pipeline of stages (FaaScale §4.3): each stage a process of
its own holding only its layer range, the hidden states passed over TCP, the last stage's
logits sampled by the engine's sampler (the worker's pipeline batch). Greedy text is transformers' own; a seeded sample is
the one the whole model gives; a stage that dies fails the generation with a named error
instead of hanging it."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch engine needs torch (the `test` extra installs it)")

import torch
from transformers import AutoModelForCausalLM

from cuda_ext import TensorArena
from services.engine.torch_engine.engine import TorchEngine, read_manifest
from services.engine.torch_engine.stage_wire import PipelineBatch, StageServer
from services.engine.torch_engine.stages import LayerRange, Stage
from shared.messages import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def serve_stage(checkpoint: str, r: LayerRange, conn: Connection) -> None:
    """A stage's process: load its range, serve it, say where, run until told to stop."""
    torch.set_num_threads(1)

    async def main() -> None:
        stage = Stage.load(Path(checkpoint), r)
        server = StageServer(stage)
        conn.send((await server.start(), stage.read_bytes))
        await asyncio.to_thread(conn.recv)  # the test's end closing: EOFError ends the thread
        await server.close()

    try:
        asyncio.run(main())
    except EOFError:
        pass


pytestmark = pytest.mark.usefixtures("torch_on_one_thread")


@pytest.fixture(scope="module")
def checkpoint(torch_checkpoint_f32: Path) -> Path:
    return torch_checkpoint_f32


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[TorchEngine]:
    engine = TorchEngine.start(checkpoint, TensorArena(1 << 30, device="cpu"))
    yield engine
    engine.close()


@pytest.fixture
def stages(checkpoint: Path) -> Iterator[list[tuple[str, int, multiprocessing.Process]]]:
    ctx = multiprocessing.get_context("spawn")
    out = []
    ends = []
    try:
        for r in (LayerRange(0, 15, 30), LayerRange(15, 30, 30)):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=serve_stage, args=(str(checkpoint), r, theirs), daemon=True)
            p.start()
            theirs.close()
            assert mine.poll(120), "a stage did not start within 120 s"
            addr, read = mine.recv()
            out.append((addr, read, p))
            ends.append(mine)
        yield out
    finally:
        for end in ends:
            end.close()
        for _, _, p in out:
            p.join(10)
            if p.is_alive():
                p.kill()


def generate(addrs: list[str], prompt: list[int], params: SamplingParams, engine: TorchEngine) -> tuple[list[int], str]:
    """The request's tokens through the stages as the worker's pipeline batch serves it, and its
    error ("" where it ended)."""
    batch = PipelineBatch(addrs, engine.tokenizer, engine.model.config.vocab_size, engine.eos_ids, kv_tokens=4096)
    tokens: list[int] = []
    try:
        batch.add("r", prompt, params)
        while True:
            for step in batch.steps(1.0):
                tokens += [t for t, _ in step.tokens]
                if step.finish is not None or step.error:
                    return tokens, step.error
    finally:
        batch.close()


def test_two_stages_serve_the_default_model_as_the_whole_model_does_and_one_that_dies_fails_it_by_name(
    stages: list[tuple[str, int, multiprocessing.Process]], engine: TorchEngine, checkpoint: Path
) -> None:
    """One pair of stage processes for both halves (each stage is a spawned interpreter that
    imports torch and loads its range): first they serve, then the last one is killed."""
    addrs = [addr for addr, _, _ in stages]
    specs = read_manifest(checkpoint)
    whole = sum(s.nbytes for s in specs)
    embedding = next(s.nbytes for s in specs if s.name == "model.embed_tokens.weight")
    # Each holds its part only: together the whole model, the embedding twice (the first stage
    # embeds, and the last one's head is the tied embedding).
    assert sum(read for _, read, _ in stages) == whole + embedding

    prompt = engine.chat_ids(QUESTION)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    mine, error = generate(addrs, prompt, greedy, engine)
    assert not error, error
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = plain.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    n = min(len(mine), len(theirs))
    assert n >= 4 and mine[:n] == theirs[:n]
    assert "Paris" in engine.tokenizer.decode(mine)

    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    assert generate(addrs, prompt, sampled, engine) == ([t for t, _ in engine.steps(prompt, sampled)], "")

    # A stage that dies fails the next generation with a named error instead of hanging it.
    stages[1][2].kill()
    stages[1][2].join(10)
    tokens, error = generate(addrs, prompt, SamplingParams(max_tokens=4), engine)
    assert tokens == [] and "StageFailed" in error and addrs[1] in error
