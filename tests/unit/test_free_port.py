"""`ops.localcluster.free_port`: a port a service can bind in a moment, outside the range the
kernel hands out as the local ports of outbound connections (one of those took an engine's
port between its choice and its bind, in CI)."""

from __future__ import annotations

import socket

import pytest

from ops import localcluster
from ops.localcluster import ephemeral_ports, free_port


def test_a_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    eph = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert not ports & set(eph)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        # The draw lands on the port in use first: the one handed out is the next draw.
        draws = iter([taken, taken, taken + 1 if taken + 1 not in ephemeral_ports() else taken - 1])
        monkeypatch.setattr(localcluster._PORTS, "choice", lambda _: next(draws))
        assert free_port() != taken


def test_no_port_is_handed_out_twice_even_when_the_random_module_is_reseeded() -> None:
    # A test framework reseeds `random` (Hypothesis does): two clusters must still not be
    # promised the same ports before either binds them.
    import random

    ports = []
    for _ in range(5):
        random.seed(0)
        ports.append(free_port())
    assert len(set(ports)) == len(ports)
