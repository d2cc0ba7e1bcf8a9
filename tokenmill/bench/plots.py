"""PNG plots for the benchmarks (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_occupancy(results, out_dir: Path) -> Path:
    """Sequences doing real work in each step, against time: static batching's staircase (the
    batch drains, finished sequences ride along as padding) against continuous batching."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        if not r.steps:
            continue
        t = np.cumsum([s.time_total for s in r.steps])
        ax.step(t, r.useful_seqs, where="post", label=f"{r.name}: sequences doing real work")
        if r.name == "static":
            ax.step(t, [s.num_seqs for s in r.steps], where="post", linestyle=":",
                    label="static: sequences computed (incl. padding)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("sequences in the step")
    ax.set_title("Batch occupancy per step")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    path = out_dir / "occupancy.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency_vs_rate(rows: list[dict], out_dir: Path) -> Path:
    """TTFT and ITL percentiles, and throughput, against the request rate."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = list(range(len(rows)))  # categorical: "inf" (all at once) has no place on a numeric axis
    labels = [f"{r['request_rate']:g}" for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    for key, ax, title in (("ttft", ax1, "time to first token"), ("itl", ax2, "inter-token latency")):
        for pct in ("p50", "p90", "p99"):
            ax.plot(rates, [np.nan if r[key][pct] is None else r[key][pct] * 1e3 for r in rows],  # None: no sample
                    marker="o", label=pct)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.legend()
        ax.grid(alpha=0.3)
    ax3.plot(rates, [r["output_tok_s"] for r in rows], marker="o")
    ax3.set_title("output throughput")
    ax3.set_xlabel("request rate (req/s)")
    ax3.set_ylabel("tok/s")
    ax3.grid(alpha=0.3)
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(rates, labels)
    path = out_dir / "latency_vs_rate.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_cdfs(rows: list[dict], out_dir: Path) -> Path:
    """Empirical CDFs of TTFT and ITL, one curve per request rate."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        for key, ax in (("ttft_samples", ax1), ("itl_samples", ax2)):
            xs = np.sort(np.asarray(r[key]) * 1e3)
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{r['request_rate']} req/s")
    for ax, title in ((ax1, "TTFT CDF"), (ax2, "ITL CDF")):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    path = out_dir / "latency_cdfs.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
