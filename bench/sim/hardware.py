"""The simulated hardware and the policies run on it: the node kinds' timing curves
(`Hardware`, `CPU`, `GPU`), the SLOs, the simulator's constants and `Policy` with the three
simulated (`TESSERA`, `GPU_ONLY`, `EXCLUSIVE`).

Costs (parameters of `Hardware`, defaults from the papers' testbeds): a start costs `init_s`
(pre-warmed worker, materialized profile) plus the missing bytes over the host-cache
bandwidth (Tangram eq. 3); weights still resident in the node's tensor pool are not loaded
again. KV resizes cost what `kv_watermark.resize_seconds` says (Fig. 8). Iteration times come
from `perf_model.profile` over the node kind's roofline-like timing functions below, fitted to
LLM-Mesh Figs. 1-3 (CPU: a 32-core AMX Xeon, GPU: an A100).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.trace import TPOT_SLO as TPOT_SLO
from bench.trace import TTFT_SLO_S as TTFT_SLO_S
from bench.trace import ModelSpec
from policy import kv_watermark as kvw
from policy.perf_model import PerfModel, profile

# The SLOs (LLM-Mesh §3.1, §8.1) are the models' (`bench.trace.ModelSpec`); TPOT_SLO and
# TTFT_SLO_S, imported above, are every model's in the LLM-Mesh setup.
GB = 1_000_000_000
EPS = 1e-9


def cpu_prefill(params_b: float, length: int) -> float:
    # Fig. 1: the Xeon meets the TTFT SLO for 7B and 13B, not for 22B at long inputs.
    return params_b / 7.0 * (0.05 + 0.0009 * length)


def cpu_decode(params_b: float, batch: int, length: int) -> float:
    # Figs. 2-3: 7B at 1k, batch 16 is ~1.7x batch 1; 13B at batch 32 doubles from 512 to 2k
    # and passes the 0.25 s SLO at 2k.
    return params_b / 7.0 * (0.08 + 0.0035 * batch + 1.2e-6 * batch * length)


def gpu_prefill(params_b: float, length: int) -> float:
    return params_b / 7.0 * (0.015 + 0.00008 * length)


def gpu_decode(params_b: float, batch: int, length: int) -> float:
    return params_b / 7.0 * (0.015 + 0.0002 * batch + 2e-8 * batch * length)


@dataclass(frozen=True)
class Hardware:
    kind: str
    memory_bytes: int
    load_bps: float
    """Host cache → device (GPU over PCIe; CPU: a copy into the engine's memory)."""
    init_s: float
    kv_copy_bps: float
    prefill: Callable[[float, int], float]
    decode: Callable[[float, int, int], float]
    loads_on_node: bool = False
    """A start's load takes the node's cores as a prefill does (`SimCore.occupy`): on a CPU
    node the weights' read and repack run on the cores that serve, and its starts beside busy
    instances took ten times one on an idle node (`bench.cluster --setup many`). False: a
    copy beside the compute (a GPU's over PCIe), as LLM-Mesh's testbed prices it."""


CPU = Hardware("cpu", 192 * GB, 16 * GB, 0.3, 20 * GB, cpu_prefill, cpu_decode)
GPU = Hardware("gpu", 76 * GB, 24 * GB, 0.3, 34 * GB, gpu_prefill, gpu_decode)
"""A100-80GB less the runtime's own; 34 GB/s puts a 32→64 GB KV resize at Fig. 8's 1.9 s."""


@dataclass(frozen=True)
class Testbed:
    """What a run is simulated on and judged by, beside its trace and its policy. The default
    is LLM-Mesh's (§8.1); `bench.sim.real_cluster` builds `bench.cluster`'s."""

    cpu: Hardware = CPU
    gpu: Hardware = GPU
    count_from_s: float = 0.0
    """Requests arriving before this are a ramp (`bench.cluster --ramp`): served, not counted."""
    mean_tpot: bool = False
    """Judge a request as `bench.cluster` does: its first token within its TTFT SLO and its mean
    time per output token after that within its TPOT SLO. Otherwise by eq. 1 (every token k
    by arrival + TTFT SLO + TPOT SLO · k), LLM-Mesh's rule."""

    def hardware(self, kind: str) -> Hardware:
        return self.cpu if kind == "cpu" else self.gpu


LLM_MESH = Testbed()

UNLOAD_S = 0.01
RESIZE_FIXED_S = 0.01
L_MIN_TOKENS = 4096
"""§6.1: L_min is set to the maximum sentence length."""
DEFAULT_MEAN_OUTPUT = 256.0
TYPICAL_LENGTH = 1000.0
"""Sentence length the exclusive baseline's concurrency limits are tuned at."""


def first_kv_bytes(spec: ModelSpec, input_len: int, mean_output: float) -> int:
    """An instance's first KV cache, for one request of `input_len` (eq. 2 and the watermark)."""
    return kvw.recommended_bytes(
        kvw.required_bytes(spec.kv_bytes_per_token, [(input_len, 0)], mean_output, L_MIN_TOKENS)
    )


@dataclass(frozen=True)
class Policy:
    name: str
    shared: bool = True
    """Tessera: instances of many models share a node (`sched.place`, the pool, the station)."""
    use_cpu: bool = True
    keep_alive_s: float = 1.0
    """LLM-Mesh §8.1 sets 1 s for every system; Tessera's weights stay in the pool after."""
    queue_timeout_s: float = 60.0
    """Exclusive: a request waiting this long for a slot is dropped (it is late anyway)."""
    candidates_per_kind: int = 4
    """Placement sees this many nodes with the most available memory per kind, the model's
    busiest instances per kind, and nodes holding its tensors: an index, not a scan of the
    cluster."""
    reject_over_slo: float | None = 1.0
    """The scheduler's early reject (`sched.place`): a request whose soonest first token is
    predicted past this many TTFT SLOs is refused at once rather than queued."""
    line: bool = False
    """A request no node has room for (`sched.NoRoom`) waits for room, as the services'
    scheduler holds it in its line, for `reject_over_slo` of its TTFT SLO, then goes where
    `NoRoom.otherwise` says; False: it goes there at once (the LLM-Mesh runs)."""
    max_active_per_instance: int = 256
    max_replacements: int = 2
    """A request a node cannot hold (its KV cache cannot grow) is placed again elsewhere, as
    the gateway does on the engine's `no_capacity`, this many times at most."""
    exclusive_kinds: tuple[str, ...] = ("cpu", "gpu")
    """Exclusive: the order node kinds are tried for a new instance (LLM-Mesh §8.1: every
    system prioritizes CPU nodes)."""
    limit_tpot_fraction: float = 1.0
    """Exclusive: the concurrency limit is the largest batch whose decode iteration at
    TYPICAL_LENGTH stays within this fraction of the TPOT SLO."""
    exclusive_scale_out: bool = True
    """Exclusive: a model gets another instance (node) when its instances are at their
    limits (LLM-Mesh §8.1). False: one instance per model, its requests queue in its
    engine's batch up to `max_active_per_instance`, as `bench.cluster`'s exclusive runs."""


TESSERA = Policy("tessera")
GPU_ONLY = Policy("gpu_only", use_cpu=False)
EXCLUSIVE = Policy("exclusive", shared=False)

_PROFILES: dict[tuple[Hardware, float], PerfModel] = {}


def _profile(hw: Hardware, params_b: float) -> PerfModel:
    """The perf model of a model size on a node kind, measured on the §5.2 grid."""
    key = (hw, params_b)  # a testbed's node of a kind is not LLM-Mesh's
    if key not in _PROFILES:
        _PROFILES[key] = profile(
            lambda n: hw.prefill(params_b, n),
            lambda b, n: hw.decode(params_b, b, n),
            max_length=4096,
            max_batch=256,
        )
    return _PROFILES[key]
