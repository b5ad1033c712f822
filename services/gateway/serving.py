"""The gateway's logic between HTTP and the bus: prepare a request, place it, relay its tokens.

Admission happens here: a request is counted against `max_inflight` from placement until its
stream is closed, and it is always closed: by its end, by an error, or by the client leaving
(which sends `Cancel` to the engine so that decoding stops).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from services.gateway import fallbacks, guides
from services.gateway.generation import Generation, Prepared
from services.gateway.loading import Placing, StartWatch
from services.gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from services.gateway.settings import GatewaySettings
from services.gateway.tokenizers import Tokenizers
from services.gateway.tools import ToolPlan, native_history
from services.gateway.tools import plan as tool_plan
from services.gateway.tools import render as render_tools
from shared import subjects
from shared.adapters import AdapterRecord
from shared.bus import Bus, decode
from shared.errors import TesseraError
from shared.health import NotReady
from shared.messages import (
    ErrorCode,
    Guide,
    ModelRecord,
    NodeStatus,
    SamplingParams,
)
from shared.registry import Registry

log = logging.getLogger(__name__)

INFLIGHT = Gauge("tessera_gateway_inflight_requests", "Requests admitted and not yet finished")
WAITING = Gauge("tessera_gateway_waiting_requests", "Requests waiting in line for admission")
ADMISSION_WAIT = Histogram(
    "tessera_gateway_admission_wait_seconds",
    "Time a request waited in line",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)
REJECTED = Counter("tessera_gateway_rejected_total", "Requests refused", ["code"])


class Gateway:
    def __init__(self, settings: GatewaySettings, bus: Bus, registry: Registry) -> None:
        self.settings = settings
        self.bus = bus
        self.registry = registry
        self.tokenizers = Tokenizers()
        self.inflight = 0
        self._line: collections.deque[asyncio.Future[None]] = collections.deque()
        """Requests waiting for a slot, first come first served."""
        self.node_seen: dict[str, float] = {}
        self.starts = StartWatch()
        """The starts under way, as their engines report them (streams show their progress)."""

    async def start(self) -> None:
        await self.bus.subscribe(subjects.node_heartbeat(), self._on_heartbeat)
        await self.starts.start(self.bus)

    async def _on_heartbeat(self, msg: object) -> None:
        status = decode(msg.data, NodeStatus)  # type: ignore[attr-defined]
        self.node_seen[status.node_id] = time.time()

    def node_alive(self, node_id: str) -> bool:
        seen = self.node_seen.get(node_id)
        return seen is not None and time.time() - seen <= self.settings.node_timeout_s

    async def engines_heard(self) -> bool:
        """Readiness: with no engine's heartbeat heard lately (none is up yet, or this gateway's
        bus is cut off from them) every request would fail, so the gateway is not ready. Read
        from the heartbeats it hears anyway: a probe costs no request to anyone."""
        if not any(self.node_alive(n) for n in self.node_seen):
            raise NotReady(f"no engine node has sent a heartbeat within {self.settings.node_timeout_s:g}s")
        return True

    async def admit(self, wait_s: float) -> None:
        """Count a request in flight; past `max_inflight` it waits in line, first come first
        served, for at most `wait_s` (then, or when the line is full, 429 with Retry-After)."""
        if self.inflight < self.settings.max_inflight and not self._line:
            self.inflight += 1
            INFLIGHT.set(self.inflight)
            return
        if len(self._line) >= self.settings.max_waiting:
            REJECTED.labels(ErrorCode.OVERLOADED.value).inc()
            raise TesseraError(
                ErrorCode.OVERLOADED,
                f"the gateway has {self.settings.max_inflight} requests in flight and "
                f"{len(self._line)} waiting, its limit; retry shortly",
                retry_after_s=1,
            )
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        WAITING.set(len(self._line))
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.shield(turn), wait_s)
        except (TimeoutError, asyncio.CancelledError) as e:
            if turn.done() and not turn.cancelled():
                self.release()  # the slot was handed over just as the wait ended: pass it on
            else:
                turn.cancel()
            if isinstance(e, asyncio.CancelledError):
                raise
            REJECTED.labels(ErrorCode.OVERLOADED.value).inc()
            raise TesseraError(
                ErrorCode.OVERLOADED,
                f"waited {wait_s:g} s in line behind {self.settings.max_inflight} requests in flight; retry shortly",
                retry_after_s=max(1.0, wait_s / 2),
            ) from None
        finally:
            with contextlib.suppress(ValueError):
                self._line.remove(turn)
            WAITING.set(len(self._line))
        ADMISSION_WAIT.observe(time.perf_counter() - t0)

    def release(self) -> None:
        """A request in flight ended: its slot goes to the first in line, else back."""
        while self._line:
            turn = self._line.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot changes hands: `inflight` stays
                WAITING.set(len(self._line))
                return
        self.inflight -= 1
        INFLIGHT.set(self.inflight)

    async def model(self, name: str) -> ModelRecord:
        """The model registered as `name`; for an adapter's name, its base (whose tokenizer it
        shares)."""
        record = await self.registry.get(name)
        if record is None and (adapter := await self.registry.get_adapter(name)) is not None:
            record = await self.registry.get(adapter.base)
        if record is None:
            REJECTED.labels(ErrorCode.MODEL_NOT_FOUND.value).inc()
            raise TesseraError(ErrorCode.MODEL_NOT_FOUND, f"The model `{name}` does not exist.", param="model")
        return record

    async def _render(
        self, record: ModelRecord, tok: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> str:
        """Messages through the model's chat template ("developer" is "system" to it; past tool
        calls and results as the template renders them, or as `tools.render` writes them)."""
        try:
            if self.tokenizers.knows_tools(tok, record.chat_template):
                history = native_history([_message(m) for m in messages])
            else:
                history = render_tools([_message(m) for m in messages])
        except ValueError as e:
            raise TesseraError(ErrorCode.INVALID_REQUEST, str(e), param="messages") from None
        return await self.tokenizers.render_chat(tok, history, add_generation_prompt, record.chat_template)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: the ids a completion or chat request with this input would send."""
        record = await self.model(req.model)
        tok = await self.tokenizers.get(record.artifact)
        text = (
            req.prompt
            if req.messages is None
            else await self._render(record, tok, req.messages, req.add_generation_prompt)
        )
        ids = await self.tokenizers.encode(tok, text or "")
        return TokenizeResponse(count=len(ids), max_model_len=record.artifact.context_length, tokens=list(ids))

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        record = await self.model(req.model)
        tok = await self.tokenizers.get(record.artifact)
        vocab = await self.tokenizers.vocab_size(tok)
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise TesseraError(
                ErrorCode.INVALID_REQUEST,
                f"token id {bad[0]} is outside the vocabulary of `{req.model}` ({vocab} tokens)",
                param="tokens",
            )
        return DetokenizeResponse(prompt=await self.tokenizers.decode(tok, req.tokens))

    async def prepare(self, req: ChatCompletionRequest | CompletionRequest) -> Prepared:
        """The request's (first) prompt, ready to send."""
        return (await self.prepare_all(req))[0]

    async def prepare_all(self, req: ChatCompletionRequest | CompletionRequest) -> list[Prepared]:
        """One `Prepared` per prompt (completions take a list), each to run `candidates()` times,
        for the model that serves it: `req.model`, or of an alias's members (or `req.models`)
        the one the scheduler chooses, sized by the first's tokens."""
        records = await fallbacks.candidates(self.registry, req)
        prepared = await self._prepare_for(req, *records[0])
        if len(records) > 1:
            first = prepared[0]
            timeout = self.settings.request_timeout_s
            chosen = await fallbacks.choose(self.bus, records, first.prompt_tokens, first.params.max_tokens, timeout)
            if chosen is not records[0]:
                prepared = await self._prepare_for(req, *chosen)
        return prepared

    async def _prepare_for(
        self, req: ChatCompletionRequest | CompletionRequest, record: ModelRecord, adapter: AdapterRecord | None
    ) -> list[Prepared]:
        tok = await self.tokenizers.get(record.artifact)
        plan: ToolPlan | None = None
        if isinstance(req, ChatCompletionRequest):
            try:
                plan = tool_plan(
                    [_message(m) for m in req.messages],
                    req.tools,
                    req.tool_choice,
                    req.parallel_tool_calls,
                    native=self.tokenizers.knows_tools(tok, record.chat_template),
                    bare_json=self.tokenizers.bare_json_calls(tok, record.chat_template),
                )
            except ValueError as e:
                raise TesseraError(ErrorCode.INVALID_REQUEST, str(e), param="messages") from None
            prompts = [
                await self.tokenizers.render_chat(
                    tok, plan.messages, chat_template=record.chat_template, tools=plan.template_tools
                )
            ]
            param = "messages"
        else:
            prompts, param = req.prompts(), "prompt"
        guide = self._guide(req, plan)
        logit_bias = req.logit_biases()
        if logit_bias:
            vocab = await self.tokenizers.vocab_size(tok)
            bad = [t for t, _ in logit_bias if t >= vocab]
            if bad:
                raise TesseraError(
                    ErrorCode.INVALID_REQUEST,
                    f"token id {bad[0]} is outside the vocabulary of `{record.name}` ({vocab} tokens)",
                    param="logit_bias",
                )
        logprobs = req.logprob_count()
        if guide is not None and (logit_bias or logprobs > 0):
            # Both need the logits, which only the stateful tier has, and it has no grammar.
            both = (
                "logit_bias"
                if logit_bias
                else ("top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs")
            )
            raise TesseraError(
                ErrorCode.INVALID_REQUEST,
                f"`{both}` cannot be combined with structured output "
                "(response_format, structured_outputs, or tools that must be called)",
                param=both,
            )
        if req.best_of is not None and req.best_of > req.choices() and logprobs < 0:
            logprobs = 0  # best_of ranks candidates by their log-probability
        return [
            dataclasses.replace(
                await self._prepare_one(req, record, tok, prompt, param, guide, logit_bias, logprobs, plan),
                adapter=adapter,
            )
            for prompt in prompts
        ]

    @staticmethod
    def _guide(req: ChatCompletionRequest | CompletionRequest, plan: ToolPlan | None) -> Guide | None:
        try:
            asked = [
                g
                for g in (
                    guides.response_format(req.response_format),
                    guides.structured_outputs(req.structured_outputs, req.guided()),
                )
                if g is not None
            ]
            if plan is not None and plan.json_schema is not None:
                asked.append(guides.json_schema(plan.json_schema, "tools"))
        except guides.GuideError as e:
            raise TesseraError(ErrorCode.INVALID_REQUEST, str(e), param=e.param) from None
        if len(asked) > 1:
            raise TesseraError(
                ErrorCode.INVALID_REQUEST,
                "ask for one structured output: response_format, "
                "structured_outputs or a tool_choice that must call, not several",
                param="response_format",
            )
        return asked[0] if asked else None

    async def _prepare_one(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        record: ModelRecord,
        tok: Any,
        prompt: str,
        param: str,
        guide: Guide | None,
        logit_bias: tuple[tuple[int, float], ...],
        logprobs: int,
        plan: ToolPlan | None,
    ) -> Prepared:
        ids = await self.tokenizers.encode(tok, prompt)
        n = len(ids)
        if n == 0:
            raise TesseraError(ErrorCode.INVALID_REQUEST, f"the {param} is empty", param=param)
        ctx = record.artifact.context_length
        defaults = record.defaults
        max_tokens = req.max_tokens if req.max_tokens is not None else min(defaults.max_tokens, ctx - n)
        if n + max_tokens > ctx or max_tokens < 1:
            raise TesseraError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{n + max(max_tokens, 1)} tokens ({n} in the {param}, {max(max_tokens, 1)} for the "
                "completion). Please reduce the length of the messages or completion.",
                param=param,
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            repetition_penalty=(
                defaults.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty
            ),
            seed=None if req.seed is None else req.seed % 2**64,  # numpy takes no negative seed
            stop=req.stops(),
            ignore_eos=req.ignore_eos,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            top_k=max(req.top_k or 0, 0),
            min_p=req.min_p or 0.0,
            guide=guide,
            logprobs=logprobs,
            logit_bias=logit_bias,
        )
        return Prepared(record=record, prompt=prompt, prompt_ids=ids, params=params, tools=plan)

    async def open(
        self, prepared: Prepared, max_wait_s: float | None = None, placing: Placing | None = None
    ) -> Generation:
        gen = Generation(self, prepared, max_wait_s, placing)
        try:
            await gen.open()
        except BaseException:
            await gen.close()
            raise
        return gen


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as `tools.plan` takes it: role, text, and a past turn's calls or call id."""
    extra = m.model_extra or {}
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    for key in ("tool_calls", "tool_call_id", "name"):
        if extra.get(key) is not None:
            out[key] = extra[key]
    return out
