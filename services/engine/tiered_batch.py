"""One model's OpenVINO `Batch` over its two tiers: the start tier (`batch.StartBatch`: a
start's first token is cheap) from the first request, the continuous-batching core
(`core.CoreBatch`) once built.

TIDAL §3, §5: a start imports the start tier's compiled blob and serves at once; the core's
pipeline cannot be materialized (≈ 2.4 s of CPU), so it builds on a thread: after the start's
first batch, when more requests wait than the start tier's batch took, when a request only
the core serves comes (`core.needs_core`; it waits), or when the node is idle (`TierUpNow`:
with the warm-up crowd). Between two steps the built core takes over every request but those
that need the logits, a running one going on from its next token. A failed build leaves the
start tier serving for good (it would fail again), and a grammar is then refused, never
ignored.

An artifact whose packed weights are above the loader's `start_tier_max_weight_bytes` has no
start tier (`CoreFirst`): the core builds on the load and serves from the first token, but for
requests that need the logits, served by the stateful STEADY tier loaded for the first.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.engine.batch import Request, StartBatch, vocab_size
from services.engine.batch_types import Step
from services.engine.core import CoreBatch, check_prompt, needs_core, needs_logits
from services.engine.cpu_share import drop_mapped_pages, trim_heap
from services.engine.step_gate import TakeTurn, Turns, no_turn
from services.engine.worker_wire import TieredUp
from shared.adapters import ADAPTER_WEIGHTS, AdapterArtifact, adapters_root, read_manifest
from shared.artifact import model_xml
from shared.messages import AdapterRef, Artifact, SamplingParams, Tier

if TYPE_CHECKING:
    import openvino as ov

    from services.engine.instance import Detokenizer, LoadedModel

CLOSE_BUILD_S = 60.0
"""Longest `close` waits for a core build under way: a process that exits beside the
library's build thread aborts."""

NO_GRAMMAR = "this instance cannot enforce structured output: its continuous-batching core failed to build"
NO_ADAPTER = "this instance cannot apply LoRA adapters: its continuous-batching core failed to build"


@dataclass(frozen=True)
class LoraCover:
    """What a LoRA-able core was built for (`core.build_pipeline`): the library applies an
    adapter only on the linears the build's adapters update."""

    files: tuple[str, ...]
    targets: frozenset[str]
    layers: int

    def covers(self, adapter: AdapterArtifact) -> bool:
        return bool(self.files) and set(adapter.targets) <= self.targets and adapter.layers <= self.layers


def kept_adapters(artifact: Artifact) -> LoraCover:
    """What the core is built LoRA-able for: the adapters the store keeps for `artifact`
    (`shared.adapters`), as few of them as cover every linear any of them updates (PEFT adapters
    update every layer of their targets: by targets and layers). The library applies an adapter
    on a pipeline built with another on the same linears, whatever their ranks (both give the
    library's own tokens), so a base with a hundred adapters on `q_proj`/`v_proj` builds with one
    of them instead of reading the hundred."""
    root = adapters_root(artifact)
    kept = [a for d in sorted(root.iterdir()) if (a := read_manifest(d)) is not None] if root.is_dir() else []
    chosen: list[AdapterArtifact] = []
    targets: set[str] = set()
    layers = 0
    for a in sorted(kept, key=lambda a: (-len(a.targets), -a.layers, a.adapter_id)):
        if not set(a.targets) <= targets or a.layers > layers:
            chosen.append(a)
            targets |= set(a.targets)
            layers = max(layers, a.layers)
    return LoraCover(tuple(str(Path(a.path) / ADAPTER_WEIGHTS) for a in chosen), frozenset(targets), layers)


class _CoreBuild:
    """The core's pipeline, built on a thread (the library releases the GIL meanwhile)."""

    def __init__(self, artifact_path: str, device: str, threads: int, warm: bool, adapters: Sequence[str] = ()) -> None:
        self.pipeline: object | None = None
        self.adapters = adapters
        self.error = ""
        self.seconds = 0.0
        self.began = time.monotonic()
        self.done = threading.Event()
        threading.Thread(
            target=self._run, args=(artifact_path, device, threads, warm), daemon=True, name="core-build"
        ).start()

    def _run(self, artifact_path: str, device: str, threads: int, warm: bool) -> None:
        from services.engine.core import build_pipeline, warm_up  # (tests stand in for the build)

        try:
            pipeline = build_pipeline(artifact_path, device, threads, self.adapters)
            if warm:
                warm_up(pipeline)
            self.pipeline = pipeline
        except Exception as e:  # the start tier serves on, correctly
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.monotonic() - self.began
        self.done.set()


@dataclass(frozen=True)
class CoreFirst:
    """An artifact without a start tier: nothing loaded, the core built at once."""

    artifact: Artifact
    tokenizer: Detokenizer
    vocab_size: int


class TieredBatch:
    """The `Batch` of an OpenVINO worker. `loaded`: the start tier (on the start's share of
    threads), or `CoreFirst`; `reload`: the stateful tier loaded again (for requests that need
    the logits once it was let go); `threads`: the core's; `first_batch_done`: called once, when
    the start's first batch is over (or at once with `CoreFirst`): the start's share ends. Its
    tiers take their turns through its own, so that `waited` counts both."""

    def __init__(
        self,
        loaded: LoadedModel | CoreFirst,
        reload: Callable[[], LoadedModel],
        device: str,
        threads: int,
        turn: TakeTurn = no_turn,
        max_batch: int = 1,
        join_recompute_tokens: int = 0,
        first_batch_done: Callable[[], None] = lambda: None,
        idle: Callable[[], None] = lambda: None,
    ) -> None:
        self._turns = Turns(turn)
        self._idle = idle
        self.artifact = loaded.artifact
        self.tokenizer: Detokenizer = loaded.tokenizer
        self.core_first = isinstance(loaded, CoreFirst)
        self.loaded_from_cache = False if isinstance(loaded, CoreFirst) else loaded.loaded_from_cache
        self.vocab_size = loaded.vocab_size if isinstance(loaded, CoreFirst) else vocab_size(loaded.compiled)
        self.device = device
        self.threads = threads
        """The threads a core built from now on gets (the start tier's are fixed)."""
        self.max_batch = max_batch
        self.join_recompute_tokens = join_recompute_tokens
        self._reload = reload
        self._first_batch_done: Callable[[], None] | None = first_batch_done
        self.start = None if isinstance(loaded, CoreFirst) else self._start_batch(loaded)
        self.core: CoreBatch | None = None
        self.build: _CoreBuild | None = None
        self.build_failed = False
        self.build_window = (math.inf, math.inf)
        """When the core's last build began and ended: a request that overlapped it ran beside
        its ≈ 2.4 s of CPU, its times no measure of the model (`Done.beside_build`)."""
        self._for_core: dict[str, Request] = {}
        """Requests that wait for the core while it builds."""
        self._failed: list[Step] = []
        """Requests that failed between steps (their move to the core), told at the next."""
        self._tiered_up: TieredUp | None = None
        self._closed = False
        self._weights_dropped = False
        """Whether the core's IR weights file has been let go from this process's RSS."""
        self.cover = LoraCover((), frozenset(), 0)
        """What the core (built or building) applies adapters on."""
        self._adapter_of: dict[str, AdapterRef] = {}
        """The adapters of requests waiting for a core (`_for_core`)."""
        self._rebuild = False
        """An adapter came that the core was not built for: a core built for it replaces it
        once it drains (the base's instance starts its core again; never the base's output)."""
        if self.core_first:
            self._start_tiers_up()

    @property
    def tier(self) -> Tier:
        return Tier.STEADY if self.core is not None else Tier.START

    @property
    def building(self) -> bool:
        return self.build is not None

    @property
    def active(self) -> int:
        return len(self._for_core) + len(self._failed) + sum(b.active for b in (self.start, self.core) if b)

    @property
    def alive(self) -> bool:
        return not self._closed

    @property
    def waited(self) -> float:
        return self._turns.waited

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    @property
    def kv_bytes(self) -> int:
        return self.core.kv_bytes if self.core is not None else 0

    def device_bytes(self) -> int:
        return 0  # nothing on a GPU

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float] = lambda _: math.inf,
        kv_tokens: int = 0,
    ) -> None:
        check_prompt(prompt_ids, params.max_tokens, self.vocab_size, max(self.artifact.context_length, kv_tokens))
        self._adopt_core()
        request = Request(request_id, tuple(prompt_ids), params, deadline, kv_tokens)
        if needs_logits(params):
            self._to_start(request)
        elif self.core is not None and not self._rebuild:
            self.core.add(request_id, prompt_ids, params, deadline)
        elif params.guide is not None and self.build_failed:
            raise ValueError(NO_GRAMMAR)
        elif (needs_core(params) or self.core_first) and not self.build_failed:
            self._for_core[request_id] = request
            self._start_build()
        else:  # the start tier's sampler has seeds, penalties, top-k, min-p where the core failed
            self._to_start(request)

    def add_adapted(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float],
        kv_tokens: int,
        adapter: AdapterRef,
    ) -> None:
        """A request for a LoRA adapter: always on the core (the start tier's stateful model has
        no adapter support the library exposes), which waits for a build LoRA-able for it."""
        check_prompt(prompt_ids, params.max_tokens, self.vocab_size, max(self.artifact.context_length, kv_tokens))
        if needs_logits(params):
            raise ValueError(
                "logit_bias and top_logprobs are served by the stateful tier, which does not apply LoRA adapters"
            )
        if self.build_failed:
            raise ValueError(NO_ADAPTER)
        kept = read_manifest(Path(adapter.path))
        if kept is None:
            raise ValueError(f"the adapter `{adapter.name}` is not kept in the store at {adapter.path}")
        self._adopt_core()
        if self.core is not None and not self._rebuild and self.cover.covers(kept):
            self.core.add(request_id, prompt_ids, params, deadline, adapter=adapter)
            return
        self._for_core[request_id] = Request(request_id, tuple(prompt_ids), params, deadline, kv_tokens)
        self._adapter_of[request_id] = adapter
        if self.core is not None or (self.build is not None and not self.cover.covers(kept)):
            self._rebuild = True  # built before this adapter was kept: built again, once drained
        self._start_build()

    def drop_adapter(self, name: str) -> None:
        if self.core is not None:
            self.core.drop_adapter(name)

    @property
    def adapters(self) -> tuple[str, ...]:
        return self.core.adapters if self.core is not None else ()

    def cancel(self, request_id: str) -> None:
        was = self.active
        self._for_core.pop(request_id, None)
        self._adapter_of.pop(request_id, None)
        self._failed = [s for s in self._failed if s.request_id != request_id]
        for batch in (self.start, self.core):
            if batch is not None:
                batch.cancel(request_id)
        if was and not self.active:
            self._idle()

    def steps(self, timeout: float) -> list[Step]:
        """A step of each tier that has requests; with only requests that wait for the core, up
        to `timeout` of waiting for its build."""
        self._adopt_core()
        if self._for_core and self.build is not None and not any(b and b.active for b in (self.start, self.core)):
            self.build.done.wait(timeout)
            self._adopt_core()
        out, self._failed = self._failed, []
        start = self.start
        if start is not None and start.active:
            out += start.steps(timeout)
            if not start.running:  # its batch is over (the start's first token is out): the core
                self._start_tiers_up()
            elif start.queue:  # more demand than the start tier's batch takes: the core
                self._start_build()
        core = self.core
        if core is not None and core.active:
            out += core.steps(timeout)
            if not self._weights_dropped:  # its first pass repacked them: the file's pages are dead
                self._weights_dropped = True
                drop_mapped_pages(str(model_xml(self.artifact).with_suffix(".bin")))
            if not core.alive:  # its requests failed; the start tier serves, a new core is built
                core.close()
                self.core = None
        if self._rebuild and self.core is not None and not self.core.active:
            self.core.close()  # drained: a core LoRA-able for every kept adapter takes its place
            self.core = None
            self._start_build()
        self._let_start_go()
        return out

    def poll_tier_up(self) -> TieredUp | None:
        """A finished build, once (the worker tells the engine)."""
        self._adopt_core()
        self._let_start_go()
        up, self._tiered_up = self._tiered_up, None
        return up

    def tier_up_now(self) -> TieredUp | None:
        """`TierUpNow` (the node is idle): build the core with its warm-up (`poll_tier_up`
        answers), or with nothing to build, the answer now."""
        self._adopt_core()
        if self.core is None and self.build is None and not self.build_failed:
            self._start_build(idle=True)
        if self.build is not None:
            return None
        return TieredUp(self.tier, 0.0, "" if self.core is not None else "its continuous-batching core failed to build")

    def release(self) -> bool:
        """Let the start tier's idle infer request go (a session was dropped)."""
        if self.start is not None and self.start.release():
            trim_heap()
            return True
        return False

    def close(self) -> None:
        self._closed = True
        if self.build is not None:
            self.build.done.wait(CLOSE_BUILD_S)
            self.build = None
        for batch in (self.start, self.core):
            if batch is not None:
                batch.close()
        self.start = self.core = None
        self._for_core.clear()
        self._failed.clear()
        self._idle()

    def _start_batch(self, loaded: LoadedModel) -> StartBatch:
        return StartBatch(
            loaded.compiled,
            loaded.eos_ids,
            loaded.artifact.context_length,
            self._turns,
            self.max_batch,
            self.join_recompute_tokens,
        )

    def _to_start(self, request: Request) -> None:
        if self.start is None:  # let go once the core served everything: loaded again
            self.start = self._start_batch(self._reload())
        self.start.add(request.request_id, request.prompt_ids, request.params, request.deadline, request.kv_tokens)

    def _start_tiers_up(self) -> None:
        """After the start's first batch, its share ends and the core builds. Not sooner: its
        CPU beside the first prefill cost the cold start ≈ 0.1 s. Not later, on an idle node
        only: builds then ran beside start-tier batches far more often (measured)."""
        if self._first_batch_done is not None:
            done, self._first_batch_done = self._first_batch_done, None
            done()
        self._start_build()

    def _start_build(self, idle: bool = False) -> None:
        """Only on an idle node does the build warm up too: beside requests, the CPU is theirs."""
        if self.build is not None or self.core is not None or self.build_failed or self._closed:
            return
        self._rebuild = False
        self.cover = kept_adapters(self.artifact)
        self.build = _CoreBuild(self.artifact.path, self.device, self.threads, warm=idle, adapters=self.cover.files)
        self.build_window = (self.build.began, math.inf)

    def _adopt_core(self) -> None:
        """A finished build: the core takes over (or, failed, the start tier keeps everything)."""
        build = self.build
        if build is None or not build.done.is_set():
            return
        self.build = None
        self.build_window = (self.build_window[0], time.monotonic())
        waiting = list(self._for_core.values())
        self._for_core.clear()
        if build.pipeline is not None and not self._closed:
            self.core = CoreBatch(
                build.pipeline,
                self.tokenizer.eos_token_id,
                self.vocab_size,
                self.artifact.context_length,
                self._turns,
                lora=bool(build.adapters),
            )
            self._weights_dropped = False  # a new core maps the file again
            for r in [*waiting, *(self.start.hand_over(needs_logits) if self.start is not None else [])]:
                adapter = self._adapter_of.pop(r.request_id, None)
                try:
                    if adapter is not None and not self._covers(adapter):
                        # Registered while this core built: wait for one built for it.
                        self._for_core[r.request_id], self._adapter_of[r.request_id] = r, adapter
                        self._rebuild = True
                        continue
                    self.core.add(r.request_id, r.prompt_ids, r.params, r.deadline, adapter=adapter)
                except Exception as e:  # a spec the library refuses: that request fails alone
                    self._failed.append(Step(r.request_id, (), None, f"{type(e).__name__}: {e}"))
        else:
            self.build_failed = True
            for r in waiting:
                if self._adapter_of.pop(r.request_id, None) is not None:
                    self._failed.append(Step(r.request_id, (), None, NO_ADAPTER))
                elif r.params.guide is not None:
                    self._failed.append(Step(r.request_id, (), None, NO_GRAMMAR))
                else:
                    self._to_start(r)
        self._tiered_up = TieredUp(self.tier, build.seconds, build.error)

    def _covers(self, adapter: AdapterRef) -> bool:
        kept = read_manifest(Path(adapter.path))
        return kept is not None and self.cover.covers(kept)

    def _let_start_go(self) -> None:
        """The core serves everything: the start tier's memory goes back."""
        if self.core is not None and self.start is not None and not self.start.active:
            self.start.close()
            self.start = None
            trim_heap()


def ir_vocab_size(core: ov.Core, artifact: Artifact) -> int:
    """The STEADY IR's vocabulary, read without compiling it."""
    model = core.read_model(str(model_xml(artifact, Tier.STEADY)))
    return int(model.output("logits").get_partial_shape()[-1].get_length())
