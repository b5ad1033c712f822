from __future__ import annotations

from typing import Literal

from shared.settings import CommonSettings


class SchedulerSettings(CommonSettings):
    http_port: int = 8101
    start_timeout_s: float = 300.0
    """Longest a cold start may take before the requests waiting on it fail."""
    max_active_per_instance: int = 256
    """Requests running or queued on one instance before new ones are turned away (429): the
    continuous-batching core's `max_num_seqs` (`services/engine/core.py`)."""
    keep_alive_check_s: float = 0.25
    start_guess_s: float = 5.0
    """A start's predicted seconds where no start of any model was measured yet (a request's
    cold-start budget is judged against it: `policy.cold_budget`)."""
    reject_over_slo: float | None = None
    """Admission: refuse a request predicted to get its first token more than this many TTFT
    SLOs late (429 with Retry-After) instead of queueing it; unset: queue every request the
    in-flight limits admit."""
    placement: Literal["tessera", "exclusive"] = "tessera"
    """"exclusive": the baseline of bench/cluster.py (one model per node, no sharing, no
    scale-out, fixed keep-alive), as a Knative or ServerlessLLM deployment places."""
    multicast_scale_out: bool = False
    """Before a start on a node for a model other nodes run, have that node's loader fetch
    the compiled blob from the loaders that hold it in host memory, by a PipeCast plan
    (FaaScale §4-5), instead of each start reading the model store: for nodes that reach the
    store over the network. Off where every node reads one local store (one machine)."""
    pipeline_max_stages: int = 4
    """With `multicast_scale_out`, on torch nodes: a scale-out's targets serve the model as an
    execution pipeline of at most this many stages (a worker each) once together they hold
    every layer, before any one of them holds it all (FaaScale §4.3); 0: no pipelines."""
    multicast_group_s: float = 0.05
    """With `multicast_scale_out`: scale-outs of a model that begin within this many seconds
    of the first (a burst's) share one plan (`policy.multicast_groups`); the first waits that
    long before it orders it."""
