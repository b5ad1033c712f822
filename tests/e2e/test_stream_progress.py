"""Progress in the stream (issue 35, part 4) on a cluster of its own, where nothing else holds
the model's weights: a streamed request to a cold model receives the start's progress as SSE
comments whose percentages never go back and end at 100, and the official `openai` client
parses that stream without error; `/v1/models` says cold → loading → loaded → cold."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from ops.localcluster import LocalCluster
from tests.conftest import start_cluster
from tests.helpers.cluster import loaded_models, register, wait_for

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
COMMENT = re.compile(r": tessera loading phase=(init|load|profile|ready) ([0-9]{1,3})% eta=(\?|[0-9]+\.[0-9]s)")


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    """Its own cluster; the engine reports a start's load every 20 ms (a start here takes under
    a second: its load phase then shows bytes read, not only its phase changes)."""
    c = start_cluster(tmp_path_factory.mktemp("progress"), model_store, TESSERA_PROGRESS_INTERVAL_S="0.02")
    try:
        yield c
    finally:
        c.stop()


class Tee(httpx2.BaseTransport):
    """The lines of every response as they stream, each handed to `on_line` (the openai client
    reads the same stream and never sees what this keeps; it is built on `httpx2`, as the
    client is)."""

    def __init__(self, on_line: Callable[[str], None] = lambda _: None) -> None:
        self.inner = httpx2.HTTPTransport()
        self.on_line = on_line
        self.lines: list[str] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.inner.handle_request(request)
        return httpx2.Response(
            response.status_code, headers=response.headers, stream=_Teed(self, response), extensions=response.extensions
        )


class _Teed(httpx2.SyncByteStream):
    def __init__(self, tee: Tee, response: httpx2.Response) -> None:
        self.tee, self.response, self.partial = tee, response, b""

    def __iter__(self) -> Iterator[bytes]:
        assert isinstance(self.response.stream, httpx2.SyncByteStream)
        for chunk in self.response.stream:
            *lines, self.partial = (self.partial + chunk).split(b"\n")
            for line in lines:
                self.tee.lines.append(line.decode())
                self.tee.on_line(line.decode())
            yield chunk

    def close(self) -> None:
        self.response.close()


def percents(lines: list[str]) -> list[int]:
    return [int(m.group(2)) for line in lines if (m := COMMENT.fullmatch(line))]


def states(cluster: LocalCluster) -> dict[str, str]:
    cards = httpx.get(f"{cluster.base_url}/v1/models", timeout=10).json()["data"]
    return {c["id"]: c.get("status") for c in cards}


def cold_from_the_store(cluster: LocalCluster, aid: str) -> None:
    """Nothing holds the artifact's weights (an earlier test's model ran on them), so the next
    start loads them: every model scaled to zero, every cache dropped, a worker prewarmed."""
    wait_for(lambda: not loaded_models(cluster), 60, "every model to scale to zero")
    httpx.post(f"{cluster.base_url}/admin/cache/evict?tier=all", timeout=30).raise_for_status()

    def cold_and_prewarmed() -> bool:
        nodes = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()["nodes"]
        return all(aid not in n["resident"] and n["prewarmed"] > 0 for n in nodes)

    wait_for(cold_and_prewarmed, 60, "the evicted weights to leave the view and a worker to be prewarmed")


def _client(cluster: LocalCluster, tee: Tee) -> openai.OpenAI:
    """The official client, its traffic seen by `tee` (comment lines included)."""
    return openai.OpenAI(
        base_url=f"{cluster.base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=300,
        http_client=openai.DefaultHttpxClient(transport=tee),
    )


def test_a_cold_stream_shows_its_start_rising_and_parses_with_the_openai_client(own_cluster: LocalCluster) -> None:
    name = "progress-smollm"
    register(own_cluster, name, keep_alive_s=1.0)
    tee = Tee()
    client = _client(own_cluster, tee)
    chunks = list(client.chat.completions.create(model=name, messages=HI, max_tokens=4, stream=True))
    assert chunks and all(c.model == name for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason is not None

    comments = [line for line in tee.lines if line.startswith(": tessera loading")]
    assert comments and all(COMMENT.fullmatch(c) for c in comments), comments
    pct = percents(comments)
    assert pct == sorted(pct), comments  # never back
    assert pct[-1] >= 90, comments  # ends at (or near) the whole
    # From the engine's phases (its load reads the weights: this start read them from the store).
    assert any("phase=load" in c for c in comments), comments
    # Every comment came before the answer; the start's cost followed them.
    first_data = next(i for i, line in enumerate(tee.lines) if line.startswith("data: "))
    assert max(i for i, line in enumerate(tee.lines) if line.startswith(": tessera loading")) < first_data
    assert any(line.startswith(": tessera cold-start source=") for line in tee.lines[:first_data])


def test_models_say_cold_then_loading_then_loaded_then_cold(own_cluster: LocalCluster) -> None:
    name = "states-smollm"
    record = register(own_cluster, name, keep_alive_s=1.0)
    cold_from_the_store(own_cluster, str(record["artifact"]["artifact_id"]))  # type: ignore[index]
    assert states(own_cluster)[name] == "cold"

    # Read while its start is under way: at its first comments (before its load is done).
    seen: list[str] = []

    def on_line(line: str) -> None:
        m = COMMENT.fullmatch(line)
        if m and m.group(1) in ("init", "load") and not seen:
            seen.append(states(own_cluster)[name])

    tee = Tee(on_line)
    with httpx2.Client(transport=tee, timeout=300) as http:
        r = http.post(
            f"{own_cluster.base_url}/v1/chat/completions",
            json={"model": name, "messages": HI, "max_tokens": 2, "stream": True},
        )
    assert r.status_code == 200 and tee.lines[-2:] == ["data: [DONE]", ""], tee.lines[-3:]
    assert seen == ["loading"], (seen, tee.lines)
    assert states(own_cluster)[name] == "loaded"
    wait_for(lambda: name not in loaded_models(own_cluster), 60, f"{name} to scale to zero")
    assert states(own_cluster)[name] == "cold"


def test_a_cold_responses_stream_shows_its_start_and_parses_with_the_openai_client(own_cluster: LocalCluster) -> None:
    name = "responses-smollm"
    record = register(own_cluster, name, keep_alive_s=1.0)
    cold_from_the_store(own_cluster, str(record["artifact"]["artifact_id"]))  # type: ignore[index]
    tee = Tee()
    client = _client(own_cluster, tee)
    events = list(client.responses.create(model=name, input="Hi", max_output_tokens=4, stream=True))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    pct = percents(tee.lines)
    assert pct and pct == sorted(pct) and pct[-1] >= 90, tee.lines[:40]
