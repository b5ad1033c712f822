"""Every NATS subject, built here and nowhere else.

The schema version is the second token so that two incompatible deployments on one bus never
decode each other's messages.
"""

from __future__ import annotations

from shared.messages import SCHEMA_VERSION

_ROOT = f"tessera.v{SCHEMA_VERSION}"

SCHEDULER_QUEUE = "scheduler"
LOADER_QUEUE = "loader"


def place() -> str:
    """Gateway → scheduler: where should this request run (request/reply)."""
    return f"{_ROOT}.scheduler.place"


def choose_model() -> str:
    """Gateway → scheduler: which of an alias's members serves this request (`ChooseModel` →
    `ModelChosen`, request/reply)."""
    return f"{_ROOT}.scheduler.choose"


def relocatable() -> str:
    """Engine → scheduler: which of these instances' requests validate on another node
    (request/reply)."""
    return f"{_ROOT}.scheduler.relocatable"


def scale_out() -> str:
    """Gateway → scheduler: start a model on more nodes at once (request/reply)."""
    return f"{_ROOT}.scheduler.scale"


def cluster_status() -> str:
    """Anyone → scheduler: the scheduler's view of nodes and instances (request/reply)."""
    return f"{_ROOT}.scheduler.status"


def import_model() -> str:
    """Gateway → any loader: import a GGUF into the model store (request/reply)."""
    return f"{_ROOT}.loader.import"


def import_adapter() -> str:
    """Gateway → any loader: check a LoRA adapter against its base and keep it in the store
    (`shared.adapters.ImportAdapter`, request/reply)."""
    return f"{_ROOT}.loader.adapter"


def engine_start(node_id: str) -> str:
    return f"{_ROOT}.engine.{node_id}.start"


def engine_stop(node_id: str) -> str:
    return f"{_ROOT}.engine.{node_id}.stop"


def engine_preempt(node_id: str) -> str:
    """Scheduler → engine: preempt an instance (`PreemptInstance`, request/reply)."""
    return f"{_ROOT}.engine.{node_id}.preempt"


def engine_generate(node_id: str) -> str:
    return f"{_ROOT}.engine.{node_id}.generate"


def engine_evict(node_id: str) -> str:
    return f"{_ROOT}.engine.{node_id}.evict"


def engine_cancel(node_id: str) -> str:
    return f"{_ROOT}.engine.{node_id}.cancel"


def engine_stage(node_id: str) -> str:
    """Scheduler → engine: run a layer range of a model whose blocks are arriving, for an
    execution pipeline (`StartStage` → `StageReady`, request/reply; FaaScale §4.3)."""
    return f"{_ROOT}.engine.{node_id}.stage"


def engine_pipelined(node_id: str) -> str:
    """Scheduler → engine: serve a model through the stages of an execution pipeline until
    its own replica is whole (`StartPipelined` → `InstanceReady`, request/reply)."""
    return f"{_ROOT}.engine.{node_id}.pipelined"


def engine_end_stage(node_id: str) -> str:
    """→ engine: the pipeline a stage served has retired (`EndStage`, published)."""
    return f"{_ROOT}.engine.{node_id}.endstage"


def token_stream(request_id: str) -> str:
    """Engine → gateway: the chunks of one request, ending in `Finished` or `Failed`."""
    return f"{_ROOT}.stream.{request_id}"


def node_heartbeat() -> str:
    return f"{_ROOT}.node.heartbeat"


def cold_start_recorded() -> str:
    return f"{_ROOT}.events.coldstart"


def start_progress() -> str:
    """Engine → gateways: a cold start's phase and bytes loaded (`StartProgress`, published;
    every gateway hears every start: the streams waiting on it are relayed its progress)."""
    return f"{_ROOT}.events.startprogress"


def loader_import(node_id: str) -> str:
    """Engine → its node's loader: import a registered model for this node's engine, writing
    what the loader that registered it did not (a torch checkpoint, where that loader's node
    runs OpenVINO) (request/reply)."""
    return f"{_ROOT}.loader.{node_id}.import"


def loader_stage(node_id: str) -> str:
    return f"{_ROOT}.loader.{node_id}.stage"


def loader_stage_adapter(node_id: str) -> str:
    """Engine → its node's loader: an adapter's host-cache copy (`StageAdapter`, request/reply)."""
    return f"{_ROOT}.loader.{node_id}.stageadapter"


def loader_verify(node_id: str) -> str:
    return f"{_ROOT}.loader.{node_id}.verify"


def loader_cache(node_id: str) -> str:
    return f"{_ROOT}.loader.{node_id}.cache"


def loader_evict(node_id: str) -> str:
    return f"{_ROOT}.loader.{node_id}.evict"


def loader_multicast(node_id: str) -> str:
    """→ a loader: receive an artifact's blocks by a multicast plan (`Multicast`, request/reply)."""
    return f"{_ROOT}.loader.{node_id}.multicast"


def loader_layout(node_id: str) -> str:
    """→ a loader: which blocks of an artifact's torch checkpoint each layer needs
    (`LayoutQuery` → `StageLayout`, request/reply)."""
    return f"{_ROOT}.loader.{node_id}.layout"


def loader_await_blocks(node_id: str) -> str:
    """Engine → its loader: answer once these blocks of an artifact are here (`AwaitBlocks` →
    `BlocksHeld`, request/reply): a stage starts before the multicast ends."""
    return f"{_ROOT}.loader.{node_id}.awaitblocks"


def memory_reserve(node_id: str) -> str:
    return f"{_ROOT}.memory.{node_id}.reserve"


def memory_done(node_id: str) -> str:
    return f"{_ROOT}.memory.{node_id}.done"


def memory_release(node_id: str) -> str:
    return f"{_ROOT}.memory.{node_id}.release"
