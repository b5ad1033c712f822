"""`ops.localcluster.free_port`: a port a service can bind in a moment, outside the range the
kernel hands out as the local ports of outbound connections (one of those took an engine's
port between its choice and its bind, in CI)."""

from __future__ import annotations

import socket
from pathlib import Path

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


def test_a_gateway_port_chosen_by_the_caller_is_never_drawn_for_another_service(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # `tessera up --port P`: P was chosen in another process, free until the gateway binds it.
    # The cluster's own draws (NATS, Valkey, the services' HTTP ports) must not land on it: CI
    # saw the gateway refused its port, taken by a service of its own cluster that bound first.
    eph = ephemeral_ports()
    below = [p for p in range(20000, 20200) if p not in eph]
    chosen = below[0]
    draws = iter([chosen, *below[1:]])
    monkeypatch.setattr(localcluster._PORTS, "choice", lambda _: next(draws))
    monkeypatch.setattr(localcluster, "_HANDED_OUT", set())
    cluster = localcluster.LocalCluster(home=tmp_path, gateway_port=chosen)
    assert cluster.gateway_port == chosen
    assert chosen not in {cluster.nats_port, cluster.valkey_port, free_port()}
