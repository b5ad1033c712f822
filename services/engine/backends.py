"""The engines a node may run (`TESSERA_ENGINE_BACKEND`), each an object that says what it is
(ServerlessLLM's backends). A worker's entry point is named, not imported: the engine never
imports a backend it does not run (nor its libraries)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from services.engine.core import CORE_MAX_SEQS
from shared.artifact import has_tier
from shared.messages import Artifact, Tier

if TYPE_CHECKING:
    from cuda_ext.memory import ArenaHandle
    from services.engine.node_arena import NodeArena
    from services.engine.step_gate import StepGate


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of a node is started with; each backend takes the part it uses."""

    device: str
    threads: int
    prefault_bytes: int = 0
    max_batch: int = 1
    join_recompute_tokens: int = 0
    gate: StepGate | None = None
    arena_bytes: int = 0
    """Without the node's arena: the size of a torch worker's own."""
    kv_tokens: int = 8192
    arena: NodeArena | None = None

    @property
    def tensor_arena(self) -> ArenaHandle | int:
        """What a worker maps: the node's arena, else the size of one of its own."""
        return self.arena.handle if self.arena else self.arena_bytes


@dataclass(frozen=True)
class Backend:
    name: str
    entry: str
    """Its worker's entry function, `module:function`, called in the spawned process."""
    process_name: str
    args: Callable[[WorkerSpec, Connection, int], tuple[object, ...]]
    """The entry's arguments from the spec, the worker's end of its pipe and its gate slot."""
    env: Callable[[WorkerSpec], dict[str, str]] = lambda spec: {}
    """Environment the process is spawned with."""
    reads_torch_checkpoint: bool = False
    """Its workers read the torch checkpoint (written from the GGUF by the loader), not IR/blobs."""
    start_tier: bool = False
    """It may start a model on its START tier and tier up to STEADY once idle."""
    tensor_arena: bool = False
    """Its workers hold weights in a tensor arena by content hash: an idle one's tensors are
    reused by a start of a model sharing them (Tangram §3.1)."""
    pipeline_stages: bool = False
    """It can run a layer range as a pipeline stage, and serve a model through stages (FaaScale §4.3)."""
    lazy_host_kv: bool = False
    """On the host, its KV cache's pages are committed as blocks fill (how much of it the RSS
    holds is unknown: the footprint true-up takes none off)."""
    batch_limit: int | None = None
    """Most requests its engine steps at once; None: the node's `max_batch` setting."""
    kv_on_demand: bool = False
    """Its KV cache grows as rows fill and a resize copies nothing: a start books no L_min
    floor ahead (`policy.kv_watermark.floor_tokens`)."""

    def start_tier_of(self, artifact: Artifact, device: str, enabled: bool) -> Tier:
        """TORCH for a backend reading the torch checkpoint; START when it has a start tier,
        `enabled` and compiled for the artifact; else STEADY."""
        if self.reads_torch_checkpoint:
            return Tier.TORCH
        if self.start_tier and enabled and has_tier(artifact, device, Tier.START):
            return Tier.START
        return Tier.STEADY


def _openvino_env(spec: WorkerSpec) -> dict[str, str]:
    from services.engine.cpu_share import MALLOC_ENV

    return MALLOC_ENV if spec.prefault_bytes > 0 else {}


OPENVINO = Backend(
    "openvino",
    start_tier=True,
    # The core (`core.py`) serves every instance once built; the start tier lasts seconds.
    batch_limit=CORE_MAX_SEQS,
    kv_on_demand=True,  # the core's cache is the library's dynamic allocation (`core.build_pipeline`)
    entry="services.engine.worker_process:serve",
    process_name="tessera-worker",
    args=lambda s, c, i: (c, s.device, s.threads, s.prefault_bytes, s.max_batch, s.join_recompute_tokens, s.gate, i),
    env=_openvino_env,
)
TORCH = Backend(
    "torch",
    reads_torch_checkpoint=True,
    tensor_arena=True,
    pipeline_stages=True,
    lazy_host_kv=True,
    entry="services.engine.torch_engine.process:worker_main",
    process_name="tessera-torch-worker",
    args=lambda s, c, i: (c, s.threads, s.tensor_arena, s.gate, i, s.max_batch, s.kv_tokens),
)
VLLM = Backend(
    "vllm",
    reads_torch_checkpoint=True,
    entry="services.engine.vllm_engine.process:worker_main",
    process_name="tessera-vllm-worker",
    args=lambda s, c, i: (c, s.threads, s.gate, i, s.max_batch, s.kv_tokens),
)
BACKENDS = {b.name: b for b in (OPENVINO, TORCH, VLLM)}
