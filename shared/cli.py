"""`tessera`: run the local cluster and manage models from a terminal."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

from shared.localcluster import DEFAULT_MODEL_NAME, LocalCluster

app = typer.Typer(help="Tessera: serverless LLM inference.", no_args_is_help=True)
models = typer.Typer(help="Register, list and remove models.", no_args_is_help=True)
app.add_typer(models, name="models")
console = Console()


@app.command()
def up(
    port: int = typer.Option(8000, help="Gateway port (the OpenAI API)."),
    home: Path = typer.Option(Path(".tessera"), help="Model store, Valkey data and logs."),
    nodes: int = typer.Option(1, min=1, help="Engine nodes to run."),
) -> None:
    """Start NATS, Valkey and every service; register the default model; wait for Ctrl-C."""
    cluster = LocalCluster(home=home, gateway_port=port, nodes=nodes)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with console.status("starting NATS, Valkey and the services…"):
        cluster.start()
    try:
        with console.status(f"importing {DEFAULT_MODEL_NAME} (converted once, then reused)…"):
            cluster.register_default_model()
        url = cluster.base_url
        console.print(f"[bold green]Tessera is up[/] at [bold]{url}/v1[/]  (logs in {cluster.home / 'logs'})",
                      soft_wrap=True)
        console.print(
            f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{DEFAULT_MODEL_NAME}\", \"messages\": "
            f"[{{\"role\": \"user\", \"content\": \"Say hello\"}}]}}'",
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
def models_ls(url: str = typer.Option("http://127.0.0.1:8000", help="Gateway URL.")) -> None:
    r = httpx.get(f"{url}/admin/models", timeout=10)
    r.raise_for_status()
    table = Table("name", "artifact", "context", "keep-alive s", "TTFT SLO s", "TPOT SLO s")
    for m in r.json():
        table.add_row(m["name"], m["artifact"]["artifact_id"], str(m["artifact"]["context_length"]),
                      f"{m['keep_alive_s']:g}", f"{m['ttft_slo_s']:g}", f"{m['tpot_slo_s']:g}")
    console.print(table)


@models.command("add")
def models_add(
    name: str,
    source: Path,
    keep_alive_s: float = 300.0,
    ttft_slo_s: float = 2.0,
    tpot_slo_s: float = 0.1,
    url: str = typer.Option("http://127.0.0.1:8000", help="Gateway URL."),
) -> None:
    with console.status(f"importing {source}…"):
        r = httpx.post(f"{url}/admin/models", timeout=900, json={
            "name": name, "source": str(source.resolve()), "keep_alive_s": keep_alive_s,
            "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s})
    if r.status_code >= 400:
        console.print(f"[red]{r.json()['error']['message']}[/]")
        raise typer.Exit(1)
    console.print(f"registered {name}")


@models.command("rm")
def models_rm(name: str, url: str = typer.Option("http://127.0.0.1:8000", help="Gateway URL.")) -> None:
    r = httpx.delete(f"{url}/admin/models/{name}", timeout=10)
    if r.status_code >= 400:
        console.print(f"[red]{r.json()['error']['message']}[/]")
        raise typer.Exit(1)
    console.print(f"removed {name}")


if __name__ == "__main__":
    app()
