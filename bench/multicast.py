"""PipeCast against the store-for-everyone baseline, on real nodes over shaped links.

    python -m bench.multicast [--link-mbps 200] [--block-mib 2] [--pipelined-targets 8] [--out bench/results]

1. Transfers and first tokens. Nine nodes (loader, engine and memory manager each; real
   NATS), each in a network namespace of its own, its link shaped to `--link-mbps` each way by
   `tc` (`ops/netns.py`), so that moving the model is network-bound, as between hosts, and not
   the loopback's memory copy; where namespaces are not permitted (or with `--loopback`), the
   nodes share the loopback and each block server paces its uplink to the same rate
   (`TESSERA_LINK_BPS`). node-0 holds the default model's compiled blob in its host cache
   (FaaScale's one replica in host memory, k = 1), nodes 1..8 are targets. For N = 1, 2, 4, 8
   targets, their host caches and engines emptied first, each scheme once:

   - baseline: every target reads every block from node-0 (the one copy, as from a store);
   - PipeCast: `policy.multicast.pipecast(["node-0"], targets, blocks)`: each target receives
     its feeds from node-0 or from the targets ahead of it, and forwards as it receives.

   The transfer time is from the `Multicast` requests to the last target's answer; every
   target checked every block's SHA-256. Each target's engine is told to start the model with
   the multicast, as a scale-out's starts are (its stage waits for the blocks), then serves one
   token: `first_token_s` is until the last target's. A fault run then sends PipeCast to 8 and
   kills one target's loader while blocks flow: the other seven must complete. The same plan
   code, priced by `policy.multicast.transfer_s` on the same block count and link, gives
   N = 1…1,024 (`sim_*`).

2. Serving before the last block (FaaScale §4.3), `bench/multicast_engines.py`: torch nodes,
   the model running on node-0 scaled out by the scheduler to `--pipelined-targets` others,
   from node-0 and from a store behind a link shaped like the nodes' (k = 2). Measured: the
   first token served through an execution pipeline of targets against the moment the last
   target holds a whole replica (`first_served_before_replica_s`).

Writes `<out>/multicast.json` and `<out>/multicast.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/multicast.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, make_log
from bench.multicast_engines import first_tokens, pipelined, record_of, unload
from ops import netns
from ops.loaders import LoaderClient
from ops.localcluster import LocalCluster, default_model_path
from policy.multicast import STORE, naive, pipecast, transfer_s
from services.loader.blockset import MULTICAST_BLOCK_BYTES
from services.loader.hostcache import block_set
from shared.bus import Bus
from shared.cache_messages import MulticastDone
from shared.messages import Tier

log = make_log("multicast")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEVICE = "CPU"
SOURCE = "node-0"
NS = (1, 2, 4, 8)
SIM_NS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def feeds_of(plan_sends: Any, addr: dict[str, str], targets: list[str]) -> dict[str, list[tuple[int, str]]]:
    return {t: [(s.block, addr.get(s.src, s.src)) for s in plan_sends.feeds(t)] for t in targets}


async def run(link_bps: float, home: Path, namespaces: bool, block_bytes: int) -> dict[str, Any]:
    nodes = 1 + max(NS)
    names = [f"node-{i}" for i in range(nodes)]
    spaces = netns.NetNamespaces(str(home), names, link_bps * 8 / 1e6) if namespaces else None
    cluster = LocalCluster(
        home=home,
        nodes=nodes,
        services=("memory_manager", "loader", "engine"),
        # Starts load the tier a multicast moves (STEADY), so a target's start waits for it.
        env={
            "TESSERA_FILL_DELAY_S": "0",
            "TESSERA_START_TIER": "false",
            **({} if spaces else {"TESSERA_LINK_BPS": str(link_bps)}),
        },
        netns=spaces,
    )
    t = time.perf_counter()
    cluster.start(timeout_s=180)
    log(f"{nodes} loaders up in {time.perf_counter() - t:.1f}s")
    bus = Bus("bench-multicast")
    await bus.connect(cluster.nats_url)
    try:
        loaders = LoaderClient(bus, DEVICE)
        artifact = await loaders.import_model(str(default_model_path()))
        record = record_of("bench-multicast", artifact, str(default_model_path()))
        bs = block_set(artifact, DEVICE, Tier.STEADY, block_bytes)  # before any loader reads it
        await loaders.cache_on(SOURCE, artifact)
        addr = {f"node-{i}": (await loaders.status(f"node-{i}")).peer_addr for i in range(nodes)}
        log(f"model blob: {bs.size / 1e6:.0f} MB in {bs.blocks} blocks of {bs.block_bytes >> 20} MiB")
        results: dict[str, dict[int, dict[str, Any]]] = {"pipecast": {}, "baseline": {}}
        for n in NS:
            targets = [f"node-{i}" for i in range(1, n + 1)]
            for scheme in ("baseline", "pipecast"):
                await unload(bus, targets, record)
                await loaders.evict(targets, artifact)
                plan = (
                    pipecast([SOURCE], targets, bs.blocks)
                    if scheme == "pipecast"
                    else naive(targets, bs.blocks, SOURCE)
                )
                # Fallback: the source node, then the store (only a failed source sends there).
                t0 = time.perf_counter()
                moving = asyncio.create_task(
                    loaders.multicast(artifact, feeds_of(plan, addr, targets), (addr[SOURCE], STORE))
                )
                await asyncio.sleep(0.05)  # sync-ok: the orders reach the loaders before the starts ask them
                # The starts begin with the multicast, as a scale-out's do: each one's stage
                # waits for the blocks; then it serves a token.
                tokens = await first_tokens(bus, targets, record)
                wall, done = await moving
                failed = {k: v for k, v in done.items() if isinstance(v, str)}
                ok = [v for v in done.values() if isinstance(v, MulticastDone)]
                assert not failed, failed
                results[scheme][n] = {
                    "seconds": wall,
                    "first_token_s": max(tokens.values()) - t0,
                    "first_token_per_node_s": {k: round(v - t0, 3) for k, v in sorted(tokens.items())},
                    "per_node_s": {v.node_id: round(v.seconds, 3) for v in ok},
                    "blocks_verified": sum(v.blocks for v in ok),
                    "refetched": sum(v.refetched for v in ok),
                    "plan_steps": plan.steps,
                }
                log(
                    f"{scheme:8s} N={n}: every node has the model in {wall:.2f}s, "
                    f"has served a token in {results[scheme][n]['first_token_s']:.2f}s"
                )
        # The fault run: PipeCast to 8, one target's loader killed while blocks flow.
        targets = [f"node-{i}" for i in range(1, max(NS) + 1)]
        await unload(bus, targets, record)
        await loaders.evict(targets, artifact)
        plan = pipecast([SOURCE], targets, bs.blocks)
        victim = "node-1"  # the first to receive: every other target was to get blocks from it
        expected_s = results["pipecast"][max(NS)]["seconds"]

        async def kill_later() -> None:
            await asyncio.sleep(expected_s * 0.3)  # sync-ok: a fault injected mid-transfer
            cluster.procs[f"loader@{victim}"].kill()

        killer = asyncio.create_task(kill_later())
        wall, survivors = await loaders.multicast(
            artifact, feeds_of(plan, addr, targets), (addr[SOURCE], STORE), unawaited=frozenset({victim})
        )
        await killer
        fault = {
            "n": max(NS),
            "killed": victim,
            "killed_after_s": round(expected_s * 0.3, 3),
            "seconds": wall,
            "failed_scale_outs": sum(isinstance(v, str) for v in survivors.values()),
            "refetched_blocks": sum(v.refetched for v in survivors.values() if isinstance(v, MulticastDone)),
            "blocks_verified": sum(v.blocks for v in survivors.values() if isinstance(v, MulticastDone)),
        }
        log(f"fault run: {fault}")
        return {
            "block_bytes": bs.block_bytes,
            "blocks": bs.blocks,
            "model_bytes": bs.size,
            "runs": results,
            "fault": fault,
        }
    finally:
        await bus.close()
        cluster.stop()


def simulate(blocks: int, block_bytes: int, link_bps: float) -> dict[str, dict[int, float]]:
    """The same plans, priced on the model: one source with a link like every node's."""
    out: dict[str, dict[int, float]] = {"pipecast": {}, "baseline": {}}
    for n in SIM_NS:
        targets = [f"t{i}" for i in range(n)]
        out["pipecast"][n] = max(transfer_s(pipecast([STORE], targets, blocks), block_bytes, link_bps).values())
        out["baseline"][n] = max(transfer_s(naive(targets, blocks), block_bytes, link_bps).values())
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for scheme, marker, color in (("pipecast", "o", "C0"), ("baseline", "s", "C1")):
        xs = [int(n) for n in result[f"{scheme}_s"]]
        axes[0].plot(xs, list(result[f"{scheme}_s"].values()), marker=marker, color=color, label=f"{scheme} (measured)")
        tokens = result.get("first_token_s" if scheme == "pipecast" else "baseline_first_token_s")
        if tokens:
            axes[0].plot(
                [int(n) for n in tokens],
                list(tokens.values()),
                marker=marker,
                linestyle="--",
                fillstyle="none",
                color=color,
                label=f"{scheme}: every node's first token",
            )
        sim = result["sim_s"][scheme]
        axes[0].plot(
            [int(n) for n in sim][:4], list(sim.values())[:4], linestyle=":", color=color, label=f"{scheme} (model)"
        )
        axes[1].plot([int(n) for n in sim], list(sim.values()), marker=marker, color=color, label=scheme)
    axes[0].set_xlabel("target nodes N")
    axes[0].set_ylabel("seconds until every node has the model")
    title = f"9 nodes, links of {result['link_mbps']:g} Mb/s"
    piped = result.get("pipelined") or {}
    if piped.get("first_served_before_replica_s") is not None:
        title += (
            f"\npipelined (torch, N={piped['targets']}): first token {piped['first_served_s']:.1f} s,"
            f" last replica {piped['last_replica_s']:.1f} s"
        )
    axes[0].set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    axes[1].set_xscale("log", base=2)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("target nodes N (simulated, same plan code)")
    axes[1].set_ylabel("seconds")
    axes[1].legend(fontsize=8)
    fig.suptitle("Scale-out of one model to N nodes: PipeCast vs every node from one source")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link-mbps", type=float, default=200.0, help="every node's uplink, megabits per second")
    ap.add_argument("--loopback", action="store_true", help="no namespaces: pace the block servers instead")
    ap.add_argument("--block-mib", type=float, default=MULTICAST_BLOCK_BYTES / 2**20, help="multicast block size, MiB")
    ap.add_argument(
        "--pipelined-targets", type=int, default=max(NS), help="torch nodes the pipelined scale-out reaches; 0: none"
    )
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = ap.parse_args()
    # A kill ends the run through its `finally`s: the loaders stop and the namespaces go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why_not = "asked for the loopback" if args.loopback else netns.unavailable()
    if why_not:
        log(f"links paced by the block servers on the loopback ({why_not})")
    load_before = os.getloadavg()
    link_bps = args.link_mbps * 1e6 / 8
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tessera-multicast-") as home:
        real = asyncio.run(run(link_bps, Path(home), namespaces=not why_not, block_bytes=int(args.block_mib * 2**20)))
    piped: dict[str, Any] | None = None
    if args.pipelined_targets:
        with tempfile.TemporaryDirectory(prefix="tessera-pipelined-") as home:
            piped = pipelined(link_bps, Path(home), args.pipelined_targets, namespaces=not why_not, log=log)
    sim = simulate(real["blocks"], real["block_bytes"], link_bps)
    pipe = {n: r["seconds"] for n, r in real["runs"]["pipecast"].items()}
    base = {n: r["seconds"] for n, r in real["runs"]["baseline"].items()}
    top = max(NS)
    result = {
        "pipecast_s": pipe,
        "baseline_s": base,
        "first_token_s": {n: r["first_token_s"] for n, r in real["runs"]["pipecast"].items()},
        "baseline_first_token_s": {n: r["first_token_s"] for n, r in real["runs"]["baseline"].items()},
        "first_served_before_replica_s": piped["first_served_before_replica_s"] if piped else None,
        "pipelined": piped,
        "pipecast_growth_n8_over_n1": pipe[top] / pipe[1],
        "baseline_over_pipecast": {n: base[n] / pipe[n] for n in NS},
        "sim_s": sim,
        "sim_ratio_baseline_over_pipecast": {n: sim["baseline"][n] / sim["pipecast"][n] for n in SIM_NS},
        "targets": {
            "pipecast_n8_over_n1_at_most": 1.5,
            "baseline_over_pipecast_n8_at_least": 4,
            "sim_baseline_over_pipecast_n256_at_least": 50,
        },
        "targets_met": {
            "pipecast_n8_over_n1": pipe[top] / pipe[1] <= 1.5,
            "baseline_over_pipecast_n8": base[top] / pipe[top] >= 4,
            "sim_n256": sim["baseline"][256] / sim["pipecast"][256] >= 50,
            "fault_run_no_failed_scale_out": real["fault"]["failed_scale_outs"] == 0,
        },
        "fault_run": real["fault"],
        "runs": real["runs"],
        "link_mbps": args.link_mbps,
        "links": "tc tbf on veth pairs, a network namespace per node"
        if not why_not
        else f"each block server paces its uplink on the loopback ({why_not})",
        "model_bytes": real["model_bytes"],
        "block_bytes": real["block_bytes"],
        "blocks": real["blocks"],
        "machine": machine_info(load_before),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bench_wall_s": time.perf_counter() - t0,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multicast.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "multicast.png")
    print(
        json.dumps(
            {k: result[k] for k in ("pipecast_s", "baseline_s", "baseline_over_pipecast", "targets_met")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
