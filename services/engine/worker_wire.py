"""What the engine (`worker_pool.py`) and its workers (`worker_loop.py`) say over a pipe: they
never leave the node, so they are not bus messages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cuda_ext.ledger import Placement
from cuda_ext.progress import FillSignal
from services.engine.batch_types import AdapterLoad
from shared.artifact import TORCH_MANIFEST, torch_checkpoint
from shared.messages import AdapterRef, Artifact, FinishReason, SamplingParams, Tier, TokenLogprob

NO_SLO_S = 3600.0
"""A request of a model without SLOs is due this long after it arrived (last in line)."""


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Load:
    artifact: Artifact
    cores: tuple[int, ...] | None
    """CPU cores the load and the first passes may use (a bounded share); None: all."""
    cache_dir: str | None = None
    """The verified form in the loader's host cache; None: the store's."""
    tier: Tier = Tier.STEADY
    stages: tuple[str, ...] = ()
    """Torch: serve the model through these stages (host:port, in layer order), FaaScale §4.3."""
    stage: StageSpec | None = None
    """Torch: run this layer range as a stage server (`Loaded.addr`)."""
    placement: Placement | None = None
    """Torch on a node's one arena: where the node's book put the model's tensors."""
    fill: FillSignal | None = None
    """With `placement`: the engine's copy of the tensors, maybe still streaming in."""

    @property
    def checkpoint(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else torch_checkpoint(self.artifact)

    def torch_checkpoint(self) -> Path:
        """`checkpoint`, refused where the loader has not written it."""
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
    """The address the stage's server binds (other nodes reach it)."""


@dataclass(frozen=True)
class Loaded:
    loaded_from_cache: bool
    load_s: float
    threads: int = 0
    """The threads the load and the start tier ran on (`Load.cores`), as the runtime reports."""
    reused_bytes: int = 0
    """Torch: weights found resident in the worker's arena and not read (Tangram §3.1's S')."""
    resident: tuple[str, ...] = ()
    """Torch with an arena of its own: content hashes of every tensor in it after the load."""
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
    request_id: str
    session: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream_interval_s: float
    kv_tokens: int = 0
    """Tokens its name's KV reservation covered (LLM-Mesh eq. 2, grown for it)."""
    received_at: float = 0.0
    """time.monotonic() the engine received it: ST of its headroom (eq. 1)."""
    ttft_slo_s: float = 0.0
    tpot_slo_s: float = 0.0
    adapter: AdapterRef | None = None
    """The LoRA adapter it runs with (issue 34): the batch applies it (`AdaptedBatch`)."""

    def deadline(self, generated: int) -> float:
        """When its next token is due (eq. 1's headroom + now), for the node's gate."""
        if self.ttft_slo_s <= 0:
            return self.received_at + NO_SLO_S
        return self.received_at + self.ttft_slo_s + self.tpot_slo_s * generated


@dataclass(frozen=True)
class Chunk:
    request_id: str
    text: str
    tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Chunks:
    """Every request's new text after a step: one pickle and one wake-up for a crowd."""

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
    decode_s: float = 0.0
    """prefill_s, decode_s: net of `gated_s`, the iterations' own (the performance model's)."""
    batch: int = 1
    """The most sequences it ran beside."""
    prefill_tokens: int = 0
    """Positions its prefill computed (rows × the longest context padded to)."""
    gated_s: float = 0.0
    beside_build: bool = False
    """It ran while the worker built its core: its times are no measure of the model."""
    kv_allocated_bytes: int = 0
    """The batch's KV cache when it ended (0 on the stateful tier)."""
    device_bytes: int = 0
    """What the worker holds on its GPU outside the node's arena when it ended."""
    adapter_load: AdapterLoad | None = None
    """Its adapter was loaded for it (not found loaded in the worker): that start's phases."""


@dataclass(frozen=True)
class Started:
    request_id: str
    batch: int


@dataclass(frozen=True)
class TierUpNow:
    """The node is idle: build the core now (it slows nobody) and move to it."""


@dataclass(frozen=True)
class CancelRun:
    request_id: str


@dataclass(frozen=True)
class DropSession:
    session: str


@dataclass(frozen=True)
class DropAdapter:
    """The adapter's keep-alive passed: the worker lets it go (its base stays)."""

    name: str


@dataclass(frozen=True)
class Failure:
    request_id: str | None
    message: str
