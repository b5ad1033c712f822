"""A TCP relay between a cluster's gateway and NATS that a test can cut: from the cut on it
drops whole frames the server sends, and once a token-stream chunk is among them it closes the
connection (nats-py reconnects through it), so chunks published meanwhile never reach the
gateway."""

from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass, field

from ops.localcluster import LocalCluster
from shared.bus import decode
from shared.messages import StreamEvent, TokenChunk


def split_frames(buf: bytes) -> tuple[list[tuple[bytes, bytes, bytes]], bytes]:
    """NATS protocol frames (frame, subject, payload) whole in `buf`, and the rest."""
    frames = []
    while (end := buf.find(b"\r\n")) >= 0:
        line = buf[:end]
        op = line.split(b" ", 1)[0].upper()
        if op in (b"MSG", b"HMSG", b"PUB", b"HPUB"):
            fields = line.split()
            total = int(fields[-1])
            stop = end + 2 + total + 2
            if len(buf) < stop:
                break
            payload = buf[end + 2 : end + 2 + total]
            if op in (b"HMSG", b"HPUB"):
                payload = payload[int(fields[-2]) :]  # headers first
            frames.append((buf[:stop], fields[1], payload))
        else:
            stop = end + 2
            frames.append((buf[:stop], line.split(b" ")[1] if op in (b"SUB", b"UNSUB") else b"", b""))
        buf = buf[stop:]
    return frames, buf


@dataclass
class Cut:
    prefix: bytes
    dropped: list[TokenChunk] = field(default_factory=list)
    """Token-stream chunks the server sent the gateway that the relay dropped."""
    closed: threading.Event = field(default_factory=threading.Event)
    resubscribed: threading.Event = field(default_factory=threading.Event)
    """A connection made after the cut subscribed to a token stream again."""
    resubscribed_at: float = math.inf


class _Relay:
    def __init__(self, client: socket.socket, upstream: socket.socket, after: Cut | None) -> None:
        self.client, self.upstream = client, upstream
        self.cut: Cut | None = None
        self.after = after
        """The cut that came before this connection (it watches for resubscriptions)."""

    def close(self) -> None:
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class NatsProxy:
    """A TCP relay between the gateway and NATS. `cut()`: from then on it forwards nothing the
    server sends (whole frames are dropped), and once a chunk of a token stream is among them
    it closes the connection. nats-py reconnects through it, forwarded as before."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.relays: list[_Relay] = []
        self.last_cut: Cut | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            relay = _Relay(client, upstream, self.last_cut)
            with self._lock:
                self.relays.append(relay)
            threading.Thread(target=self._down, args=(relay,), daemon=True).start()
            threading.Thread(target=self._up, args=(relay,), daemon=True).start()

    def cut(self, prefix: str) -> Cut:
        cut = Cut(prefix.encode())
        with self._lock:
            self.last_cut = cut
            for relay in self.relays:
                relay.cut = cut
        return cut

    def _down(self, relay: _Relay) -> None:  # server → gateway
        buf = b""
        try:
            while data := relay.upstream.recv(65536):
                frames, buf = split_frames(buf + data)
                cut = relay.cut
                if cut is None:
                    relay.client.sendall(b"".join(f for f, _, _ in frames))
                    continue
                for _, subject, payload in frames:
                    if subject.startswith(cut.prefix):
                        event = decode(payload, StreamEvent)
                        if isinstance(event, TokenChunk):
                            cut.dropped.append(event)
                if cut.dropped:
                    relay.close()
                    cut.closed.set()
                    return
        except OSError:
            pass
        relay.close()

    def _up(self, relay: _Relay) -> None:  # gateway → server
        buf = b""
        try:
            while data := relay.client.recv(65536):
                relay.upstream.sendall(data)
                after = relay.after
                if after is None or after.resubscribed.is_set():
                    continue
                frames, buf = split_frames(buf + data)
                if any(f.startswith(b"SUB ") and s.startswith(after.prefix) for f, s, _ in frames):
                    after.resubscribed_at = time.monotonic()
                    after.resubscribed.set()
        except OSError:
            pass
        relay.close()

    def close(self) -> None:
        self.server.close()
        with self._lock:
            for relay in self.relays:
                relay.close()


class GatewayBehindProxy(LocalCluster):
    """A local cluster whose gateway reaches NATS through `proxy` (every other service
    directly)."""

    proxy: NatsProxy

    def gateway_env(self, port: int) -> dict[str, str]:
        env = super().gateway_env(port)
        env["TESSERA_NATS_URL"] = self.proxy.url
        return env
