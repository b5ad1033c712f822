"""`tessera`: run the local cluster, manage models and API keys, see what runs where.

Every command but `up` talks to a gateway's admin API with the admin key: `--admin-key`, else
TESSERA_ADMIN_KEY, else the key `tessera up` saved under `--home`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ops.localcluster import (
    DEFAULT_MODEL_NAME,
    LocalCluster,
    admin_key_path,
    core_shares,
    load_admin_key,
)
from shared.messages import TTFT_SLO_PER_TOKEN_S, WeightFormat

app = typer.Typer(help="Tessera: serverless LLM inference.", no_args_is_help=True)
models = typer.Typer(help="Register, list and remove models.", no_args_is_help=True)
keys = typer.Typer(help="Make, list and revoke API keys.", no_args_is_help=True)
app.add_typer(models, name="models")
app.add_typer(keys, name="keys")
console = Console()

URL = typer.Option("http://127.0.0.1:8000", "--url", envvar="TESSERA_URL", help="Gateway URL.")
ADMIN_KEY = typer.Option(
    None,
    "--admin-key",
    envvar="TESSERA_ADMIN_KEY",
    show_default=False,
    help="Admin key (default: the one `tessera up` saved under --home).",
)
HOME = typer.Option(Path(".tessera"), "--home", help="Local cluster home (where its admin key is).")
MODELS = typer.Option([], "--model", "-m", help="A model the key may use (repeat); none: all.")
RPM = typer.Option(None, "--rpm", min=1, help="Requests per minute (default: no limit).")
TPM = typer.Option(None, "--tpm", min=1, help="Prompt + completion tokens per minute (default: no limit).")
METRICS = typer.Option(
    [],
    "--metrics",
    help="NODE=URL of a node service's HTTP port (loader, memory "
    "manager), repeatable: adds that node's host cache and memory from its /metrics.",
)
STARTS = typer.Option(10, min=1, max=200, help="Recent cold starts to show.")


@contextmanager
def _admin(url: str, admin_key: str | None, home: Path) -> Iterator[httpx.Client]:
    key = admin_key or load_admin_key(home.resolve())
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=30) as client:
        yield client


def _ok(r: httpx.Response) -> Any:
    """The answer's JSON, or its OpenAI error printed and exit status 1."""
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        console.print(f"[red]{r.status_code}: {message}[/]", highlight=False)
        raise typer.Exit(1)
    return r.json()


@contextlib.contextmanager
def _working(what: str) -> Iterator[None]:
    """A progress line for long work whose length is not known in advance (the import converts
    and compiles in one loader call): a pulsing bar and the time elapsed."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        progress.add_task(what, total=None)
        yield


@app.command()
def up(
    port: int = typer.Option(8000, help="Gateway port (the OpenAI API)."),
    home: Path = typer.Option(Path(".tessera"), help="Model store, Valkey data and logs."),
    nodes: int = typer.Option(1, min=1, help="Engine nodes to run."),
    auth: bool = typer.Option(
        True, "--auth/--no-auth", envvar="TESSERA_AUTH", help="Require API keys (TESSERA_AUTH=off runs open)."
    ),
    admin_key: str | None = ADMIN_KEY,
) -> None:
    """Start NATS, Valkey and every service; register the default model; wait for Ctrl-C."""
    shares, how = core_shares(nodes)
    cluster = LocalCluster(home=home, gateway_port=port, nodes=nodes, auth=auth, admin_key=admin_key, node_env=shares)
    if nodes > 1:
        console.print(f"{nodes} engine nodes, cores shared by {how}", highlight=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with console.status("starting NATS, Valkey and the services…"):
        cluster.start()
    try:
        with _working(f"importing {DEFAULT_MODEL_NAME} (converted and materialized once, then reused)"):
            cluster.register_default_model()
        url = cluster.base_url
        console.print(
            f"[bold green]Tessera is up[/] at [bold]{url}/v1[/]  (logs in {cluster.home / 'logs'})", soft_wrap=True
        )
        auth_header = ""
        if cluster.admin_key:
            console.print(
                f"admin key: [bold]{cluster.admin_key}[/]  (saved in "
                f"{admin_key_path(cluster.home)}; make API keys with `tessera keys add`)",
                soft_wrap=True,
                highlight=False,
            )
            auth_header = f"-H 'Authorization: Bearer {cluster.admin_key}' "
        console.print(
            f"curl {url}/v1/chat/completions {auth_header}-H 'Content-Type: application/json' "
            f'-d \'{{"model": "{DEFAULT_MODEL_NAME}", "messages": '
            f'[{{"role": "user", "content": "Say hello"}}]}}\'',
            soft_wrap=True,  # one line, ready to paste, whatever the terminal width
            highlight=False,
            markup=False,
        )
        console.print("Ctrl-C stops everything.")
        while not stop.wait(1.0):
            dead = [n for n, p in cluster.procs.items() if not p.alive()]
            if dead:
                console.print(f"[red]{', '.join(dead)} exited; stopping[/]")
                break
    finally:
        with console.status("stopping…"):
            cluster.stop()
        console.print("stopped; no process left behind")


@models.command("ls")
def models_ls(url: str = URL, admin_key: str | None = ADMIN_KEY, home: Path = HOME) -> None:
    with _admin(url, admin_key, home) as http:
        found = _ok(http.get("/admin/models"))
        # Each model's adapters, shown under it (an older gateway has no such route: none).
        adapters = {}
        for m in found:
            r = http.get(f"/admin/models/{m['name']}/adapters")
            adapters[m["name"]] = r.json() if r.status_code == 200 else []
        listed = http.get("/admin/aliases")
        aliases = listed.json() if listed.status_code == 200 else []  # an older gateway has none
    table = Table(
        "name",
        "artifact",
        "format",
        "context",
        "keep-alive s",
        "TTFT SLO s (L prompt tokens)",
        "TPOT SLO s",
        "kept warm",
        "defaults",
    )
    for m in found:
        table.add_row(*_model_cells(m))
        for a in adapters[m["name"]]:
            table.add_row(*_adapter_cells(a))
    console.print(table)
    if aliases:
        table = Table("alias", "fallbacks (the first warm one serves, else the first starts)")
        for a in aliases:
            table.add_row(a["name"], " → ".join(a["fallbacks"]))
        console.print(table)


def _adapter_cells(a: dict[str, Any]) -> tuple[str, ...]:
    """An adapter's row under its base: its name indented, its copy in the store, its rank and
    targets where a model has its format."""
    kept = a["adapter"]
    return (
        f"  └ {a['name']}",
        f"adapter {kept['adapter_id']}",
        f"LoRA r{kept['rank']} ×{kept['scale']:g} {'/'.join(kept['targets'])}",
        "-",
        f"{a['keep_alive_s']:g}",
        _ttft_slo_text(a),
        f"{a['tpot_slo_s']:g}",
        _kept_warm_text(a),
        f"{_bytes(kept['nbytes'])} on {a['base']}",
    )


def _model_cells(m: dict[str, Any]) -> tuple[str, ...]:
    d = m.get("defaults", {})
    defaults = (
        f"temperature {d.get('temperature', 1.0):g}, top_p {d.get('top_p', 1.0):g}, "
        f"repetition {d.get('repetition_penalty', 1.0):g}, max_tokens {d.get('max_tokens', '-')}"
    )
    return (
        m["name"],
        m["artifact"]["artifact_id"],
        # What it was registered from and the weights it keeps (older gateways: the GGUF's).
        f"{m['artifact'].get('source_format', 'gguf')} {m['artifact'].get('weight_format', '')}".strip(),
        str(m["artifact"]["context_length"]),
        f"{m['keep_alive_s']:g}",
        _ttft_slo_text(m),
        f"{m['tpot_slo_s']:g}",
        _kept_warm_text(m),
        defaults,
    )


def _kept_warm_text(m: dict[str, Any]) -> str:
    """Its pin (`min_instances`) and priority (an older gateway has neither: not pinned); an
    adapter's keeps its base's instances."""
    n, priority = m.get("min_instances", 0), m.get("priority", 0)
    pin = f"pinned ×{n}" if n else "no (scales to zero)"
    return f"{pin}, priority {priority}" if priority else pin


def _ttft_slo_text(m: dict[str, Any]) -> str:
    """A registration's TTFT SLO as its rule (`policy.slo`): `max(2, L/512)`, or its fixed
    seconds where it does not grow with the prompt (or the gateway is older)."""
    base, per_token = m["ttft_slo_s"], m.get("ttft_slo_per_token_s", 0.0)
    if not per_token:
        return f"{base:g}"
    tokens_per_s = 1 / per_token
    grows = f"L/{tokens_per_s:g}" if tokens_per_s == round(tokens_per_s) else f"L×{per_token:g}"
    return f"max({base:g}, {grows})"


@models.command("add")
def models_add(
    name: str,
    source: Path,
    keep_alive_s: float = 300.0,
    ttft_slo_s: float = 2.0,
    ttft_slo_per_token_s: float = typer.Option(
        TTFT_SLO_PER_TOKEN_S,
        min=0.0,
        help="TTFT SLO per prompt token: a prompt of L tokens has max(ttft-slo-s, L × this) "
        "(LLM-Mesh: max(2, L/512) s); 0 keeps it fixed.",
    ),
    tpot_slo_s: float = 0.1,
    temperature: float | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    max_tokens: int | None = None,
    chat_template: Path | None = typer.Option(
        None, exists=True, dir_okay=False, help="A Jinja chat template file replacing the GGUF's own."
    ),
    replace: bool = typer.Option(False, help="Replace a model already registered as NAME (else that is an error)."),
    min_instances: int = typer.Option(
        0, min=0, help="Instances kept warm whatever the traffic (0: scale to zero); see `models pin`."
    ),
    priority: int = typer.Option(0, help="Higher is kept first when memory runs short."),
    weight_format: WeightFormat | None = typer.Option(
        None,
        help="What a Hugging Face checkpoint's weights are compressed to (default: int8 up to 3B "
        "parameters, int4 above); an IR or a GGUF keeps its own.",
    ),
    url: str = URL,
    admin_key: str | None = ADMIN_KEY,
    home: Path = HOME,
) -> None:
    """Register NAME on a GGUF, a Hugging Face checkpoint directory or an OpenVINO IR directory
    (`optimum-cli export openvino`); the sampling options set its defaults for requests that
    omit them."""
    overrides = {
        k: v
        for k, v in (
            ("temperature", temperature),
            ("top_p", top_p),
            ("repetition_penalty", repetition_penalty),
            ("max_tokens", max_tokens),
        )
        if v is not None
    }
    with _admin(url, admin_key, home) as http, _working(f"importing {source} (→ IR → compiled tiers)"):
        r = http.post(
            "/admin/models",
            timeout=900,
            json={
                "name": name,
                "source": str(source.resolve()),
                "keep_alive_s": keep_alive_s,
                "ttft_slo_s": ttft_slo_s,
                "ttft_slo_per_token_s": ttft_slo_per_token_s,
                "tpot_slo_s": tpot_slo_s,
                "replace": replace,
                **({"weight_format": str(weight_format)} if weight_format else {}),
                **({"chat_template": chat_template.read_text()} if chat_template else {}),
                **({"min_instances": min_instances} if min_instances else {}),
                **({"priority": priority} if priority else {}),
                **overrides,
            },
        )
    _ok(r)
    console.print(f"registered {name}")


@models.command("alias")
def models_alias(
    name: str,
    fallbacks: list[str] = typer.Argument(..., help="Registered models, in order"),
    replace: bool = typer.Option(False, help="Replace an alias already registered as NAME."),
    url: str = URL,
    admin_key: str | None = ADMIN_KEY,
    home: Path = HOME,
) -> None:
    """Register NAME as an alias of FALLBACKS: each request to it goes to the first of them that
    is warm within its SLOs, else to the first, which starts; the answer's `model` says which.
    `tessera models rm NAME` removes it (a model an alias lists cannot be removed before it)."""
    with _admin(url, admin_key, home) as http:
        _ok(http.post("/admin/models", json={"name": name, "fallbacks": fallbacks, "replace": replace}))
    console.print(f"registered {name}: {' → '.join(fallbacks)}")


@models.command("rm")
def models_rm(
    name: str,
    cascade: bool = typer.Option(False, help="Remove its adapters too (else a model with adapters stays)."),
    url: str = URL,
    admin_key: str | None = ADMIN_KEY,
    home: Path = HOME,
) -> None:
    with _admin(url, admin_key, home) as http:
        removed = _ok(http.delete(f"/admin/models/{name}", params={"cascade": "true"} if cascade else {}))
    gone = removed.get("adapters_removed") or []
    console.print(f"removed {name}" + (f" and its adapters {', '.join(gone)}" if gone else ""), highlight=False)


@models.command("add-adapter")
def models_add_adapter(
    base: str,
    name: str,
    path: Path = typer.Argument(
        ..., help="A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors)."
    ),
    keep_alive_s: float = 300.0,
    ttft_slo_s: float = 2.0,
    ttft_slo_per_token_s: float = typer.Option(TTFT_SLO_PER_TOKEN_S, min=0.0, help="As for `models add`."),
    tpot_slo_s: float = 0.1,
    url: str = URL,
    admin_key: str | None = ADMIN_KEY,
    home: Path = HOME,
) -> None:
    """Register the LoRA adapter at PATH as NAME on the registered model BASE: checked against
    BASE's shapes and kept in the store; served by its own name."""
    with _admin(url, admin_key, home) as http, _working(f"checking {path} against {base}"):
        r = http.post(
            f"/admin/models/{base}/adapters",
            timeout=900,
            json={
                "name": name,
                "source": str(path.resolve()),
                "keep_alive_s": keep_alive_s,
                "ttft_slo_s": ttft_slo_s,
                "ttft_slo_per_token_s": ttft_slo_per_token_s,
                "tpot_slo_s": tpot_slo_s,
            },
        )
    kept = _ok(r)["adapter"]
    console.print(f"registered adapter {name} on {base} (rank {kept['rank']}, {'/'.join(kept['targets'])})")


@models.command("rm-adapter")
def models_rm_adapter(
    base: str, name: str, url: str = URL, admin_key: str | None = ADMIN_KEY, home: Path = HOME
) -> None:
    with _admin(url, admin_key, home) as http:
        _ok(http.delete(f"/admin/models/{base}/adapters/{name}"))
    console.print(f"removed adapter {name} of {base}")


@models.command("pin")
def models_pin(
    name: str,
    instances: int = typer.Option(1, min=1, help="Instances kept running whatever the traffic."),
    priority: int | None = typer.Option(
        None, help="Higher is kept first when memory runs short (default: the model's own)."
    ),
    url: str = URL,
    admin_key: str | None = ADMIN_KEY,
    home: Path = HOME,
) -> None:
    """Keep NAME warm: started now and after a node restart, never scaled to zero, never evicted
    for a model of lower priority (an adapter: its base's instances, the adapter kept loaded on
    them). Refused where the nodes cannot hold every pinned model."""
    body: dict[str, int] = {"min_instances": instances}
    if priority is not None:
        body["priority"] = priority
    with _admin(url, admin_key, home) as http:
        m = _ok(http.post(f"/admin/models/{name}/pin", json=body))
    console.print(f"{name}: {_kept_warm_text(m)}")


@models.command("unpin")
def models_unpin(name: str, url: str = URL, admin_key: str | None = ADMIN_KEY, home: Path = HOME) -> None:
    """Let NAME scale to zero again after its keep-alive."""
    with _admin(url, admin_key, home) as http:
        m = _ok(http.post(f"/admin/models/{name}/unpin"))
    console.print(f"{name}: {_kept_warm_text(m)}")


@models.command("scale")
def models_scale(
    name: str,
    instances: int = typer.Argument(..., help="Nodes to run it on, in all"),
    url: str = URL,
    admin_key: str | None = ADMIN_KEY,
    home: Path = HOME,
) -> None:
    """Start the model on more nodes at once (one multicast brings its weights to all of them)."""
    with _admin(url, admin_key, home) as http:
        scaled = _ok(http.post(f"/admin/models/{name}/scale", json={"instances": instances}))
    started = ", ".join(scaled["started"]) or "none (as many run already, or no node has room)"
    console.print(f"{name}: running on {', '.join(scaled['running']) or 'no node'}; starting on {started}")


@keys.command("add")
def keys_add(
    name: str,
    model: list[str] = MODELS,
    rpm: int | None = RPM,
    tpm: int | None = TPM,
    url: str = URL,
    admin_key: str | None = ADMIN_KEY,
    home: Path = HOME,
) -> None:
    """Make an API key; its secret is printed this once and never stored."""
    with _admin(url, admin_key, home) as http:
        made = _ok(
            http.post(
                "/admin/keys",
                json={"name": name, "models": model, "requests_per_minute": rpm, "tokens_per_minute": tpm},
            )
        )
    console.print(f"made API key {name}; its secret, shown only now:", highlight=False)
    console.print(made["key"], soft_wrap=True, highlight=False, markup=False)


@keys.command("ls")
def keys_ls(url: str = URL, admin_key: str | None = ADMIN_KEY, home: Path = HOME) -> None:
    with _admin(url, admin_key, home) as http:
        found = _ok(http.get("/admin/keys"))
    table = Table("name", "key starts", "models", "requests/min", "tokens/min", "created")
    for k in found:
        table.add_row(
            k["name"],
            k["hint"],
            ", ".join(k["models"]) or "all",
            _limit(k["requests_per_minute"]),
            _limit(k["tokens_per_minute"]),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(k["created_at"])),
        )
    console.print(table)


@keys.command("rm")
def keys_rm(name: str, url: str = URL, admin_key: str | None = ADMIN_KEY, home: Path = HOME) -> None:
    """Revoke an API key at once, on every gateway replica."""
    with _admin(url, admin_key, home) as http:
        _ok(http.delete(f"/admin/keys/{name}"))
    console.print(f"revoked {name}")


@app.command()
def status(
    url: str = URL,
    admin_key: str | None = ADMIN_KEY,
    home: Path = HOME,
    metrics: list[str] = METRICS,
    starts: int = STARTS,
) -> None:
    """Nodes, instances (tier, worker pid), memory and host cache, and recent cold starts."""
    with _admin(url, admin_key, home) as http:
        cluster = _ok(http.get("/admin/instances"))
        recent = _ok(http.get("/admin/coldstarts", params={"limit": starts}))
        caches = {c["node_id"]: c for c in _ok(http.get("/admin/cache")) if "error" not in c}
    gauges: dict[str, dict[str, float]] = {}
    for spec in metrics:
        node, _, base = spec.partition("=")
        if not base:
            raise typer.BadParameter(f"{spec!r}: expected NODE=URL", param_hint="--metrics")
        gauges.setdefault(node, {}).update(unlabelled_samples(base))
    now = time.time()

    nodes = Table("node", "memory used", "memory budget", "host cache", "instances", "starting", title="nodes")
    for n in cluster["nodes"]:
        g = gauges.get(n["node_id"], {})
        used = g.get("tessera_memory_used_bytes", n["memory_used_bytes"])
        budget = g.get("tessera_memory_budget_bytes", n["memory_budget_bytes"])
        cache = "?"
        if n["node_id"] in caches:
            c = caches[n["node_id"]]
            cache = f"{_bytes(c['used_bytes'])} / {_bytes(c['budget_bytes'])} ({len(c['entries'])} models)"
        elif "tessera_loader_host_cache_bytes" in g:
            cache = (
                f"{_bytes(g['tessera_loader_host_cache_bytes'])} / "
                f"{_bytes(g.get('tessera_loader_host_cache_budget_bytes', 0))} "
                f"({g.get('tessera_loader_host_cache_entries', 0):.0f} models)"
            )
        nodes.add_row(
            n["node_id"], _bytes(used), _bytes(budget), cache, str(len(n["instances"])), ", ".join(n["starting"]) or "-"
        )
    console.print(nodes)

    instances = Table("node", "model", "tier", "worker pid", "active", "weights", "loaded", "idle", title="instances")
    for n in cluster["nodes"]:
        for i in n["instances"]:
            instances.add_row(
                n["node_id"],
                i["model"],
                i["tier"] or "-",
                str(i["worker_pid"] or "-"),
                str(i["active"]),
                _bytes(i["weight_bytes"]),
                _ago(now - i["loaded_at"]),
                _ago(now - i["last_used"]),
            )
    console.print(instances)

    colds = Table(
        "when",
        "node",
        "model",
        "source",
        "tier",
        "init s",
        "load s",
        "profile s",
        "prefill s",
        "total s",
        title="recent cold starts",
    )
    for c in recent:
        p = c["phases"]
        colds.add_row(
            _ago(now - c["started_at"]) + " ago",
            c["node_id"],
            c["model"],
            c["source"],
            c["tier"] or "-",
            f"{p['init_s']:.2f}",
            f"{p['load_s']:.2f}",
            f"{p['profile_s']:.2f}",
            f"{p['prefill_s']:.2f}",
            f"{c['total_s']:.2f}",
        )
    console.print(colds)


def unlabelled_samples(base: str) -> dict[str, float]:
    """Every unlabelled sample of one service's /metrics, by name."""
    text = httpx.get(f"{base.rstrip('/')}/metrics", timeout=10).raise_for_status().text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


if __name__ == "__main__":
    app()
