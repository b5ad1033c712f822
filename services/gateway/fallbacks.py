"""Warm fallbacks at the gateway (issue 35): the models a request may be served by, an alias's
members or the request's own `models` (as OpenRouter takes it: `model` first, then those), and
the scheduler's choice among them (`policy.fallbacks`: the first warm one within its SLOs, else
the first). The answer's `model` is the member that served it. A LoRA adapter's name (issue 34)
is served on its base: its candidate is the base's record with the adapter's SLOs, and the
adapter."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import msgspec

from shared import subjects
from shared.adapters import AdapterRecord
from shared.bus import Bus
from shared.errors import TesseraError
from shared.messages import ErrorCode, ModelRecord, Rejected
from shared.registry import Registry
from shared.routing_messages import MAX_FALLBACKS, ChooseModel, ModelChosen


class Routed(Protocol):
    """What a completion request names: `model`, and `models` to fall back on."""

    @property
    def model(self) -> str: ...
    @property
    def models(self) -> list[str] | None: ...


class Candidate(NamedTuple):
    """A model that may serve a request: `record` is what is placed and run (an adapter's
    base), `adapter` what is applied on it."""

    record: ModelRecord
    adapter: AdapterRecord | None = None

    @property
    def name(self) -> str:
        """What the caller asked for, and what the answer, usage and metrics name."""
        return self.adapter.name if self.adapter is not None else self.record.name


def on_base(base: ModelRecord, adapter: AdapterRecord) -> Candidate:
    """An adapter's candidate: its base, judged by the adapter's own SLOs."""
    slos = {
        "ttft_slo_s": adapter.ttft_slo_s,
        "tpot_slo_s": adapter.tpot_slo_s,
        "ttft_slo_per_token_s": adapter.ttft_slo_per_token_s,
    }
    return Candidate(msgspec.structs.replace(base, **slos), adapter)


async def candidates(registry: Registry, req: Routed) -> list[Candidate]:
    """The models that may serve `req`, in order; one for a plain model."""
    listed = req.models or []
    alias = await registry.alias(req.model)
    if alias is not None:
        if listed:
            raise TesseraError(
                ErrorCode.INVALID_REQUEST,
                f"`{req.model}` is an alias with fallbacks of its own: give `models` with a model, or the alias alone",
                param="models",
            )
        names = list(alias.members)
    else:
        names = list(dict.fromkeys([req.model, *listed]))
        if len(names) > MAX_FALLBACKS:
            raise TesseraError(
                ErrorCode.INVALID_REQUEST, f"at most {MAX_FALLBACKS} models to fall back on", param="models"
            )
    records = []
    for i, name in enumerate(names):
        record = await registry.get(name)
        if record is None and (adapter := await registry.get_adapter(name)) is not None:
            base = await registry.get(adapter.base)
            if base is not None:  # else removed meanwhile: not found, as the adapter went with it
                records.append(on_base(base, adapter))
                continue
        if record is None:
            param = "model" if i == 0 and alias is None else "models"
            if alias is None and i > 0 and await registry.alias(name) is not None:
                raise TesseraError(
                    ErrorCode.INVALID_REQUEST, f"`{name}` is an alias: `models` lists models", param=param
                )
            raise TesseraError(ErrorCode.MODEL_NOT_FOUND, f"The model `{name}` does not exist.", param=param)
        records.append(Candidate(record))
    return records


async def choose(
    bus: Bus, records: list[Candidate], prompt_tokens: int, max_tokens: int, timeout_s: float
) -> Candidate:
    """The scheduler's choice among `records` for a request of this size (by their bases: an
    adapter runs where its base does)."""
    chosen = await bus.request(
        subjects.choose_model(),
        ChooseModel(models=tuple(r.record.name for r in records), prompt_tokens=prompt_tokens, max_tokens=max_tokens),
        ModelChosen | Rejected,
        timeout=timeout_s,
    )
    if isinstance(chosen, Rejected):
        raise TesseraError(chosen.code, chosen.message, retry_after_s=chosen.retry_after_s)
    return next((r for r in records if r.record.name == chosen.model), records[0])
