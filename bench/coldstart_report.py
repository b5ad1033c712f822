"""What `bench/coldstart.py` makes of its results: the ratios against their targets, and the plot
of each system's median cold start, phase by phase."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import THREADS, median_index

# --- targets -------------------------------------------------------------------------------------


def targets(
    t_cold: float,
    t_host: float,
    t_disk: float,
    l_cold: float,
    o_cold: float,
    warm_ratio: float,
    decode_ratio: float,
    side_host: float,
    side_disk: float,
) -> dict[str, dict[str, Any]]:
    """Each ratio with its target (and stretch target, where there is one) and whether it is met.
    The warm TTFT and decode ratios are the side-by-side (interleaved) ones."""

    def at_most(value: float, target: float, stretch: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"value": value, "target": f"<= {target}", "pass": value <= target}
        if stretch is not None:
            out |= {"stretch": f"<= {stretch}", "stretch_pass": value <= stretch}
        return out

    def at_least(value: float, target: float) -> dict[str, Any]:
        return {"value": value, "target": f">= {target}", "pass": value >= target}

    # The issue's `tessera_cold_ttft_s` is the host-cache hit; scaled to zero with the weights
    # still resident in a worker is a tier above it, reported beside.
    return {
        "cold_ttft_ratio_vs_llamacpp": at_most(t_host / l_cold, 1.0, stretch=0.5),
        "naive_over_tessera_cold": at_least(o_cold / t_host, 10.0),
        "resident_ratio_vs_llamacpp": at_most(t_cold / l_cold, 1.0, stretch=0.5),
        "disk_ratio_vs_llamacpp": at_most(t_disk / l_cold, 2.0),
        "host_ratio_vs_llamacpp_side_by_side": at_most(side_host, 1.0, stretch=0.5),
        "disk_ratio_vs_llamacpp_side_by_side": at_most(side_disk, 2.0),
        "warm_ttft_ratio_vs_inproc": at_most(warm_ratio, 1.2),
        "decode_ratio_vs_inproc": at_least(decode_ratio, 0.9),
    }


# --- plot ----------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Each bar is the breakdown of the median run itself, so its segments add up to the median
    # total (medians of the phases taken one by one need not).
    def tessera_parts(trials: list[float], phase_trials: list[dict[str, float]]) -> list[tuple[str, float]]:
        i = median_index(trials)
        tp = phase_trials[i]
        overhead = trials[i] - sum(tp.values())
        return [
            ("init", tp["init"]),
            ("load", tp["load"]),
            ("profile", tp["profile"]),
            ("prefill", tp["prefill"]),
            ("stack overhead", max(0.0, overhead)),
        ]

    lp = result["llamacpp_phase_runs"][median_index(result["llamacpp_cold_ttft_runs_s"])]
    op = result["openvino_naive_phase_runs"][median_index(result["openvino_naive_cold_ttft_runs_s"])]
    systems = [
        (
            "Tessera, scaled to zero\n(weights resident)",
            result["tessera_cold_resident_ttft_s"],
            tessera_parts(result["tessera_cold_resident_ttft_trials_s"], result["tessera_resident_phase_trials_s"]),
        ),
        (
            "Tessera, worker evicted\n(host-cache hit)",
            result["tessera_cold_host_ttft_s"],
            tessera_parts(result["tessera_cold_host_ttft_trials_s"], result["tessera_host_phase_trials_s"]),
        ),
        (
            "Tessera, all caches dropped\n(from disk)",
            result["tessera_cold_disk_ttft_s"],
            tessera_parts(result["tessera_cold_disk_ttft_trials_s"], result["tessera_disk_phase_trials_s"]),
        ),
        (
            "llama.cpp (new process)",
            result["llamacpp_cold_ttft_s"],
            [("import", lp["import_s"]), ("load", lp["load_s"]), ("first token", lp["first_token_s"])],
        ),
        (
            "OpenVINO on the GGUF\n(new process, converts at load)",
            result["openvino_naive_cold_ttft_s"],
            [("import", op["import_s"]), ("load", op["load_s"]), ("first token", op["first_token_s"])],
        ),
    ]
    colors = {
        "init": "#9ecae1",
        "import": "#9ecae1",
        "load": "#3182bd",
        "profile": "#fdae6b",
        "prefill": "#31a354",
        "first token": "#31a354",
        "stack overhead": "#bdbdbd",
    }
    labels = {
        "prefill": "prefill / first token",
        "first token": "prefill / first token",
        "init": "init / import",
        "import": "init / import",
    }

    fig, ax = plt.subplots(figsize=(10, 5.8))
    seen: set[str] = set()
    longest = max(total for _, total, _ in systems)
    for y, (_name, total, parts) in enumerate(systems):
        left = 0.0
        for phase, secs in parts:
            label = labels.get(phase, phase)
            ax.barh(
                y,
                secs,
                left=left,
                color=colors[phase],
                edgecolor="white",
                height=0.6,
                label=None if label in seen else label,
            )
            seen.add(label)
            left += secs
        ax.text(max(left, total) + longest * 0.01, y, f"{total:.2f} s", va="center", fontsize=10)
    ax.set_yticks(range(len(systems)), [s[0] for s in systems])
    ax.invert_yaxis()
    ax.set_xlim(0, longest * 1.15)
    ax.set_xlabel("seconds from request (or process start) to first token, median")
    ax.set_title(f"Cold start to first token, SmolLM2-135M-Instruct Q4_1, CPU, {THREADS} threads")
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
