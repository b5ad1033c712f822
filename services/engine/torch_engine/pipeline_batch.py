"""A batch whose forward passes run on the stages of an execution pipeline (FaaScale §4.3):
what a node serves a model with while its own replica is still arriving.

It is a `batch_types.Batch`, so the worker loop's request plumbing (text, stops, streaming,
cancels) is the one every engine uses. Each request runs as a session of its own through
every stage (`stage_wire.Pipeline`); the stages interleave the sessions' passes, so several
requests are in the pipeline at once (§4.3's 2-D pipelining: each stage works on one request
while the next stage works on another). Every token is picked here, by the engine's own
sampler and grammar over the last stage's logits, exactly as the local batch picks it for a
row it samples on the host: same seed, same token; logprobs, penalties and structured output
are honoured the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from services.engine.batch_types import Step, check_fits, drain
from services.engine.sampling import Sampler, token_logprob
from services.engine.torch_engine.guides import Guided, Guides
from services.engine.torch_engine.stage_wire import Pipeline
from shared.messages import FinishReason, SamplingParams


class PipelineBatch:
    def __init__(
        self, stages: Sequence[str], tokenizer: object, vocab_size: int, eos_ids: Iterable[int], kv_tokens: int
    ) -> None:
        self.stages = list(stages)
        self.eos_ids = frozenset(eos_ids)
        self.kv_tokens = kv_tokens
        self.guides = Guides(tokenizer, vocab_size, self.eos_ids)
        self._out: queue.Queue[Step] = queue.Queue()
        self._runs: dict[str, concurrent.futures.Future[None]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="pipeline")
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._runs)

    @property
    def waited(self) -> float:
        return 0.0  # no step gate: the stages' nodes run the passes

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def set_threads(self, threads: int) -> None:
        pass  # nothing heavy runs here: the sampler's work per token

    # The stages hold the KV caches and the layers, in their own processes.
    kv_bytes = 0

    def device_bytes(self) -> int:
        return 0

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float] | None = None,
        kv_tokens: int = 0,
    ) -> None:
        check_fits(len(prompt_ids), params.max_tokens, self.kv_tokens)
        guided = self.guides.start(params.guide) if params.guide is not None else None
        run = asyncio.run_coroutine_threadsafe(self._run(request_id, list(prompt_ids), params, guided), self._loop)
        self._runs[request_id] = run
        run.add_done_callback(lambda _: self._runs.pop(request_id, None))

    def cancel(self, request_id: str) -> None:
        run = self._runs.pop(request_id, None)
        if run is not None:
            run.cancel()

    def steps(self, timeout: float) -> list[Step]:
        """Every request's progress since the last call, waiting up to `timeout` for the first."""
        return list(drain(self._out, timeout).values())

    def close(self) -> None:
        """End every request (their stage sessions are dropped as they unwind) and the loop."""

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _run(self, request_id: str, context: list[int], params: SamplingParams, guided: Guided | None) -> None:
        try:
            async with Pipeline(self.stages) as pipe:
                session = uuid.uuid4().hex
                try:
                    await self._generate(pipe, session, request_id, context, params, guided)
                finally:
                    await pipe.drop(session)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # this request fails (a stage gone, a grammar refusal); others go on
            self._out.put(Step(request_id, (), None, f"{type(e).__name__}: {e}"))

    async def _generate(
        self,
        pipe: Pipeline,
        session: str,
        request_id: str,
        context: list[int],
        params: SamplingParams,
        guided: Guided | None,
    ) -> None:
        sampler = Sampler.of(params)
        x = torch.tensor([context], dtype=torch.long)
        for n in range(params.max_tokens):
            logits = np.asarray(await pipe.step(session, x), dtype=np.float32)
            masked = logits if guided is None else guided.mask(logits)
            token = sampler.pick(masked, context)
            if guided is not None:
                guided.accept(token)
            logprob = None
            if params.logprobs >= 0 and sampler.adjusted is not None:
                logprob = token_logprob(sampler.adjusted, token, params.logprobs)
            context.append(token)
            if token in self.eos_ids and not params.ignore_eos:  # it ends it; it is not text
                self._out.put(Step(request_id, (), FinishReason.STOP))
                return
            finish = FinishReason.LENGTH if n + 1 >= params.max_tokens else None
            self._out.put(Step(request_id, ((token, logprob),), finish))
            x = torch.tensor([[token]], dtype=torch.long)
