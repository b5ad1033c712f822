"""A torch worker: the torch engine behind the same pipe protocol as the OpenVINO worker
(`worker_wire`), so that the engine's pool, starts and generation drive either alike.

One model at a time, bound from the artifact's torch checkpoint (materialized by the loader at
registration) into the worker's tensor arena; a `Load` of another model (or of the same one
again) releases the first to the arena, where its tensors stay resident, idle, so the next
start copies only what is missing (Tangram §3.1). Requests run one at a time, in arrival order
(no batching yet: `max_batch` is the OpenVINO worker's); between tokens the worker reads its
pipe, so a cancel ends a running request after its current token and new ones queue. Each
iteration passes the node's headroom gate (`step_gate.py`) as the OpenVINO worker's do. There
is one tier: `TierUpNow` is answered at once, on STEADY. A start's bounded core share
(`Load.cores`) is not applied: torch's threads are set once, at the pre-warm.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator
from multiprocessing.connection import Connection

import torch

from cuda_ext import TensorArena
from services.engine.step_gate import StepGate
from services.engine.stops import StopMatcher
from services.engine.streams import Chunk
from services.engine.text_stream import Piece, TextStream
from services.engine.torch_engine.engine import TorchEngine
from services.engine.worker_wire import (
    CancelRun,
    Chunks,
    Done,
    DropSession,
    Failure,
    Load,
    Loaded,
    Run,
    Started,
    TieredUp,
    TierUpNow,
)
from shared.artifact import has_torch_checkpoint, torch_checkpoint
from shared.messages import Artifact, FinishReason, SamplingParams, Tier, TokenLogprob

Steps = Generator[tuple[int, TokenLogprob | None]]


def prewarm() -> None:
    """Import what binding a model would otherwise import on a start's path: transformers'
    auto classes and the decoder code of the default model's architecture."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def refusal(params: SamplingParams) -> str:
    """Why the torch engine cannot serve a request as asked ("" when it can): it never
    ignores a parameter silently."""
    if params.guide is not None:
        return "the torch engine does not enforce structured output (a guide) yet"
    return ""


class TorchWorker:
    def __init__(self, conn: Connection, arena: TensorArena, gate: StepGate | None = None, slot: int = -1) -> None:
        self.conn = conn
        self.arena = arena
        self.gate = gate if gate is not None and slot >= 0 else None
        self.slot = slot
        self.engine: TorchEngine | None = None
        self.artifact: Artifact | None = None
        self.queue: deque[Run] = deque()
        self.running: str | None = None
        self.cancelled = False
        """The running request was cancelled: it ends after its current token."""
        self.waited = 0.0
        """Seconds this worker's iterations have waited for the gate, in all."""

    def serve(self) -> None:
        while True:
            try:
                if not self.queue:
                    self.conn.poll(None)
                self._read_commands()
            except (EOFError, OSError):
                return
            if self.queue:
                self._run(self.queue.popleft())

    def _read_commands(self) -> None:
        while self.conn.poll(0):
            self._handle(self.conn.recv())

    def _handle(self, cmd: object) -> None:
        try:
            if isinstance(cmd, Run):
                why = refusal(cmd.params)
                if why:
                    self.conn.send(Failure(cmd.request_id, why))
                else:
                    self.queue.append(cmd)
            elif isinstance(cmd, CancelRun):
                self._cancel(cmd.request_id)
            elif isinstance(cmd, Load):
                self._load(cmd)
            elif isinstance(cmd, TierUpNow):
                # One tier: nothing to build, and the engine waits for an answer.
                self.conn.send(TieredUp(Tier.STEADY, 0.0, "" if self.engine is not None else "no model loaded"))
            elif isinstance(cmd, DropSession):
                pass  # no state outlives a request here: its KV cache is its own
        except Exception as e:  # the engine turns this into an error for the request (or the load)
            self.conn.send(Failure(getattr(cmd, "request_id", None), f"{type(e).__name__}: {e}"))

    def _load(self, cmd: Load) -> None:
        t0 = time.monotonic()
        checkpoint = torch_checkpoint(cmd.artifact)
        if not has_torch_checkpoint(cmd.artifact):
            raise FileNotFoundError(
                f"{cmd.artifact.artifact_id} has no torch checkpoint in {checkpoint}: "
                "it was registered by a loader whose engine_backend is not torch"
            )
        if self.engine is not None:
            self.engine.close()  # its tensors stay resident, idle: shared ones are not copied again
            self.engine = None
        self.engine = TorchEngine.start(checkpoint, self.arena)
        self.artifact = cmd.artifact
        self.conn.send(
            Loaded(
                # Nothing is compiled at start: the checkpoint was materialized at registration.
                loaded_from_cache=True,
                load_s=time.monotonic() - t0,
                threads=torch.get_num_threads(),
            )
        )

    def _cancel(self, request_id: str) -> None:
        if request_id == self.running:
            self.cancelled = True
            return
        for run in self.queue:
            if run.request_id == request_id:
                self.queue.remove(run)
                self.conn.send(Done(request_id, FinishReason.CANCELLED, 0, None, len(run.prompt_ids)))
                return

    def _send(self, request_id: str, piece: Piece | None) -> None:
        if piece is not None:
            self.conn.send(Chunks((Chunk(request_id, piece.text, piece.tokens, piece.logprobs),)))

    def _run(self, run: Run) -> None:
        engine = self.engine
        rid = run.request_id
        if engine is None:
            self.conn.send(Failure(rid, "no model loaded in this worker"))
            return
        self.running, self.cancelled = rid, False
        self.conn.send(Started(rid, 1))
        tokenizer = engine.tokenizer
        text = TextStream(
            lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)),
            StopMatcher(run.params.stop),
            run.stream_interval_s,
            time.monotonic,
        )
        t_run, waited_at = time.monotonic(), self.waited
        first: float | None = None
        waited_first = waited_at
        generated = 0
        finish = FinishReason.STOP
        steps = engine.steps(run.prompt_ids, run.params)
        try:
            while True:
                if self.cancelled:
                    finish = FinishReason.CANCELLED
                    break
                item = self._gated(steps, run.deadline(generated))
                if item is None:  # the model's end of sequence, or max_tokens
                    finish = FinishReason.LENGTH if generated >= run.params.max_tokens else FinishReason.STOP
                    break
                token, logprob = item
                generated += 1
                if first is None:
                    first, waited_first = time.monotonic(), self.waited
                self._send(rid, text.add(token, logprob))
                if text.stopped:
                    finish = FinishReason.STOP
                    break
                self._read_commands()  # cancels and new requests, between tokens
        except Exception as e:  # this request fails; the worker lives on
            self.conn.send(Failure(rid, f"{type(e).__name__}: {e}"))
            return
        finally:
            steps.close()
            self.running = None
            if self.gate is not None:
                self.gate.idle(self.slot)
        if finish is not FinishReason.CANCELLED:
            self._send(rid, text.end())
        t_end = time.monotonic()
        self.conn.send(
            Done(
                rid,
                finish,
                generated,
                first,
                len(run.prompt_ids),
                prefill_s=max(0.0, (first or t_end) - t_run - (waited_first - waited_at)),
                decode_s=max(0.0, t_end - first - (self.waited - waited_first)) if first is not None else 0.0,
                batch=1,
                prefill_tokens=len(run.prompt_ids),
                gated_s=self.waited - waited_at,
            )
        )

    def _gated(self, steps: Steps, deadline: float) -> tuple[int, TokenLogprob | None] | None:
        """The next token (one forward pass), once the node's headroom gate lets this worker
        run an iteration; None when the generation has ended."""
        if self.gate is None:
            return next(steps, None)
        t0 = time.monotonic()
        entered = self.gate.enter(self.slot, deadline)
        self.waited += time.monotonic() - t0
        try:
            return next(steps, None)
        finally:
            if entered:
                # Posted again at once for the next token (`StepGate.leave`); `idle` at the end.
                self.gate.leave(self.slot, deadline)
