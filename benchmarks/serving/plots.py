"""PNG plots of a serving summary (matplotlib): the chat and shared-prefix workloads against
concurrency, and the rate search's p99 TPOT against the request rate."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.e2e.plots import title_suffix

#: (field, axis label) of the three panels of a workload figure
PANELS = (("output_throughput", "output tokens/s"), ("p50_ttft_ms", "TTFT p50 (ms)"),
          ("p99_tpot_ms", "TPOT p99 (ms)"))


def _series(runs: list[dict], workload: str) -> dict[str, list[dict]]:
    """config (and prefix length) -> runs of ``workload`` sorted by concurrency."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        if r["workload"] == workload and r.get("concurrency"):
            key = r["config"] + (f", prefix {r['prefix_len']}" if r.get("prefix_len") else "")
            out.setdefault(key, []).append(r)
    return {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in out.items()}


def lengths_label(args: dict) -> str:
    """'2048-8192 prompt / 512-1024 output tokens' from a summary's arguments (the chat and rate
    workloads' lengths), '' where they do not give the ranges as numbers."""
    lengths = [str(args.get(k, "")) for k in ("chat_input", "chat_output")]
    if all(re.fullmatch(r"\d+-\d+", t) for t in lengths):
        return f"{lengths[0]} prompt / {lengths[1]} output tokens"
    return ""


def chat_title(args: dict) -> str:
    """'Chat, 2048-8192 prompt / 512-1024 output tokens' (or 'Chat')."""
    return ", ".join(filter(None, ("Chat", lengths_label(args))))


def plot_summary(summary_path: Path, plot_dir: Path) -> list[Path]:
    """``serving_chat.png``, ``serving_prefix.png`` (output tok/s, TTFT p50, TPOT p99 against
    max concurrency) and ``serving_rate.png`` (each probe's p99 TPOT against its rate, the
    objective as a line); only those the summary has data for. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    summary = json.loads(Path(summary_path).read_text())
    suffix = title_suffix(summary)
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for workload, title in (("chat", chat_title(summary.get("args") or {})), ("prefix", "Shared prefixes")):
        series = _series(summary["runs"], workload)
        if not series:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        fig.suptitle(title + suffix, fontsize=10)
        for ax, (field, label) in zip(axes, PANELS):
            for name, rs in series.items():
                pts = [(r["concurrency"], r[field]) for r in rs if r.get(field) is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("max concurrency")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(plot_dir / f"serving_{workload}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    probes = [r for r in summary["runs"] if r["workload"] == "rate" and r.get("p99_tpot_ms") is not None]
    if probes:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for name in dict.fromkeys(r["config"] for r in probes):
            pts = sorted((r["rate"], r["p99_tpot_ms"]) for r in probes if r["config"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        failed = [r for r in probes if r.get("failed")]
        if failed:  # such a probe fails the objective whatever its TPOT
            ax.scatter([r["rate"] for r in failed], [r["p99_tpot_ms"] for r in failed], marker="x", s=90,
                       color="black", zorder=3, label="requests failed")
        obj = next(iter(summary["rate_search"].values()), {}).get("objective", {})
        if obj.get("p99_tpot_ms"):
            ax.axhline(obj["p99_tpot_ms"], color="grey", linestyle="--", label="objective")
        ax.set_xscale("log", base=2)
        rates = sorted({r["rate"] for r in probes})
        ax.set_xticks(rates, [f"{r:.3g}" for r in rates])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_ylim(bottom=0)
        ax.set_xlabel("request rate (requests/s, Poisson; ticks at the probed rates)")
        ax.set_ylabel("TPOT p99 (ms)")
        lengths = lengths_label(summary.get("args") or {})
        ax.set_title("Request rate against the latency objective" + (f"\n{lengths}" if lengths else "")
                     + suffix, fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(plot_dir / "serving_rate.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
