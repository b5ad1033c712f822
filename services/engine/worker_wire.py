"""What the engine and its worker processes say to each other over a `multiprocessing` pipe:
small dataclasses that never leave the node (so they are not bus messages). The engine's side
is `worker_pool.py`, the worker's `worker_loop.py`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cuda_ext.ledger import Placement
from cuda_ext.progress import FillSignal
from shared.artifact import TORCH_MANIFEST, torch_checkpoint
from shared.messages import Artifact, FinishReason, SamplingParams, Tier, TokenLogprob

NO_SLO_S = 3600.0
"""A request of a model without SLOs is due this long after it arrived (last in line)."""


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Load:
    artifact: Artifact
    cores: tuple[int, ...] | None
    """CPU cores the load and the first forward pass may use (a bounded share); None: all."""
    cache_dir: str | None = None
    """Where the verified form is (the compiled blob, or the torch checkpoint's directory) in
    the loader's host cache; the store's when None."""
    tier: Tier = Tier.STEADY
    stages: tuple[str, ...] = ()
    """A torch worker: serve the model through these pipeline stages (host:port, in layer
    order) rather than hold it (FaaScale §4.3; `cache_dir` may hold only part of it)."""
    stage: StageSpec | None = None
    """A torch worker: run this layer range as a stage server, not a model (`Loaded.addr`)."""
    placement: Placement | None = None
    """A torch worker on a node with one arena: where the node's book put the model's tensors
    (which of them to copy, the rest resident already)."""
    fill: FillSignal | None = None
    """With `placement`: where to follow the engine's copy of its `filled` tensors, which may
    still be streaming in when the first request runs."""

    @property
    def checkpoint(self) -> Path:
        """The torch checkpoint it reads: the loader's host-cache copy where it staged one,
        else the store's."""
        return Path(self.cache_dir) if self.cache_dir else torch_checkpoint(self.artifact)

    def torch_checkpoint(self) -> Path:
        """`checkpoint`, refused (FileNotFoundError) where the loader has not written it."""
        if not (self.checkpoint / TORCH_MANIFEST).is_file():
            raise FileNotFoundError(
                f"{self.artifact.artifact_id} has no torch checkpoint in {self.checkpoint}: the node's loader "
                "writes it before a model's first start here (its log says why it did not)"
            )
        return self.checkpoint


@dataclass(frozen=True)
class StageSpec:
    lo: int
    hi: int
    layers: int
    head: bool
    host: str
    """The address the stage's server binds (one other nodes reach)."""


@dataclass(frozen=True)
class Loaded:
    loaded_from_cache: bool
    load_s: float
    threads: int = 0
    """The threads the runtime was given for the load and the start tier (a share of the
    node's cores beside busy instances: `Load.cores`), as the compiled model reports them."""
    reused_bytes: int = 0
    """Weights the load found resident in the worker's tensor arena, by content hash, and did
    not read (a torch worker; Tangram §3.1's S')."""
    resident: tuple[str, ...] = ()
    """Content hashes of every tensor in the worker's arena after the load (a torch worker
    with an arena of its own; empty on the node's arena, whose book the engine keeps): what a
    later start of another model on this worker would not read."""
    addr: str = ""
    """A stage's server (`Load.stage`): host:port."""


@dataclass(frozen=True)
class TieredUp:
    """The worker now serves the STEADY tier (or, with `error`, stays on START)."""

    tier: Tier
    load_s: float
    error: str = ""


@dataclass(frozen=True)
class Run:
    """A request for the worker's queue: it runs in the next batch formed (`batch.py`)."""

    request_id: str
    session: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream_interval_s: float
    kv_tokens: int = 0
    """Tokens its name's KV reservation covered when it was sent (LLM-Mesh eq. 2, grown for
    it): a batch may hold that many, or one context, whichever is more."""
    received_at: float = 0.0
    """time.monotonic() the engine received it: ST of its headroom (eq. 1)."""
    ttft_slo_s: float = 0.0
    tpot_slo_s: float = 0.0
    """Its model's SLOs (0: none), for the node's headroom gate (`step_gate.py`)."""

    def deadline(self, generated: int) -> float:
        """When its next token is due: headroom (eq. 1) + now."""
        if self.ttft_slo_s <= 0:
            return self.received_at + NO_SLO_S
        return self.received_at + self.ttft_slo_s + self.tpot_slo_s * generated


@dataclass(frozen=True)
class Chunk:
    """New text of one request, and how many tokens it took."""

    request_id: str
    text: str
    tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token, when the request asked for them."""


@dataclass(frozen=True)
class Chunks:
    """Every core request's new text after a step, in one message (one pickle and one wake-up
    of the engine's reader for a crowd, not one per request)."""

    items: tuple[Chunk, ...]


@dataclass(frozen=True)
class Done:
    request_id: str
    finish_reason: FinishReason
    completion_tokens: int
    first_token_at: float | None
    """time.monotonic() of the first text (CLOCK_MONOTONIC: comparable across processes)."""
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    """Start of the run to its first token: the prefill, measured where it ran."""
    decode_s: float = 0.0
    """First token to the end of the run: (completion_tokens - 1) decode iterations."""
    batch: int = 1
    """Sequences in the batch it ran in (its decode iterations were for that many)."""
    prefill_tokens: int = 0
    """Positions the prefill it ran in computed (rows × the longest context padded to)."""
    gated_s: float = 0.0
    """Time its iterations waited for the node's headroom gate (not in prefill_s, decode_s:
    those are the iterations' own, what the performance model needs)."""
    beside_build: bool = False
    """It ran while the worker built its core (≈ 2.4 s of CPU on the same cores): its times
    are no measure of the model."""
    kv_allocated_bytes: int = 0
    """The core's KV cache when it ended (the library's allocation; 0 on the stateful tier)."""
    device_bytes: int = 0
    """What the worker holds on its GPU outside the node's arena (torch's caching allocator:
    its KV cache among it) when it ended; 0 on the host."""


@dataclass(frozen=True)
class Started:
    """The request left the worker's queue: its batch begins."""

    request_id: str
    batch: int


@dataclass(frozen=True)
class TierUpNow:
    """Build the continuous-batching core in the background and move to it between steps, if
    the worker has none yet (the engine sends it when the whole node is idle, so that the
    build slows nobody)."""


@dataclass(frozen=True)
class CancelRun:
    """Stop this request: queued, it ends at once; running, after its current token."""

    request_id: str


@dataclass(frozen=True)
class DropSession:
    session: str


@dataclass(frozen=True)
class Failure:
    request_id: str | None
    message: str
