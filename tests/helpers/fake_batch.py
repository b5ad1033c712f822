"""Fakes of an engine for the worker loop's tests (`services/engine/worker_loop.py`): no model,
a toy byte-level vocabulary. `FakeBatch` is a `Batch` that gives every request the tokens of
a script, one per look, then its end of sequence (or, for the loop's own tests, hand-made
steps); `FakeBinding` binds it."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from services.engine.batch_types import Step, check_fits
from services.engine.worker_loop import Bound
from services.engine.worker_wire import Load, Loaded, TieredUp
from shared.messages import FinishReason, SamplingParams, Tier

EOS = 0
# Token i decodes to these bytes; "é" is split over tokens 5 and 6.
VOCAB = {
    EOS: b"",
    1: b"one",
    2: b" two",
    3: b" three",
    4: b" four",
    5: b" \xc3",
    6: b"\xa9",
    7: b"!",
    8: b" fi",
    9: b"ve",
}
SCRIPT = (1, 2, 3, 4, 5, 6, 7, 8, 9)
"""What every request of a `FakeBatch` generates: "one two three four é! five"."""


def decode(ids: Sequence[int]) -> str:
    """The fake library's own detokenization (its end of sequence is a special token: no text)."""
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def decode_many(seqs: Sequence[Sequence[int]]) -> list[str]:
    return [decode(s) for s in seqs]


class FakeBatch:
    """A stand-in `Batch`: each look (`steps`) gives every request the next token of `script`
    (up to max_tokens: "length"), then its end of sequence ("stop", not a token of its own). A
    request longer than `kv_tokens` is refused alone, as the real batches refuse it. `hand`:
    steps to return verbatim instead, one list a look (the loop's tests script them)."""

    def __init__(self, script: Sequence[int] = SCRIPT, kv_tokens: int = 64) -> None:
        self.script = tuple(script)
        self.kv_tokens = kv_tokens
        self.requests: dict[str, tuple[SamplingParams, int]] = {}
        self.added: list[str] = []
        self.cancelled: list[str] = []
        self.hand: deque[list[Step]] = deque()
        self.fail: set[str] = set()
        """Requests whose next look fails them (alone)."""
        self.broken: Exception | None = None
        """`steps` raises it (the whole batch failed)."""
        self.alive = True
        self.closed = False
        self.waited = 0.0
        self.threads = 0
        self.kv_bytes = 4096

    @property
    def active(self) -> int:
        return len(self.requests)

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def device_bytes(self) -> int:
        return 1 << 20

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float] = lambda _: math.inf,
        kv_tokens: int = 0,
    ) -> None:
        check_fits(len(prompt_ids), params.max_tokens, self.kv_tokens)
        self.requests[request_id] = (params, 0)
        self.added.append(request_id)

    def cancel(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.cancelled.append(request_id)

    def steps(self, timeout: float) -> list[Step]:
        if self.broken is not None:
            raise self.broken
        if self.hand:
            return self.hand.popleft()
        out = []
        for rid, (params, made) in list(self.requests.items()):
            if rid in self.fail:
                del self.requests[rid]
                out.append(Step(rid, (), None, "RuntimeError: boom"))
            elif made == len(self.script) and not params.ignore_eos:
                del self.requests[rid]
                out.append(Step(rid, (), FinishReason.STOP))
            else:
                token = self.script[made % len(self.script)]
                made += 1
                self.requests[rid] = (params, made)
                finish = FinishReason.LENGTH if made == params.max_tokens else None
                if finish is not None:
                    del self.requests[rid]
                out.append(Step(rid, ((token, None),), finish))
        return out

    def close(self) -> None:
        self.closed = True
        self.requests.clear()


class FakeBinding:
    """Binds `FakeBatch`es (`make`) for the loop and records what the loop asked of it."""

    wake_s: float | None = None
    build_window = (math.inf, math.inf)

    def __init__(self, make: Callable[[], FakeBatch] = FakeBatch) -> None:
        self.make = make
        self.batches: list[FakeBatch] = []
        self.loads: list[tuple[Load, int]] = []
        self.released = 0
        self.refuse: Exception | None = None
        """`load_beside` raises it (a load refused with the model still bound)."""
        self.built: TieredUp | None = None
        """A tier-up finished in the background, for `tiered`."""
        self.dropped: list[str] = []
        self.closed = False

    @property
    def batch(self) -> FakeBatch:
        return self.batches[-1]

    def load_beside(self, load: Load) -> Loaded | None:
        if self.refuse is not None:
            raise self.refuse
        return None

    def load(self, load: Load, threads: int) -> Bound:
        self.loads.append((load, threads))
        return Bound(Loaded(loaded_from_cache=True, load_s=0.0, threads=threads), self.reopen(threads), decode_many)

    def reopen(self, threads: int) -> FakeBatch:
        batch = self.make()
        batch.set_threads(threads)
        self.batches.append(batch)
        return batch

    def release(self) -> None:
        self.released += 1

    def tier_up(self) -> TieredUp | None:
        return TieredUp(Tier.TORCH, 0.0, "")

    def tiered(self) -> TieredUp | None:
        built, self.built = self.built, None
        return built

    def drop_session(self, session: str) -> None:
        self.dropped.append(session)

    def close(self) -> None:
        self.closed = True
