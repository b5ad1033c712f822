"""Every message that crosses the bus, defined once.

Messages are frozen msgspec structs, tagged with their class name and encoded as msgpack.
`SCHEMA_VERSION` is carried in every subject (see `shared.subjects`); bump it on any change
that an older peer could not decode. Names say what they are: commands (`StartInstance`) and
facts (`InstanceReady`).
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

SCHEMA_VERSION = 1


class Message(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Base of every bus message; the tag is the class name."""


class ErrorCode(StrEnum):
    """Why something failed; the gateway maps each to an HTTP status (`shared.errors`)."""

    MODEL_NOT_FOUND = "model_not_found"
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    OVERLOADED = "overloaded"
    NO_CAPACITY = "no_capacity"
    UNAVAILABLE = "unavailable"
    ENGINE_FAILED = "engine_failed"
    INSTANCE_NOT_LOADED = "instance_not_loaded"
    IMPORT_FAILED = "import_failed"
    TIMEOUT = "timeout"
    PREEMPTED = "preempted"
    """Its instance was preempted to let a bigger one grow (LLM-Mesh §7.1): the gateway
    resumes it elsewhere."""
    MODEL_STARTING = "model_starting"
    """Its model's start would take longer than the request's cold-start budget: retry once it
    is warm (the start goes ahead)."""


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


class Tier(StrEnum):
    """Which form of an artifact a start loads. On OpenVINO a compiled one: a start loads START
    (cheapest first forward pass), the worker tiers up to STEADY (fastest decode) once idle;
    same weights, same logits. TORCH is the artifact's torch checkpoint, the one form torch and
    vLLM workers load (no tier-up). Each is what the host cache holds and a multicast moves."""

    START = "start"
    STEADY = "steady"
    TORCH = "torch"


COMPILED_TIERS = (Tier.START, Tier.STEADY)
"""The forms OpenVINO compiles at registration."""


# --- the model registry -------------------------------------------------------------------


class WeightFormat(StrEnum):
    """The element type an artifact keeps its weights in (optimum-cli's `--weight-format`):
    what a registration of a Hugging Face checkpoint asks NNCF for, and what the artifact of
    any source was found to hold."""

    INT4 = "int4"
    """4-bit asymmetric (`int4_asym`) with 8-bit embeddings, NNCF's default group size."""
    INT8 = "int8"
    """8-bit asymmetric, per output channel."""
    F16 = "f16"
    F32 = "f32"


class SourceFormat(StrEnum):
    """What a registration's source was."""

    GGUF = "gguf"
    HF = "hf"
    """A Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer files."""
    OPENVINO = "openvino"
    """An OpenVINO IR directory as `optimum-cli export openvino` writes it."""


class Artifact(Message, frozen=True):
    """A source (GGUF, Hugging Face checkpoint, OpenVINO IR) converted once into the model
    store; shared by every name registered on it."""

    artifact_id: str
    """sha256 of the source (16 hex; of a directory: of its files' names and contents, and the
    weight format asked for) + OpenVINO version: a new runtime gets a new conversion."""
    path: str
    """Directory holding the OpenVINO IR and the compiled tokenizer/detokenizer."""
    source_sha256: str
    context_length: int
    """Largest prompt + completion the model accepts, in tokens (from the GGUF metadata)."""
    kv_bytes_per_token: int
    """KV-cache bytes one token costs: 2 × layers × kv_heads × head_dim × element size."""
    weight_bytes: int
    """Bytes of the IR weights: what an instance needs before any KV cache."""
    architecture: str = ""
    openvino_version: str = ""
    sampling: dict[str, float] = {}
    """The GGUF's recommended sampling (`general.sampling.temp`, `.top_p`, ...), as named there."""
    start_tier: bool = True
    """The loader wrote (and compiles) its start tier (`shared.artifact.START_DIR`); False
    where its packed weights are above the loader's `start_tier_max_weight_bytes`: its
    OpenVINO engine then serves from the continuous-batching core from the first token."""
    source_format: SourceFormat = SourceFormat.GGUF
    weight_format: str = ""
    """A `WeightFormat`, as found in the IR's weights (a GGUF's Q4_1 reads as int4); "" in an
    artifact written before it was recorded."""


class GenerationDefaults(Message, frozen=True):
    """What a request that leaves a sampling parameter out gets (vLLM's `--generation-config
    auto`: the model's own defaults, not OpenAI's). Read at registration from the model's
    metadata (GGUF `general.sampling.*`) where it has them, else the platform's below (Ollama's
    and llama-server's: a small model sampled at temperature 1.0 with no repetition penalty
    and no length cap rambles for minutes); overridable at registration."""

    temperature: float = 0.8
    top_p: float = 0.95
    repetition_penalty: float = 1.1
    max_tokens: int = 512
    """Cap on a completion that names no `max_tokens` (one that names more is still served,
    up to the context)."""


TTFT_SLO_PER_TOKEN_S = 1.0 / 512
"""LLM-Mesh §3.1, §8.1: a request of L prompt tokens has max(2, L / 512) s to its first token."""


class ModelRecord(Message, frozen=True):
    """A registered model name; several names may share one artifact."""

    name: str
    source: str
    """Path of the GGUF it was imported from."""
    artifact: Artifact
    ttft_slo_s: float
    """The TTFT SLO of a short prompt: the floor of `policy.slo.ttft_slo`."""
    tpot_slo_s: float
    keep_alive_s: float
    """Idle seconds after which its instance is unloaded (scale to zero)."""
    created_at: float
    defaults: GenerationDefaults = GenerationDefaults()
    ttft_slo_per_token_s: float = TTFT_SLO_PER_TOKEN_S
    """Seconds of TTFT SLO per prompt token: a prompt of L tokens has max(ttft_slo_s, L × this)
    (`policy.slo.ttft_slo`; 0: a fixed TTFT SLO). A record written before it existed reads as
    the paper's."""
    chat_template: str = ""
    """A Jinja chat template that replaces the model's own (vLLM's `--chat-template`); empty:
    the one its GGUF carries."""
    min_instances: int = 0
    """Instances kept running whatever the traffic (issue 35, keep warm): started at
    registration and again after a node restart, never scaled below, never evicted or
    preempted for a model of lower `priority`. 0: scale to zero after `keep_alive_s`."""
    priority: int = 0
    """Higher is kept first: evictions and preemptions take lower priorities first, before
    Tangram's cost orders them (`policy.eviction`)."""


class ImportModel(Message, frozen=True):
    """Convert a source (a GGUF, a Hugging Face checkpoint or an OpenVINO IR directory) into
    the store, or find the conversion already there."""

    source: str
    weight_format: WeightFormat | None = None
    """What a Hugging Face checkpoint's weights are compressed to (None: by its size,
    `services.loader.formats.default_weight_format`); an IR or a GGUF keeps its own, and
    naming another is refused."""


class ModelImported(Message, frozen=True):
    artifact: Artifact
    converted: bool
    """False when the store already held this GGUF for this runtime (nothing was converted)."""
    seconds: float


# --- placement (requests' own: `shared.routing_messages`) -------------------------------------


class RelocateQuery(Message, frozen=True):
    """Engine → scheduler: could these models' requests run on another node than `node_id`
    (LLM-Mesh §7.1: a neighbour is preempted only if its requests validate elsewhere)?"""

    node_id: str
    models: tuple[str, ...]


class RelocateAnswer(Message, frozen=True):
    relocatable: tuple[str, ...]


class Rejected(Message, frozen=True):
    code: ErrorCode
    message: str
    retry_after_s: float | None = None


# --- instances ---------------------------------------------------------------------------------


class StartInstance(Message, frozen=True):
    model: ModelRecord


class ColdStartPhases(Message, frozen=True):
    """Seconds spent in each phase of one cold start (ARCHITECTURE: a cold start)."""

    init_s: float
    load_s: float
    profile_s: float
    prefill_s: float = 0.0
    apply_s: float = 0.0
    """An adapter's start (tier "adapter", issue 34): applying it on its base's pipeline, after
    `load_s` read its file (`prefill_s`: its first token, after)."""


class InstanceReady(Message, frozen=True):
    node_id: str
    model: str
    phases: ColdStartPhases
    loaded_from_cache: bool = False
    """True when the start imported the blob materialized at registration (no compile)."""
    source: str = ""
    """Where the weights came from, as `ColdStartRecorded.source` ("": the engine did not say)."""


class StopInstance(Message, frozen=True):
    model: str
    idle_since: float
    """Unload only if the instance has been idle since at least this time (no race with new work)."""


class PreemptInstance(Message, frozen=True):
    """Scheduler → engine: end this instance's requests as PREEMPTED (the gateway resumes them
    elsewhere) and unload it, so that `for_model`'s instance on the node takes the request that
    did not fit beside it (LLM-Mesh §7.1). Answered with `InstanceStopped`."""

    model: str
    for_model: str


class InstanceStopped(Message, frozen=True):
    node_id: str
    model: str
    stopped: bool
    reason: str = ""
    resident: tuple[str, ...] | None = None
    """An idle stop's: what the node holds resident after it (its heartbeat's `resident`, the
    stopped model's weights among them where the pool kept them). The scheduler's view takes
    it with the stop: it ignores the heartbeats sent before its own change of the view."""


class ColdStartRecorded(Message, frozen=True):
    node_id: str
    model: str
    started_at: float
    phases: ColdStartPhases
    total_s: float
    """Start request received → first token of the request that caused it."""
    loaded_from_cache: bool = False
    source: str = "store"
    """Where the weights came from: "resident" (a worker kept them after scale-to-zero),
    "arena" (a torch worker idle with another model rebound to this one, its tensors shared by
    content hash read from nowhere: Tangram §3.1), "host" (the loader's host cache), "store"
    (the model store on disk) or "pipeline" (no weights here: served through the stages of a
    scale-out's execution pipeline while the replica arrives, FaaScale §4.3)."""
    stage_s: float = 0.0
    """Of Load: asking the loader for the blob (a host-cache hit verifies every block)."""
    worker_load_s: float = 0.0
    """Of Load: the worker importing the compiled blob and loading the tokenizer."""
    tier: str = ""
    """The compiled tier the first token came from (`Tier`)."""
    load_threads: int = 0
    """The threads the runtime ran the worker's load and start tier on, as the compiled model
    reports them: a share of the node's cores beside busy instances
    (`TESSERA_START_CPU_SHARE`), all of them on an idle node; 0 where nothing was loaded."""


class StartProgress(Message, frozen=True):
    """Engine → gateways: how far a cold start of `model` on `node_id` is (issue 35, part 4),
    published at each phase change and, within a phase, at most every
    `TESSERA_PROGRESS_INTERVAL_S`. Read from the start itself, not a timer: `done_bytes` of
    `total_bytes` are the weights its worker has mapped in so far (its resident memory's
    growth against the compiled blob's size), `bytes_per_s` the bandwidth measured over
    them."""

    node_id: str
    model: str
    started_at: float
    """time.time() the start began on the engine: one start's events share it."""
    phase: str
    """"init" (room made, the blob staged), "load" (the worker reads the weights), "profile"
    (the KV reservation) or "ready" (the instance serves)."""
    done_bytes: int
    total_bytes: int
    bytes_per_s: float = 0.0
    """Measured over this start's load so far; 0 before anything was read."""
    eta_s: float | None = None
    """Seconds until the weights are in at that bandwidth; None while it is unknown."""


class InstanceView(Message, frozen=True):
    model: str
    active: int
    """Requests generating or queued on the instance."""
    last_used: float
    loaded_at: float
    weight_bytes: int = 0
    worker_pid: int = 0
    """The worker process serving it (operators: where its memory and CPU time are)."""
    tier: str = ""
    """The compiled tier its worker serves (`Tier`): START right after a start, then STEADY."""
    running: int = 0
    """Of `active`, the requests in its worker's running batch (the rest are queued)."""
    held_tokens: int = 0
    """Context tokens the running batch's rows of these requests hold: what a request joining
    the batch re-prefills with its own prompt (placement predicts joins with it)."""
    queued_tokens: int = 0
    """Prompt tokens of the requests queued (in `active`, not yet in the running batch)."""
    ready_in_s: float = 0.0
    """Seconds until it can run a newcomer's prefill (its weights or KV cache still being
    loaded or resized); 0 where the engine does not say."""
    adapters: tuple[str, ...] = ()
    """The LoRA adapters loaded on it (issue 34), by name: each dropped when idle its own
    keep-alive, the instance staying."""


class PerfReport(Message, frozen=True):
    """Recent measured iterations of one artifact on a node: what the scheduler fits its
    performance model from (LLM-Mesh §5.2)."""

    artifact_id: str
    prefill: tuple[tuple[int, float], ...] = ()
    """(input tokens, seconds) of recent prefills."""
    decode: tuple[tuple[int, int, float], ...] = ()
    """(batch, mean sentence length, seconds per iteration) of recent decodes."""


class NodeStatus(Message, frozen=True):
    """Heartbeat of an engine: what it runs and how busy it is."""

    node_id: str
    sent_at: float
    instances: tuple[InstanceView, ...] = ()
    starting: tuple[str, ...] = ()
    memory_budget_bytes: int = 0
    memory_used_bytes: int = 0
    kind: str = "cpu"
    """"cpu" or "gpu": shadow validation tries CPU nodes first (LLM-Mesh §4)."""
    resident: tuple[str, ...] = ()
    """Artifacts whose weights stay loaded here with no instance (Tangram: reusable)."""
    reusable: tuple[tuple[str, float], ...] = ()
    """Artifacts part of whose tensors this node's tensor arena (or an idle worker's own)
    holds (a fine-tune beside its base, Tangram §3.1), with that share of their bytes: a start
    here reads only the rest."""
    perf: tuple[PerfReport, ...] = ()
    max_batch: int = 1
    """Requests one worker here decodes together (queued ones join the next batch)."""
    join_recompute_tokens: int = 0
    """A request may join a running batch while its rows hold at most this many tokens (0: never)."""
    prewarmed: int = 0
    """Idle worker processes ready to load a model: a start here need not spawn one."""
    continuous_batching: bool = False
    """Its engine adds a request to the running batch after that request's own prefill (vLLM):
    no re-prefill of the rows, no wait for the batch to end."""
    core_build_s: float = 0.0
    """Seconds a new instance here spends building its engine core after its first batch, on
    the cores its neighbours decode on (the last build measured; 0: starts here build none)."""
    kv_on_demand: bool = False
    """Its engine's KV cache grows as rows fill: a start here books its weights, no L_min floor
    (`policy.kv_watermark.floor_tokens`)."""


class ScaleOut(Message, frozen=True):
    """Run `model` on `instances` nodes in all, starting it at once on those that lack it, its
    weights brought to them along one multicast plan (FaaScale §4-5): an operator's, ahead of
    a burst it expects."""

    model: str
    instances: int


class ScaledOut(Message, frozen=True):
    model: str
    running: tuple[str, ...]
    """Nodes that ran the model, or were starting it, already."""
    started: tuple[str, ...]
    """Nodes it starts on now (fewer than asked where no more nodes can take it)."""


class ClusterStatusQuery(Message, frozen=True):
    pass


class ClusterStatus(Message, frozen=True):
    nodes: tuple[NodeStatus, ...]
    starting: tuple[str, ...] = ()


# --- generation --------------------------------------------------------------------------------


class Guide(Message, frozen=True):
    """Output the engine's grammar enforces (OpenVINO GenAI's `StructuredOutputConfig`).

    The gateway checks a client's spec before sending it (`services/gateway/guides.py`): a
    spec the library cannot compile fails its pipeline's step for every request on it."""

    kind: str
    """"json_schema", "regex" or "grammar" (xgrammar's EBNF)."""
    spec: str


class SamplingParams(Message, frozen=True):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_k: int = 0
    """0: every token."""
    min_p: float = 0.0
    guide: Guide | None = None
    logprobs: int = -1
    """-1: none; 0: the chosen token's; k > 0: and the k most likely alternatives (those are
    read from the logits: the stateful tier serves such a request, `worker.needs_logits`)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias added to its logit): OpenAI's, -100 bans and 100 forces a token."""


class AdapterRef(Message, frozen=True):
    """The LoRA adapter a request runs with (issue 34; `shared.adapters` holds its records):
    enough for its base's engine to load it (`path`, `scale`), book it (`nbytes`) and drop it
    when idle (`keep_alive_s`) without reading the registry."""

    name: str
    """The adapter's registered name (what the caller asked for)."""
    adapter_id: str
    path: str
    """`AdapterArtifact.path`: its kept directory in the store."""
    scale: float
    nbytes: int
    keep_alive_s: float


class Generate(Message, frozen=True):
    request_id: str
    model: str
    prompt: str
    """Already rendered with the model's chat template where the API asked for chat."""
    prompt_ids: tuple[int, ...]
    """`prompt` tokenized by the gateway: the engine needs no tokenizer before the first token."""
    prompt_tokens: int
    params: SamplingParams
    stream_subject: str
    adapter: AdapterRef | None = None
    """Set where the caller named an adapter: `model` is then its base."""


class GenerateAccepted(Message, frozen=True):
    request_id: str


class TokenLogprob(Message, frozen=True, array_like=True):
    """A generated token, its log-probability and the most likely alternatives (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenChunk(Message, frozen=True):
    request_id: str
    text: str
    tokens: int
    """Tokens decoded since the previous chunk."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token since the previous chunk, when the request asked for logprobs."""


class Finished(Message, frozen=True):
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


class Failed(Message, frozen=True):
    request_id: str
    code: ErrorCode
    message: str


class Cancel(Message, frozen=True):
    request_id: str


# --- memory ------------------------------------------------------------------------------------


class Reserve(Message, frozen=True):
    owner: str
    nbytes: int


class ReserveResult(Message, frozen=True):
    granted: bool
    used_bytes: int
    budget_bytes: int


class Release(Message, frozen=True):
    owner: str
    """A region (`weights:<artifact>`, `<model>:kv`), every `<owner>:*` region, or `*`."""


class ReserveDone(Message, frozen=True):
    """Engine → memory manager: the load or resize granted for `owner` has finished, so the
    region now physically holds its new size (the reservation station's completion)."""

    owner: str


StreamEvent = TokenChunk | Finished | Failed
