"""OpenAI API types at the HTTP edge (pydantic). Unknown fields are accepted and ignored, as
OpenAI's own server does for fields it does not use."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from services.gateway.tools import Tool, check_tool_choice
from shared.messages import TTFT_SLO_PER_TOKEN_S, WeightFormat
from shared.routing_messages import MAX_FALLBACKS


def _unicode(v: str) -> str:
    # JSON may escape a lone surrogate ("\ud800") that no UTF-8 encoder takes: refuse it here,
    # not as a 500 from the tokenizer, the bus codec or Valkey later.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (a lone surrogate \\ud800-\\udfff is not)") from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]


class Lenient(BaseModel):
    """A request body. Unknown names are let through (each body refuses by name what it does
    not serve); known ones are typed strictly, as OpenAI's server types them: `"16"` is not the
    integer 16 nor `"true"` a boolean, and a number must be finite (JSON's `1e309` parses to
    infinity)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


_ADMIN = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""An admin body: strictly typed, and a misspelt name is an error."""


class StreamOptions(Lenient):
    include_usage: bool = False


class ContentPart(Lenient):
    type: str
    text: Text | None = None


class ChatMessage(Lenient):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part of type {part.type!r} is not supported; only 'text'")
            parts.append(part.text or "")
        return "".join(parts)


class UnsupportedParameter(ValueError):
    """A parameter Tessera does not serve yet (the 400 names it in `param`)."""

    def __init__(self, param: str, message: str = "") -> None:
        super().__init__(
            message or f"`{param}` is not supported by Tessera yet (see the table of parameters in docs/api.md)"
        )
        self.param = param


def asks_nothing(value: Any) -> bool:
    """Left at what means "not asked for" (absent, null, false, empty)."""
    return value is None or value is False or value == [] or value == {}


_UNSUPPORTED: dict[str, Any] = {
    # name -> the values that ask for nothing (accepted as no-ops)
    "functions": asks_nothing,
    "function_call": lambda v: asks_nothing(v) or v == "none",
    "suffix": asks_nothing,
}
_NO_EFFECT = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
"""OpenAI parameters that change no answer (bookkeeping, billing, caching hints): accepted."""

MAX_CHOICES = 16
"""Most choices one request may ask for (n, best_of, times its prompts): each is a request of
its own on the engine."""
MAX_TOP_LOGPROBS = 20
"""vLLM's and OpenAI's limit on alternatives per token."""
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
"""A token id as `logit_bias` keys it (no vocabulary has 10^10 tokens)."""


class TesseraOptions(BaseModel):
    """Tessera's own extension object of a completion request (`"tessera": {...}`, as vLLM
    takes extra fields): strictly typed, a misspelt name refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    max_wait_s: Annotated[float, Field(ge=0.0)] | None = None
    """The cold-start budget: the longest this request waits for its model's start; a start
    predicted longer is a 503 with Retry-After at once (the `X-Tessera-Max-Wait` header's)."""


class _Sampling(Lenient):
    model: str = Field(min_length=1)
    # OpenRouter's fallbacks: `model` first, then these, the first warm one serving.
    models: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, max_length=MAX_FALLBACKS
    )
    tessera: TesseraOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # What numpy's generator and the msgpack codec take; a negative seed is mapped into it.
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: Text | list[Text] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    """Generate this many, return the `n` with the highest log-probability (not streamed)."""
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's structured output (checked and turned into a grammar by `guides.py`).
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions, also accepted here: keep decoding past end-of-sequence; penalize
    # tokens already in the context (1.0: off).
    ignore_eos: bool = False
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # vLLM's: keep the k most likely tokens (-1 or 0: all); drop tokens less likely than
    # min_p times the most likely one (0: off).
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None

    @model_validator(mode="after")
    def _nothing_silently_ignored(self) -> _Sampling:
        """OpenAI (and vLLM) parameters Tessera does not serve yet are refused by name, not
        ignored: a client asking for JSON, a tool call or logprobs must not get prose back as
        if it had been honoured. So is a name it does not know (a misspelt `max_token`, a newer
        OpenAI parameter), as OpenAI's server answers an unrecognized argument, unless its
        value asks for nothing (null) or the parameter changes no answer (`_NO_EFFECT`)."""
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED:
                if not _UNSUPPORTED[name](value):
                    raise UnsupportedParameter(name)
            elif name not in _NO_EFFECT and value is not None:
                raise UnsupportedParameter(name, f"unrecognized request argument supplied: `{name}`")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            # ASCII digits only: str.isdigit() also takes "²" or "٣", which int() refuses.
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys must be token ids (from /tokenize), not {key[:40]!r}")
        return v

    @model_validator(mode="after")
    def _choices(self) -> _Sampling:
        if self.best_of is not None and self.best_of < self.choices():
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.choices()})")
        if self.stream and self.best_of is not None and self.best_of > self.choices():
            raise ValueError("best_of cannot be streamed: the best choices are known only at the end")
        return self

    def choices(self) -> int:
        return self.n or 1

    def candidates(self) -> int:
        """Generations per prompt (best_of of them, else n)."""
        return max(self.best_of or 1, self.choices())

    def logit_biases(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items() if b != 0.0)

    def guided(self) -> dict[str, Any]:
        return {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        check_tool_choice(self.tools, self.tool_choice)
        return self

    def logprob_count(self) -> int:
        """-1: none; else the alternatives per token (0: the chosen token's logprob alone)."""
        return (self.top_logprobs or 0) if self.logprobs else -1

    @model_validator(mode="after")
    def _prefer_new_limit(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Sampling):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """Completions' logprobs: the chosen token's and this many alternatives."""

    @model_validator(mode="after")
    def _few_choices(self) -> CompletionRequest:
        if len(self.prompts()) * self.candidates() > MAX_CHOICES:
            raise ValueError(
                f"{len(self.prompts())} prompts x {self.candidates()} generations each is more "
                f"than {MAX_CHOICES} generations in one request"
            )
        return self

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def logprob_count(self) -> int:
        return -1 if self.logprobs is None else self.logprobs


class TokenizeRequest(Lenient):
    """vLLM's /tokenize: a prompt as /v1/completions takes it, or messages as chat does (then
    rendered with the model's chat template, as a chat request would be)."""

    model: str = Field(min_length=1)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either `prompt` or `messages`")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Lenient):
    model: str = Field(min_length=1)
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


ModelState = Literal["loaded", "loading", "cold"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tessera"
    # vLLM's: an adapter's `parent` is its base model; `root` is the model at the root of its
    # tree (its base for an adapter, itself for a base; vLLM names its path there).
    root: str | None = None
    parent: str | None = None
    fallbacks: list[str] | None = Field(default=None, exclude_if=lambda v: v is None)
    """An alias's members, in order (Tessera's extension; absent for a model, where `parent`
    and `root` are null as vLLM's are)."""
    status: ModelState | None = Field(default=None, exclude_if=lambda v: v is None)
    """Tessera's extension: `loaded` (an instance runs), `loading` (a start is under way) or
    `cold`; an adapter's is its base's; absent for an alias, or when the scheduler cannot say."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


MAX_INSTANCES = 1024
MAX_PRIORITY = 1_000_000


class ScaleModel(BaseModel):
    """Admin API: run a model on this many nodes in all (FaaScale's scale-out, ahead of a burst)."""

    model_config = _ADMIN

    instances: int = Field(ge=1, le=MAX_INSTANCES)


class PinModel(BaseModel):
    """Admin API: keep a model warm (`POST /admin/models/{name}/pin`; every field optional)."""

    model_config = _ADMIN

    min_instances: int = Field(default=1, ge=1, le=MAX_INSTANCES)
    priority: int | None = Field(default=None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    """Left out: the model keeps the priority it has."""


MAX_KEEP_ALIVE_S = 366 * 86_400.0
"""Longest idle time before an instance stops (a year: anything longer means "never")."""
MAX_SLO_S = 3_600.0
"""Largest latency target: an hour to a token is no target."""


class _Registration(BaseModel):
    """What a model's and an adapter's registration both name: the name it is served as, where
    it comes from, its latency targets and its keep-alive."""

    model_config = _ADMIN
    SOURCE_IS: ClassVar[str] = "a .gguf file or a model directory"

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    """Served as `/v1/models/{name}`: "/" may group names (`org/model`), but every segment
    is a name, not empty, `.` or `..` (which clients and proxies resolve away)."""
    source: Text = Field(
        min_length=1,
        max_length=4096,
        description="Absolute path of a .gguf file, a Hugging Face checkpoint directory or an OpenVINO IR "
        "directory (a model); of a PEFT LoRA adapter directory (an adapter)",
    )
    """At most PATH_MAX (4096 on Linux) characters."""
    ttft_slo_s: float = Field(default=2.0, gt=0, le=MAX_SLO_S)
    # A prompt of L tokens has max(ttft_slo_s, L × this) to its first token (LLM-Mesh §8.1:
    # max(2, L / 512) s, the defaults); 0 keeps it fixed (`policy.slo`).
    ttft_slo_per_token_s: float = Field(default=TTFT_SLO_PER_TOKEN_S, ge=0, le=MAX_SLO_S)
    tpot_slo_s: float = Field(default=0.1, gt=0, le=MAX_SLO_S)
    keep_alive_s: float = Field(default=300.0, gt=0, le=MAX_KEEP_ALIVE_S)
    # Keep warm (issue 35): instances kept running whatever the traffic, started now (an
    # adapter's: its base's, the adapter loaded on them); a set of pinned models the nodes
    # cannot hold is a 409 (`policy.keep_warm.fit`).
    min_instances: int = Field(default=0, ge=0, le=MAX_INSTANCES)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    """Higher is kept first when memory runs short (evictions and preemptions)."""

    def service_terms(self) -> dict[str, Any]:
        """Its name, source, latency targets, keep-alive and pin, as its record keeps them."""
        return self.model_dump(
            include={
                "name",
                "source",
                "ttft_slo_s",
                "ttft_slo_per_token_s",
                "tpot_slo_s",
                "keep_alive_s",
                "min_instances",
                "priority",
            }
        )

    @field_validator("name")
    @classmethod
    def _segments(cls, v: str) -> str:
        segments = v.split("/")
        if any(segment in ("", ".", "..") for segment in segments):
            raise ValueError("each /-separated part of a model name must be a name, not empty, '.' or '..'")
        if len(segments) > 1 and "adapters" in segments:
            # `/admin/models/<base>/adapters/<name>` would read such a name as an adapter's path.
            raise ValueError("'adapters' is reserved as a /-separated part of a name (the admin API's adapter paths)")
        return v

    @field_validator("source")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        # Refused here with a clear 400: a NUL byte or "~user" makes the loader's path checks
        # raise instead of answering (the import would wait for its timeout).
        if v is not None and ("\x00" in v or not v.startswith(("/", "~/"))):
            raise ValueError(f"must be an absolute path to {cls.SOURCE_IS}")
        return v


class RegisterModel(_Registration):
    """Admin API: register a model name on a GGUF file, a Hugging Face checkpoint directory or
    an OpenVINO IR directory; or, with `fallbacks` instead of `source`, an alias: an ordered
    list of registered models, the first warm one serving each request."""

    source: Text | None = Field(  # type: ignore[assignment]  # an alias has none
        default=None,
        min_length=1,
        max_length=4096,
        description="Absolute path of a .gguf file, a Hugging Face checkpoint directory or an OpenVINO IR directory",
    )
    fallbacks: list[Text] | None = None
    """An alias's members, in order (then nothing else but `name` and `replace` is given)."""

    # Generation defaults for requests that leave these out (else the model's metadata's, else
    # the platform's: `shared.messages.GenerationDefaults`).
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    # A Jinja chat template replacing the GGUF's (vLLM's --chat-template): checked at
    # registration by rendering a one-message chat with it.
    chat_template: Text = Field(default="", max_length=65_536)
    replace: bool = False
    """Replace a model registered under this name (else registering a taken name is a 409)."""
    weight_format: Annotated[WeightFormat, Field(strict=False)] | None = None
    """What a Hugging Face checkpoint's weights are compressed to (NNCF): int4, int8, f16 or f32;
    left out, int8 up to 3 B parameters and int4 above. An IR keeps its own (naming another is
    a 400), as does a GGUF (naming one is a 400)."""

    @model_validator(mode="after")
    def _model_or_alias(self) -> RegisterModel:
        if (self.source is None) == (self.fallbacks is None):
            raise ValueError("give `source` (a model) or `fallbacks` (an alias), one of them")
        if self.fallbacks is not None and (extra := sorted(self.model_fields_set - {"name", "fallbacks", "replace"})):
            raise ValueError(f"an alias takes `name`, `fallbacks` and `replace` only, not {', '.join(extra)}")
        return self


class RegisterAdapter(_Registration):
    """Admin API: register a LoRA adapter (a PEFT adapter directory: adapter_config.json and
    adapter_model.safetensors) on a registered base; served by its own name."""

    SOURCE_IS: ClassVar[str] = "a PEFT adapter directory"


class CreateApiKey(BaseModel):
    """Admin API: make an API key; its secret is in the answer, once."""

    model_config = _ADMIN

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    models: list[Text] = Field(default_factory=list, description="Allowed models; empty: all")
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
