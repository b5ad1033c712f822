"""Bad input against a real gateway (auth off) on a cluster of its own, whose loader may only
read models from one directory: schemathesis fuzzing of the OpenAPI schema, body and prompt size
limits, model sources outside the allowed directories, control characters and text that is not
Unicode, and out-of-range numbers. Every answer is a 2xx or a 4xx in OpenAI format, never a 5xx
and never a hang.

Covered elsewhere, not repeated here: malformed JSON, missing fields, `max_tokens` 0 and prompt
plus `max_tokens` over the context (tests/e2e/test_openai_api.py); the 413 before parsing with a
Content-Length, unsafe model names (tests/gateway/test_gateway_inprocess.py)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode

from ops.localcluster import LocalCluster, default_model_path
from tests.conftest import start_cluster
from tests.helpers.cluster import on_the_core

MODEL = "bad-input-model"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def allowed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The only directory the loader may import from, with the model GGUF in it."""
    d = tmp_path_factory.mktemp("allowed-models")
    try:
        os.link(default_model_path(), d / "model.gguf")
    except OSError:
        shutil.copyfile(default_model_path(), d / "model.gguf")
    return d


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, model_store: Path, allowed_dir: Path) -> Iterator[LocalCluster]:
    c = start_cluster(
        tmp_path_factory.mktemp("bad-input"), model_store, TESSERA_ALLOWED_MODEL_DIRS=json.dumps([str(allowed_dir)])
    )
    try:
        r = httpx.post(
            f"{c.base_url}/admin/models", timeout=600, json={"name": MODEL, "source": str(allowed_dir / "model.gguf")}
        )
        assert r.status_code == 201, r.text
        # Started and on its core before any case: the fuzzed requests' 15 s is not a cold start's.
        on_the_core(c, MODEL)
        yield c
    finally:
        c.stop()


def post(c: LocalCluster, path: str, content: bytes | Any, timeout: float = 60, **kw: Any) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{c.base_url}{path}", content=content, headers=headers, timeout=timeout, **kw)


def chat(c: LocalCluster, content: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    return post(c, CHAT, json.dumps(body).encode())


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["message"] and err["type"], err
    return err


# --- fuzzing ----------------------------------------------------------------------------------

GENERATION = {"/v1/chat/completions", "/v1/completions"}


def _on_the_model(case: Any) -> Any:
    """Valid completions name the registered model (else nearly all are 404s), with a small
    `max_tokens` so that each one is quick: the fuzzed fields then reach the engine."""
    if isinstance(case.body, dict):
        case.body["model"] = MODEL
        if not isinstance(case.body.get("max_tokens"), int) or case.body["max_tokens"] > 4:
            case.body["max_tokens"] = 4
        case.body.pop("max_completion_tokens", None)
    return case


def _fuzz(base_url: str, op: Any, mode: GenerationMode, failures: list[str]) -> int:
    """Run one operation's generated cases; record each 5xx, hang or non-OpenAI error."""
    generation = op.path in GENERATION
    strategy = op.as_strategy(generation_mode=mode)
    if generation and mode is GenerationMode.POSITIVE:
        strategy = strategy.map(_on_the_model)
    where = f"{op.method.upper()} {op.path} ({mode.value})"
    calls = 0

    @settings(
        max_examples=60 if generation else 15,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        nonlocal calls
        calls += 1
        sent = f"{case.path_parameters!r} {case.query!r} {case.body!r}"[:300]
        try:
            r = case.call(base_url=base_url, timeout=15)
        except Exception as e:
            failures.append(f"{where}: {type(e).__name__} for {sent}")
            return
        if r.status_code >= 500:
            failures.append(f"{where}: {r.status_code} {r.text[:200]} for {sent}")
        elif r.status_code >= 400 and r.status_code != 405:
            err = r.json().get("error")
            if not (isinstance(err, dict) and err.get("message") and err.get("type")):
                failures.append(f"{where}: not an OpenAI error: {r.text[:200]}")

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE  # an operation with no input has no invalid one
    return calls


def test_schemathesis_finds_no_5xx_and_no_hang(guarded: LocalCluster) -> None:
    schema = schemathesis.openapi.from_url(f"{guarded.base_url}/openapi.json")
    failures: list[str] = []
    calls = 0
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            calls += _fuzz(guarded.base_url, result.ok(), mode, failures)
    assert calls > 150
    assert not failures, "\n".join(failures[:20])
    # The fuzzing left the model registered and serving.
    assert chat(guarded, "Hi").status_code == 200


# --- sizes ------------------------------------------------------------------------------------


def test_body_over_4_mib_is_413_with_a_length_and_chunked(guarded: LocalCluster) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (5 * 1024 * 1024)}).encode()
    assert openai_error(post(guarded, "/v1/completions", big), 413)["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit still holds
        for i in range(0, len(big), 64 * 1024):
            yield big[i : i + 64 * 1024]

    assert openai_error(post(guarded, "/v1/completions", chunks()), 413)["code"] == "body_too_large"


def test_a_chunked_body_under_the_limit_is_served(guarded: LocalCluster) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}).encode()
    r = post(guarded, "/v1/completions", iter([body[:10], body[10:]]))
    assert r.status_code == 200, r.text


def test_a_prompt_over_the_context_is_400_in_openai_format(guarded: LocalCluster) -> None:
    r = chat(guarded, "hello " * 9000)  # ≈ 9000 tokens, under the body limit, over 8192
    err = openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "8192" in err["message"]


@pytest.mark.parametrize("extra", [{"max_tokens": 10**30}, {"max_tokens": 8192}, {"max_completion_tokens": 10**6}])
def test_a_huge_max_tokens_is_400_over_the_context(guarded: LocalCluster, extra: dict[str, int]) -> None:
    err = openai_error(chat(guarded, "Hi", **extra), 400)
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("extra", [{"max_completion_tokens": 0}, {"max_tokens": -1}])
def test_a_max_tokens_under_1_is_400(guarded: LocalCluster, extra: dict[str, int]) -> None:
    err = openai_error(chat(guarded, "Hi", **extra), 400)
    assert err["type"] == "invalid_request_error" and err["param"] in extra


def test_max_tokens_0_on_text_completions_is_400(guarded: LocalCluster) -> None:
    r = post(guarded, "/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 0}).encode())
    assert openai_error(r, 400)["param"] == "max_tokens"


# --- model sources ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["outside", "symlink", "dotdot", "etc"])
def test_registration_cannot_read_outside_the_allowed_model_directories(
    guarded: LocalCluster,
    allowed_dir: Path,
    tmp_path: Path,
    where: str,
) -> None:
    outside = tmp_path / "elsewhere.gguf"
    if where in ("outside", "dotdot"):
        shutil.copyfile(default_model_path(), outside)
    link = allowed_dir / f"link-{os.getpid()}.gguf"
    source = {
        "outside": str(outside),  # a real GGUF, but not under the allowed directory
        "symlink": str(link),  # in the allowed directory, pointing out of it
        "dotdot": f"{allowed_dir}/../{outside.relative_to(allowed_dir.parent)}",
        "etc": "/etc/passwd",
    }[where]
    if where == "symlink":
        link.unlink(missing_ok=True)
        link.symlink_to(default_model_path())
    try:
        r = httpx.post(
            f"{guarded.base_url}/admin/models", json={"name": f"escape-{where}", "source": source}, timeout=60
        )
    finally:
        link.unlink(missing_ok=True)
    err = openai_error(r, 400)
    assert "outside the allowed model directories" in err["message"] and err["param"] == "source"
    names = [m["name"] for m in httpx.get(f"{guarded.base_url}/admin/models", timeout=10).json()]
    assert f"escape-{where}" not in names


@pytest.mark.parametrize(
    "source", ["relative/model.gguf", "~nosuchuser/model.gguf", "/tmp/a\x00b.gguf", "/tmp/\ud800.gguf"]
)
def test_a_source_that_is_no_absolute_path_is_a_clear_400_at_once(guarded: LocalCluster, source: str) -> None:
    body = json.dumps({"name": "bad-source", "source": source}).encode()  # \ud800 escaped by json
    err = openai_error(post(guarded, "/admin/models", body, timeout=10), 400)
    assert err["param"] == "source"


# --- text that is not text --------------------------------------------------------------------


@pytest.mark.parametrize("content", ["a\u0000b", "\u0001\u0007\u001b[31m red", "\u202e\ufeff\u200b", "\uffff"])
def test_control_characters_in_a_prompt_are_served(guarded: LocalCluster, content: str) -> None:
    r = chat(guarded, content)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"caf\xe9"])
def test_a_body_that_is_not_utf8_is_400(guarded: LocalCluster, raw: bytes) -> None:
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "' % MODEL.encode() + raw + b'"}]}'
    openai_error(post(guarded, CHAT, body), 400)


@pytest.mark.parametrize("field", ["content", "stop", "prompt", "part"])
def test_a_lone_surrogate_is_400_not_500(guarded: LocalCluster, field: str) -> None:
    # Valid JSON ("\ud800" escaped), but no Unicode text: nothing after the gateway can encode it.
    bad = "\ud800"
    path, body = CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    if field == "content":
        body["messages"] = [{"role": "user", "content": bad}]
    elif field == "part":
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": bad}]}]
    elif field == "stop":
        body["stop"] = [bad]
    else:
        path, body = "/v1/completions", {"model": MODEL, "prompt": bad, "max_tokens": 2}
    err = openai_error(post(guarded, path, json.dumps(body).encode()), 400)
    assert err["param"].split(".")[0] == (
        "prompt" if field == "prompt" else field.replace("part", "messages").replace("content", "messages")
    )


def test_an_api_key_for_a_lone_surrogate_model_is_400(guarded: LocalCluster) -> None:
    r = post(guarded, "/admin/keys", json.dumps({"name": "k-surrogate", "models": ["\ud800"]}).encode())
    openai_error(r, 400)


# --- numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64 - 1])
def test_any_64_bit_seed_is_served_and_reproducible(guarded: LocalCluster, seed: int) -> None:
    # The prompt's prefix in the core's cache first: a prompt computed whole and one read back
    # from the prefix cache differ in the last bits of their logits, and at temperature 1 a
    # near-tie can fall either way (seen: 'Thesaurus text:' then 'Thesaurus Text:' for ever
    # after). A seed names one sample for one state of the cache, as OpenAI's best effort does.
    assert chat(guarded, "Say a word", max_tokens=1).status_code == 200
    texts = {
        chat(guarded, "Say a word", seed=seed, temperature=1.0, max_tokens=4).json()["choices"][0]["message"]["content"]
        for _ in range(2)
    }
    assert len(texts) == 1


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**40])
def test_a_seed_beyond_64_bits_is_400(guarded: LocalCluster, seed: int) -> None:
    assert openai_error(chat(guarded, "Hi", seed=seed), 400)["param"] == "seed"
