"""The torch engine's core for one model: start on the arena, generate token by token.

A start reads the checkpoint's manifest, asks the arena for the tensors by digest and reads from
the safetensors file only those it lacks (a model scaled to zero, or a fine-tune of a resident
base, reads little or nothing: Tangram §3.1), binds them into a meta-device skeleton
(`binding`), and is ready. It generates with transformers' model code with its KV cache, one
sequence at a time, sampled by the engine's own `Sampler` (the start tier's: the same seed
gives the same sample on either engine).
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from cuda_ext import Loaded, TensorArena, TensorSpec
from cuda_ext.ledger import Placement
from cuda_ext.progress import FillSignal, FillWaiter
from services.engine.batch_types import ends_of_sequence
from services.engine.sampling import Sampler, token_logprob
from services.engine.torch_engine.binding import BoundModel, bind, skeleton, units_in_order
from shared.artifact import TORCH_MANIFEST, TORCH_WEIGHTS
from shared.messages import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    """"stop" (an end-of-sequence token, not included) or "length"."""


def read_manifest(checkpoint: Path) -> list[TensorSpec]:
    manifest = json.loads((checkpoint / TORCH_MANIFEST).read_text())
    return [
        TensorSpec(t["name"], t["digest"], getattr(torch, t["dtype"]), tuple(t["shape"])) for t in manifest["tensors"]
    ]


class TorchEngine:
    def __init__(self, bound: BoundModel, tokenizer: Any, arena: TensorArena, read_bytes: int) -> None:
        self.bound = bound
        self.model = bound.model
        self.tokenizer = tokenizer
        self.arena = arena
        self.read_bytes = read_bytes
        """Bytes this start read from the checkpoint file (0 when the arena held everything)."""
        self.device = arena.device
        self.eos_ids = ends_of_sequence(tokenizer, self.model.config.eos_token_id)
        self.fill: FillWaiter | None = None
        """Where its forward pass waits for tensors another process still copies (a start
        admitted before its copy ended); None when they were all in at bind."""

    @property
    def loaded(self) -> Loaded:
        return self.bound.loaded

    @classmethod
    def start(
        cls, checkpoint: Path, arena: TensorArena, placement: Placement | None = None, fill: FillSignal | None = None
    ) -> TorchEngine:
        """Bind the checkpoint's model to `arena`: where `placement` (the node arena's book)
        puts it, reading from the file only what it says to copy; else where the arena's own
        book does, reading only what it does not hold. `fill`: the engine is still copying
        the tensors `placement` says it filled; each unit of the forward pass waits for its
        own (TIDAL §5)."""
        specs = read_manifest(checkpoint)
        if placement is not None:
            resident = {s.name for s in specs if s.digest not in placement.copy}
        else:
            resident = {s.name for s in specs if arena.resident(s.digest) is not None}
        with safe_open(str(checkpoint / TORCH_WEIGHTS), framework="pt") as f:
            source = {s.name: f.get_tensor(s.name) for s in specs if s.name not in resident}
        units = units_in_order([s.name for s in specs])
        by_name = {s.name: s for s in specs}
        loaded = arena.load([[by_name[n] for n in names] for _, names in units], source, placement)
        config = AutoConfig.from_pretrained(checkpoint)
        waiter = None
        if fill is not None:
            waiter = FillWaiter(fill, [[by_name[n].digest for n in names] for _, names in units])
        bound = bind(
            skeleton(config, specs[0].dtype),
            loaded,
            arena.device,
            [u for u, _ in units],
            waiter.wait if waiter is not None else None,
        )
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        if arena.ledger is None:
            # Another worker may bind these tensors as soon as the engine hears of this load:
            # they must be in by then (the copies overlapped the binding and the tokenizer).
            loaded.synchronize()
        engine = cls(bound, tokenizer, arena, sum(t.numel() * t.element_size() for t in source.values()))
        engine.fill = waiter
        return engine

    def close(self) -> None:
        """Scale to zero: the weights stay resident in the arena until it evicts them."""
        self.bound.stop_waiting()
        self.arena.release(self.bound.loaded)

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        out = [token for token, _ in self.steps(prompt_ids, params)]
        finish = "length" if len(out) == params.max_tokens else "stop"
        return Completion(out, self.tokenizer.decode(out, skip_special_tokens=True), finish)

    def steps(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generator[tuple[int, TokenLogprob | None]]:
        """The completion one token at a time, each with its logprob where the request asked
        for them (`params.logprobs` >= 0). It ends after `max_tokens` tokens ("length") or
        before an end-of-sequence token, which it does not yield ("stop"); a caller that stops
        reading (a cancel) stops the computation with it. Each `next()` is one forward pass."""
        sampler = Sampler.of(params)
        context = list(prompt_ids)
        generated = 0
        with torch.inference_mode():
            step = self.model(input_ids=torch.tensor([context], device=self.device), use_cache=True)
            self.bound.stop_waiting()  # every layer has been waited for once
            while generated < params.max_tokens:
                logits = step.logits[0, -1].float().cpu().numpy()
                token = sampler.pick(logits, context)
                if token in self.eos_ids and not params.ignore_eos:
                    return
                generated += 1
                context.append(token)
                logprob = None
                if params.logprobs >= 0 and sampler.adjusted is not None:
                    logprob = token_logprob(sampler.adjusted, token, params.logprobs)
                yield token, logprob
                if generated == params.max_tokens:
                    return
                step = self.model(
                    input_ids=torch.tensor([[token]], device=self.device),
                    past_key_values=step.past_key_values,
                    use_cache=True,
                )
