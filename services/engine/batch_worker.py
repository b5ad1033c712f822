"""A worker process that serves one model through a continuous batch (`Batch`) behind the
engine's pipe protocol (`worker_wire`), so that the engine's pool, starts and generation drive
it as they drive the OpenVINO worker. The torch engine's worker (`torch_engine/worker.py`) and
vLLM's (`vllm_engine/worker.py`) are this with their own way to bind a model and make its batch.

Both bind the artifact's torch checkpoint (materialized by the loader at registration). A
request joins the running batch at its next step, and each request's new tokens after a step
travel in one `Chunks` message. The worker's thread reads its pipe between looks at the batch
(`POLL_S`), so a cancel ends a running request at its next step.

A start's bounded core share (`Load.cores`) applies as it does on the OpenVINO worker: the
load and the model's first steps run on that many threads, pinned to those cores, until the
engine's `TierUpNow` (sent once the whole node is idle) gives the worker every core back. There
is no other tier to build: `TierUpNow` is answered at once, on STEADY.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.engine.batch_types import Batch, Step
from services.engine.cpu_share import pin_all_threads
from services.engine.step_gate import StepGate
from services.engine.stops import StopMatcher
from services.engine.streams import Chunk
from services.engine.text_stream import Piece, TextStream
from services.engine.worker_wire import (
    CancelRun,
    Chunks,
    Done,
    DropSession,
    Failure,
    Load,
    Loaded,
    Run,
    StageSpec,
    Started,
    TieredUp,
    TierUpNow,
)

if TYPE_CHECKING:
    from services.engine.torch_engine.stage_wire import StageServer
from shared.artifact import TORCH_MANIFEST
from shared.messages import FinishReason, Tier

POLL_S = 0.005
"""Longest the worker looks at the batch before it reads its pipe again (a step of a crowd
takes longer; a new request or a cancel waits at most this long to be seen)."""


@dataclass
class _Live:
    """A request in the batch, as the worker streams it."""

    run: Run
    text: TextStream
    started: float
    waited_at: float
    batch: int
    waited_first: float
    """The gate's wait counter at its first token (at its start until then)."""
    generated: int = 0
    first: float | None = None


class BatchWorker:
    """The request plumbing; a subclass binds models (`_open`, `_reopen`, `_release`)."""

    def __init__(
        self,
        conn: Connection,
        gate: StepGate | None = None,
        slot: int = -1,
        max_batch: int = 16,
        kv_tokens: int = 8192,
    ) -> None:
        self.conn = conn
        self.gate = gate if gate is not None and slot >= 0 else None
        self.slot = slot
        self.max_batch = max(1, max_batch)
        self.kv_tokens = kv_tokens
        self.tokenizer: Any = None
        """The bound model's tokenizer (its `decode` turns tokens into text); None: no model."""
        self.batch: Batch | None = None
        self._stages: list[StageServer] = []
        """The stage servers this worker runs (`Load.stage`), on a loop of their own."""
        self._stage_loop: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None
        self.live: dict[str, _Live] = {}
        self.all_cores = os.sched_getaffinity(0)
        self.threads = torch.get_num_threads()
        """The pre-warm's thread count: what the worker runs with outside a start's share."""

    def serve(self) -> None:
        try:
            while True:
                try:
                    if not self.live:
                        self.conn.poll(None)
                    self._read_commands()
                except (EOFError, OSError):
                    return
                if self.live:
                    self.pump(POLL_S)
        finally:
            if self.batch is not None:
                self.batch.close()

    def _read_commands(self) -> None:
        while self.conn.poll(0):
            self._handle(self.conn.recv())

    def _handle(self, cmd: object) -> None:
        try:
            if isinstance(cmd, Run):
                self._add(cmd)
            elif isinstance(cmd, CancelRun):
                self._cancel(cmd.request_id)
            elif isinstance(cmd, Load):
                self._load(cmd)
            elif isinstance(cmd, TierUpNow):
                # One tier: nothing to build, and the engine waits for an answer. The node is
                # idle: a start's bounded share ends here.
                self._unpin()
                self.conn.send(TieredUp(Tier.TORCH, 0.0, "" if self.tokenizer is not None else "no model loaded"))
            elif isinstance(cmd, DropSession):
                pass  # no state outlives a request here: its KV blocks are freed as it ends
        except Exception as e:  # the engine turns this into an error for the request (or the load)
            self.conn.send(Failure(getattr(cmd, "request_id", None), f"{type(e).__name__}: {e}"))

    def _add(self, run: Run) -> None:
        if self.tokenizer is None or self.batch is None:
            self.conn.send(Failure(run.request_id, "no model loaded in this worker"))
            return
        if not self.batch.alive:  # an error inside the library ended it (its requests failed): anew
            self.batch.close()
            self.batch = self._reopen(torch.get_num_threads())
        tokenizer = self.tokenizer
        text = TextStream(
            lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)),
            StopMatcher(run.params.stop),
            run.stream_interval_s,
            time.monotonic,
        )
        self.batch.add(run.request_id, run.prompt_ids, run.params, run.deadline)
        waited = self.batch.waited
        live = _Live(run, text, time.monotonic(), waited, self.batch.active, waited)
        self.live[run.request_id] = live
        self.conn.send(Started(run.request_id, live.batch))

    def _load(self, cmd: Load) -> None:
        t0 = time.monotonic()
        checkpoint = cmd.checkpoint
        if not (checkpoint / TORCH_MANIFEST).is_file():
            raise FileNotFoundError(
                f"{cmd.artifact.artifact_id} has no torch checkpoint in {checkpoint}: the node's loader "
                "writes it before a model's first start here (its log says why it did not)"
            )
        if cmd.stage is not None:  # one more stage beside what the worker runs (other stages, a pipeline)
            self.conn.send(self._serve_stage(checkpoint, cmd.stage, t0))
            return
        for rid in list(self.live):
            self.conn.send(Failure(rid, "the worker was bound to another model"))
        self.live.clear()
        if self.batch is not None:
            self.batch.close()
            self.batch = None
        if self.tokenizer is not None:
            self._release()
            self.tokenizer = None
        threads = self.threads
        if cmd.cores:
            # The start's share: its load and first steps on these cores alone, beside the
            # node's busy instances (`EngineSettings.start_cpu_share`), until `TierUpNow`.
            pin_all_threads(set(cmd.cores))
            threads = min(threads, len(cmd.cores))
        torch.set_num_threads(threads)
        if cmd.stages:  # the stages this worker runs may be among them: they stay
            self.conn.send(self._open_pipeline(checkpoint, cmd.stages, t0))
        else:
            self._end_stages()
            self.conn.send(self._open(checkpoint, threads, t0, cmd))

    def _serve_stage(self, checkpoint: Path, spec: StageSpec, t0: float) -> Loaded:
        """Run a layer range of the model at `checkpoint` (possibly a copy still arriving: only
        the range's tensors are read) as a stage server for pipelines, beside the other stages
        this worker runs and the pipeline it may drive (one worker a node, not one a stage)."""
        from services.engine.torch_engine.stage_wire import StageServer
        from services.engine.torch_engine.stages import LayerRange, Stage

        stage = Stage.load(checkpoint, LayerRange(spec.lo, spec.hi, spec.layers, head=spec.head))
        if self._stage_loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, daemon=True, name="stage-servers")
            thread.start()
            self._stage_loop = (loop, thread)
        server = StageServer(stage)
        addr = asyncio.run_coroutine_threadsafe(server.start(spec.host, 0), self._stage_loop[0]).result(30)
        self._stages.append(server)
        return Loaded(loaded_from_cache=True, load_s=time.monotonic() - t0, threads=torch.get_num_threads(), addr=addr)

    def _open_pipeline(self, checkpoint: Path, stages: Sequence[str], t0: float) -> Loaded:
        """Serve the model through the stages of an execution pipeline: the tokenizer and config
        from `checkpoint` (their files come first in a multicast), the forward passes remote."""
        from transformers import AutoConfig, AutoTokenizer

        from services.engine.torch_engine.engine import ends_of_sequence
        from services.engine.torch_engine.pipeline_batch import PipelineBatch

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        config = AutoConfig.from_pretrained(checkpoint)
        eos = ends_of_sequence(self.tokenizer, config.eos_token_id)
        self.batch = PipelineBatch(stages, self.tokenizer, config.vocab_size, eos, self.kv_tokens)
        return Loaded(loaded_from_cache=True, load_s=time.monotonic() - t0, threads=torch.get_num_threads())

    def _end_stages(self) -> None:
        """Stop the stage servers this worker runs (their sessions end with them)."""
        if self._stage_loop is None:
            return
        (loop, thread), self._stage_loop = self._stage_loop, None
        servers, self._stages = self._stages, []
        try:
            for server in servers:
                asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)

    def _open(self, checkpoint: Path, threads: int, t0: float, load: Load) -> Loaded:
        """Bind the model at `checkpoint`, setting `tokenizer` and `batch` (steps on `threads`
        threads); what the engine is told of the load (begun at `t0`). `load.placement`: where
        the node's arena book put its tensors (a torch worker on the node's shared arena);
        `load.fill`: where to follow the engine's copy of those it fills, streaming in behind
        the start."""
        raise NotImplementedError

    def _reopen(self, threads: int) -> Batch:
        """A new batch for the bound model (its last one died)."""
        raise NotImplementedError

    def _release(self) -> None:
        """Let the bound model go (its batch is closed)."""

    def _unpin(self) -> None:
        if os.sched_getaffinity(0) != self.all_cores:
            pin_all_threads(self.all_cores)
        torch.set_num_threads(self.threads)
        if self.batch is not None:
            self.batch.set_threads(self.threads)

    def _cancel(self, request_id: str) -> None:
        live = self.live.pop(request_id, None)
        if live is None or self.batch is None:
            return
        self.batch.cancel(request_id)
        self._done(live, FinishReason.CANCELLED)

    def pump(self, timeout: float) -> None:
        """Look at the batch once (waiting up to `timeout` for a step) and stream what it made:
        every request's new text in one `Chunks`, then the `Done` of those that ended."""
        if self.batch is None:
            return
        ended: list[tuple[_Live, FinishReason]] = []
        failed: list[Failure] = []
        chunks: list[Chunk] = []
        for step in self.batch.steps(timeout):
            live = self.live.get(step.request_id)
            if live is None:
                continue  # cancelled
            finish, pieces = self._advance(live, step)
            if finish is not None and (last := live.text.end()) is not None:
                pieces.append(last)
            chunks += [Chunk(step.request_id, p.text, p.tokens, p.logprobs) for p in pieces]
            if step.error:
                del self.live[step.request_id]
                failed.append(Failure(step.request_id, step.error))
            elif finish is not None:
                del self.live[step.request_id]
                ended.append((live, finish))
        if chunks:
            self.conn.send(Chunks(tuple(chunks)))
        for failure in failed:  # after the text it had: the engine ends its stream at a Failure
            self.conn.send(failure)
        for live, finish in ended:
            self._done(live, finish)

    def _advance(self, live: _Live, step: Step) -> tuple[FinishReason | None, list[Piece]]:
        """Take a step's tokens into the request's text: how it ended, if it did, and the
        pieces of text ready to send."""
        assert self.batch is not None
        live.batch = max(live.batch, len(self.live))  # the most requests its steps ran beside
        pieces = []
        for token, logprob in step.tokens:
            live.generated += 1
            if live.first is None:
                live.first, live.waited_first = time.monotonic(), self.batch.waited
            piece = live.text.add(token, logprob)
            if piece is not None:
                pieces.append(piece)
            if live.text.stopped:  # a stop string: the rest of its computation goes too
                self.batch.cancel(live.run.request_id)
                return FinishReason.STOP, pieces
        return step.finish, pieces

    def _done(self, live: _Live, finish: FinishReason) -> None:
        waited = self.batch.waited if self.batch is not None else live.waited_at
        t_end = time.monotonic()
        first = live.first
        self.conn.send(
            Done(
                live.run.request_id,
                finish,
                live.generated,
                first,
                len(live.run.prompt_ids),
                prefill_s=max(0.0, (first or t_end) - live.started - (live.waited_first - live.waited_at)),
                decode_s=max(0.0, t_end - first - (waited - live.waited_first)) if first is not None else 0.0,
                batch=live.batch,
                prefill_tokens=len(live.run.prompt_ids),
                gated_s=max(0.0, waited - live.waited_at),
                kv_allocated_bytes=self.batch.kv_bytes if self.batch is not None else 0,
                device_bytes=self.batch.device_bytes() if self.batch is not None else 0,
            )
        )
