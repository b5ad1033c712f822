"""Input an adversarial client sends, against the real gateway over raw sockets where the HTTP
framing itself is the attack: each is refused with a 400 in OpenAI format (or the connection
closed), never a 500, a dropped keep-alive connection or a request read out of another's body."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from typer.testing import CliRunner

from ops import cli
from ops.localcluster import LocalCluster, default_model_path
from tests.helpers.cluster import register

WAIT_S = 60.0
"""Longest a socket read waits: generous, a bound on a hang rather than a timing."""


def _connect(cluster: LocalCluster) -> socket.socket:
    url = urlsplit(cluster.base_url)
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=WAIT_S)
    return sock


def _read_response(sock: socket.socket, buffered: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response off the socket (Content-Length framed, as the gateway's JSON answers are);
    what follows it stays in `buffered`."""
    while b"\r\n\r\n" not in buffered:
        data = sock.recv(65536)
        assert data, f"the server closed the connection mid-response: {bytes(buffered)!r}"
        buffered += data
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        data = sock.recv(65536)
        assert data, "the server closed the connection mid-body"
        rest += data
    buffered[:] = rest[length:]
    return int(status_line.split()[1]), headers, rest[:length]


def _post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def test_a_unicode_digit_logit_bias_key_is_a_400_and_the_connection_serves_the_next_request(
    cluster: LocalCluster, model: str
) -> None:
    with _connect(cluster) as sock:
        buffered = bytearray()
        bad = {"model": model, "prompt": "Hi", "max_tokens": 1, "logit_bias": {"²": 5}}
        sock.sendall(_post("/v1/completions", bad))
        status, headers, body = _read_response(sock, buffered)
        assert status == 400, body
        assert json.loads(body)["error"]["param"].startswith("logit_bias")
        assert headers.get("connection") != "close"
        # The same connection, kept alive, answers the next request.
        sock.sendall(_post("/tokenize", {"model": model, "prompt": "Hi"}))
        status, _, body = _read_response(sock, buffered)
        assert status == 200, body
        assert json.loads(body)["count"] >= 1


def test_registering_a_taken_name_is_409_unless_the_registration_asks_to_replace(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    name = "taken-name"
    source = str(default_model_path())
    models = f"{cluster.base_url}/admin/models"

    def kept_alive() -> float:
        listed = {m["name"]: m for m in httpx.get(models, timeout=10).json()}
        return float(listed[name]["keep_alive_s"])

    try:
        assert register(cluster, name, keep_alive_s=30.0)["keep_alive_s"] == 30.0
        again = httpx.post(models, json={"name": name, "source": source, "keep_alive_s": 40.0}, timeout=600)
        assert again.status_code == 409, again.text
        error = again.json()["error"]
        assert error["code"] == "model_exists" and error["param"] == "name" and "replace" in error["message"]
        assert kept_alive() == 30.0  # the first registration stands
        assert register(cluster, name, keep_alive_s=40.0, replace=True)["keep_alive_s"] == 40.0
        assert kept_alive() == 40.0

        # `tessera models add` the same: refused, then replaced with --replace.
        runner = CliRunner()
        args = ["models", "add", name, source, "--keep-alive-s", "50", "--url", cluster.base_url]
        refused = runner.invoke(cli.app, [*args, "--home", str(tmp_path)])
        assert refused.exit_code == 1 and "409" in refused.output, refused.output
        assert kept_alive() == 40.0
        replaced = runner.invoke(cli.app, [*args, "--replace", "--home", str(tmp_path)])
        assert replaced.exit_code == 0, replaced.output
        assert kept_alive() == 50.0
    finally:
        httpx.delete(f"{models}/{name}", timeout=10)


def test_a_request_framed_both_by_length_and_chunked_is_400_and_no_request_is_read_from_its_body(
    cluster: LocalCluster, model: str
) -> None:
    hidden = _post("/tokenize", {"model": model, "prompt": "smuggled"})
    smuggling = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {5 + len(hidden)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        + b"0\r\n\r\n"
        + hidden
    )
    with _connect(cluster) as sock:
        sock.sendall(smuggling)
        received = b""
        while data := sock.recv(65536):  # until the gateway closes the connection
            received += data
    assert received.startswith(b"HTTP/1.1 400 ")
    assert received.count(b"HTTP/1.1 ") == 1 and b'"count"' not in received


def test_a_bad_source_is_a_400_with_a_bounded_message_and_a_loader_warning_without_traceback(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    loop = tmp_path / "loop.gguf"
    loop.symlink_to(loop)
    too_long = f"/tmp/{'n' * 4000}.gguf"  # one name past NAME_MAX (255): ENAMETOOLONG
    log = cluster.procs["loader@node-0"].log_path
    seen = log.stat().st_size
    for name, source, why in (("loop", str(loop), "symlink loop"), ("long", too_long, "too long")):
        r = httpx.post(f"{cluster.base_url}/admin/models", json={"name": f"bad-{name}", "source": source}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "source" and why in error["message"].lower()
        assert len(error["message"]) < 500  # the 4,000-character path is cut, not echoed whole
    with log.open("rb") as f:
        f.seek(seen)
        lines = [json.loads(line) for line in f.read().decode().splitlines() if line.startswith("{")]
    refused = [line for line in lines if "import refused" in line["message"]]
    assert len(refused) == 2, lines
    for line in refused:
        assert line["level"] == "WARNING" and "exc_info" not in line
        assert len(line["message"]) < 500
    assert not [line for line in lines if line["level"] == "ERROR"]
