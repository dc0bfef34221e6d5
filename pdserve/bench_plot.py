"""PNG plots of `pdserve bench` runs: latency CDFs, and for a rate sweep, goodput and P95 TPOT
against the request rate."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _cdf(ax, values: list[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.plot([x * 1e3 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def plot(runs: list[dict], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for run in runs:
        ok = [r for r in run["records"] if r["error"] is None and r["done"] is not None]
        label = f"{run['rate']:g} req/s" if run["rate"] else "closed loop"
        _cdf(axes[0], [r["first_token"] - r["sent"] for r in ok], label)
        _cdf(
            axes[1], [(r["done"] - r["first_token"]) / (r["num_tokens"] - 1) for r in ok if r["num_tokens"] > 1], label
        )
        _cdf(axes[2], [r["done"] - r["sent"] for r in ok], label)
    for ax, title in zip(axes, ("TTFT", "TPOT", "End-to-end latency")):
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / "latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    swept = [r for r in runs if r["rate"]]
    if len(swept) > 1:
        rates = [r["rate"] for r in swept]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        axes[0].plot(rates, [r["report"]["goodput_rps"] for r in swept], "o-", label="goodput")
        axes[0].plot(rates, [r["report"]["qps"] for r in swept], "s--", label="throughput")
        axes[0].set_ylabel("requests/s")
        axes[0].set_title("Goodput (requests meeting the SLOs) vs request rate")
        axes[1].plot(rates, [r["report"]["tpot_s"]["p95"] * 1e3 for r in swept], "o-")
        axes[1].set_ylabel("P95 TPOT (ms)")
        axes[1].set_title("P95 TPOT vs request rate")
        for ax in axes:
            ax.set_xlabel("request rate (requests/s)")
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        path = out / "rate_sweep.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
