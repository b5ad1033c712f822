"""Input an adversarial client sends, against the real gateway over raw sockets where the HTTP
framing itself is the attack: each is refused with a 400 in OpenAI format (or the connection
closed), never a 500, a dropped keep-alive connection or a request read out of another's body."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

from ops.localcluster import LocalCluster

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
