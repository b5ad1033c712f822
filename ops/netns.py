"""Several hosts on one machine: each node in a network namespace of its own, all joined by a
bridge, every node's link shaped by `tc` (a token-bucket filter each way), so that moving a
model between nodes is bound by the network as between real hosts, not by the loopback's
memory copy (FaaScale's setting; bench/multicast.py, tests/e2e/test_multicast.py).

    root namespace: veth 10.<a>.<b>.1/24 (NATS and Valkey listen here)
      └─ namespace tsr<tag>-sw: bridge tsr<tag> (the switch)
           └─ veth ── namespace tsr<tag>-n<i>: 10.<a>.<b>.<10+i>/24, egress shaped to the
              link, and the switch's port to it too (what the node receives)

Needs root and `ip`/`tc` with namespaces permitted; `unavailable()` says why not, for a test
to skip with. Every name carries a tag unique to the cluster, and `teardown` removes exactly
what `setup` made.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"tsr-probe-{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` is not permitted here: {getattr(e, 'stderr', '') or e}"
    try:
        _run("ip", "netns", "del", probe)
    except (subprocess.CalledProcessError, OSError):
        pass
    return None


def _shape(where: list[str], dev: str, rate: str) -> None:
    """A token bucket at `rate` on what `dev` sends (`where`: the namespace's command prefix)."""
    _run(*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms")


@dataclass
class NetNamespaces:
    """One namespace per node name, on a bridge of their own, links shaped to `link_mbit`."""

    key: str
    """Makes the names and the subnet unique to one cluster (its home directory, say)."""
    nodes: list[str]
    link_mbit: float
    root_mbit: float = 0.0
    """The root namespace's uplink to the switch, shaped too where > 0: a server the root
    runs (a model store in bench/multicast.py) then sends at a node's rate, not the host's."""
    made: list[tuple[str, ...]] = field(default_factory=list)
    """What `setup` created, to undo in reverse."""

    def __post_init__(self) -> None:
        digest = hashlib.sha1(self.key.encode()).digest()
        self.tag = digest[:3].hex()  # short: interface names are at most 15 characters
        self._net = f"10.{100 + digest[3] % 100}.{digest[4]}"

    @property
    def host_ip(self) -> str:
        """The root namespace's address on the switch: where its servers (NATS, Valkey) listen."""
        return f"{self._net}.1"

    def ip(self, node: str) -> str:
        return f"{self._net}.{10 + self.nodes.index(node)}"

    def namespace(self, node: str) -> str:
        return f"tsr{self.tag}-n{self.nodes.index(node)}"

    def prefix(self, node: str) -> list[str]:
        """What a command is run under to run inside the node's namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def setup(self) -> None:
        if len(self.nodes) > 200:
            raise ValueError("at most 200 nodes on one bridge")
        # The bridge lives in a namespace of its own (the switch), not in the root one: there,
        # bridged frames go through the host's firewall wherever br_netfilter is loaded, and
        # Docker's FORWARD policy drops them. The root namespace joins the switch by a veth
        # pair of its own, so what it sends and receives is its own traffic, not forwarded.
        switch = f"tsr{self.tag}-sw"
        bridge = f"tsr{self.tag}"
        rate = f"{self.link_mbit}mbit"
        try:
            _run("ip", "netns", "add", switch)
            self.made.append(("ip", "netns", "del", switch))
            sw = ["ip", "netns", "exec", switch]
            _run(*sw, "ip", "link", "add", bridge, "type", "bridge")
            _run(*sw, "ip", "link", "set", bridge, "up")
            root_side, root_port = f"tsr{self.tag}r", f"tsr{self.tag}s"
            _run("ip", "link", "add", root_side, "type", "veth", "peer", "name", root_port)
            self.made.append(("ip", "link", "del", root_side))
            _run("ip", "link", "set", root_port, "netns", switch)
            _run(*sw, "ip", "link", "set", root_port, "master", bridge)
            _run(*sw, "ip", "link", "set", root_port, "up")
            _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", root_side)
            _run("ip", "link", "set", root_side, "up")
            if self.root_mbit > 0:
                _shape([], root_side, f"{self.root_mbit}mbit")
            for i, node in enumerate(self.nodes):
                ns = self.namespace(node)
                port, node_side = f"tsr{self.tag}h{i}", f"tsr{self.tag}v{i}"
                _run("ip", "netns", "add", ns)
                self.made.append(("ip", "netns", "del", ns))
                inside = ["ip", "netns", "exec", ns]
                _run("ip", "link", "add", port, "type", "veth", "peer", "name", node_side)
                self.made.append(("ip", "link", "del", port))  # gone with a namespace, or not
                _run("ip", "link", "set", node_side, "netns", ns)
                _run("ip", "link", "set", port, "netns", switch)
                self.made[-1] = ("ip", "netns", "exec", switch, "ip", "link", "del", port)
                _run(*sw, "ip", "link", "set", port, "master", bridge)
                _run(*sw, "ip", "link", "set", port, "up")
                _run(*inside, "ip", "link", "set", "lo", "up")
                _run(*inside, "ip", "addr", "add", f"{self.ip(node)}/24", "dev", node_side)
                _run(*inside, "ip", "link", "set", node_side, "up")
                # The node's uplink (what it sends) and downlink (what the switch sends it),
                # each a token bucket at the link's rate.
                for where, dev in ((inside, node_side), (sw, port)):
                    _shape(where, dev, rate)
        except BaseException:
            self.teardown()
            raise

    def teardown(self) -> None:
        while self.made:
            argv = self.made.pop()
            try:
                _run(*argv)
            except (subprocess.CalledProcessError, OSError):
                pass  # gone with its namespace already
