"""What the gateway and the scheduler exchange to route a request: its placement (with its
cold-start budget, and what a start cost it), the choice among an alias's members, and the
aliases themselves as the registry keeps them."""

from __future__ import annotations

from shared.messages import Message

MAX_FALLBACKS = 8
"""Most members one alias (or one request's `models`) may list."""


class PlaceRequest(Message, frozen=True):
    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    not_on: str = ""
    """A node that just answered it has no instance of the model: the scheduler's view of it
    is stale (a scale-in or a lost worker raced this request)."""
    avoid: str = ""
    """A node that preempted this request's instance: place it on another, where there is one."""
    wait_s: float = 0.0
    """How long it may wait in the scheduler's line for room, where no node can take it yet
    without breaking the SLOs of the requests there (0: not at all)."""
    max_wait_s: float | None = None
    """Its cold-start budget: where it would wait for a start predicted to take longer, it is
    refused at once (`ErrorCode.MODEL_STARTING`, Retry-After the predicted ready time) and the
    start goes ahead. None: it waits for whatever start it needs."""


class Placement(Message, frozen=True):
    request_id: str
    node_id: str
    cold_start: bool
    """True when this request waited for (or triggered) an instance start."""
    start_source: str = ""
    """For a cold start: where its weights came from (`ColdStartRecorded.source`)."""
    start_s: float = 0.0
    """For a cold start: the start's seconds until its instance was ready."""


class ChooseModel(Message, frozen=True):
    """Gateway → scheduler: which of these models (an alias's members, or a request's
    `models`, in order) serves a request of this size: the first warm one that takes it
    within its SLOs, else the first."""

    models: tuple[str, ...]
    prompt_tokens: int
    max_tokens: int


class ModelChosen(Message, frozen=True):
    model: str
    warm: bool
    """False: no member was warm within its SLOs; the first is chosen, and starts."""


class ModelAlias(Message, frozen=True):
    """A name registered as an ordered list of models (warm fallbacks)."""

    name: str
    members: tuple[str, ...]
    created_at: float
