"""PNG plots of a summary: KV capacity per configuration; decode throughput against context;
TTFT and the decode ratio to fp8 against context."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.e2e.report import FP8_CONFIGS, compute_ratios


def title_suffix(summary: dict) -> str:
    """' (GPU, PRESET shape)' from a summary's versions and model, as far as it has them. A
    summary that only merged earlier runs' records names their GPU where they all ran on one."""
    gpus = {(v or {}).get("gpu") for v in (summary.get("prior_versions") or {}).values()}
    gpu = (summary.get("versions") or {}).get("gpu") or (gpus.pop() if len(gpus) == 1 else None)
    gpu = (gpu or "").split(",")[0].replace("NVIDIA ", "")
    preset = (summary.get("model") or {}).get("preset")
    parts = [p for p in (gpu, f"{preset} shape" if preset else "") if p]
    return f" ({', '.join(parts)})" if parts else ""


def plot_summary(summary_path: Path, plot_dir: Path) -> list[Path]:
    """``e2e_capacity.png`` (KV tokens of the newest engine record of each configuration),
    ``e2e_decode.png`` (decode tokens/s at fp8's largest batch and at each configuration's own
    largest batch, against context) and ``e2e_context.png`` (TTFT, and decode tokens/s over the
    faster fp8's at fp8's largest batch and at the configuration's own, against context). Returns
    the files written (none for a summary without such records)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.loads(Path(summary_path).read_text())
    recs, suffix = summary["records"], title_suffix(summary)
    plot_dir.mkdir(parents=True, exist_ok=True)
    out = []
    eng = list({r["config"]: r for r in recs if r["kind"] == "engine"}.values())
    if eng:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [r["config"] for r in eng]
        ax.bar(names, [r["capacity_tokens"] / 1e6 for r in eng], color="tab:blue")
        for i, r in enumerate(eng):
            ax.text(i, r["capacity_tokens"] / 1e6, f"{r['capacity_tokens'] / 1e6:.2f}M",
                    ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("KV cache capacity (M tokens)")
        ax.set_title("KV capacity at the same gpu_memory_utilization" + suffix, fontsize=9)
        fig.tight_layout()
        out.append(plot_dir / "e2e_capacity.png")
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    dec = [r for r in recs if r["kind"] == "decode"]
    if dec:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        fig.suptitle("Decode throughput" + suffix, fontsize=10)
        for ax, key, title in ((axes[0], "ref", "at fp8's largest batch"),
                               (axes[1], "max", "at each configuration's largest batch")):
            for name in dict.fromkeys(r["config"] for r in dec):
                pts = sorted((r["context"], r["tok_per_s"], r["batch"]) for r in dec
                             if r["config"] == name and key in r["label"].split("+"))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
                    for c, t, b in pts:
                        ax.annotate(f"b{b}", (c, t), fontsize=7, textcoords="offset points", xytext=(3, 3))
            ax.set_xscale("log", base=2)
            values = [r["tok_per_s"] for r in dec if r["tok_per_s"]]
            if values and max(values) > 4 * min(values):
                ax.set_yscale("log")  # contexts 8k-128k span 30x: equal ratios, equal distances
            else:
                ax.set_ylim(bottom=0)  # a zoomed axis would magnify a 2% gap into a cliff
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("decode output tokens/s")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=8)
        fig.tight_layout()
        out.append(plot_dir / "e2e_decode.png")
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    ttft = [r for r in recs if r["kind"] == "ttft"]
    if ttft:
        out.append(_plot_context(plt, recs, ttft, suffix, plot_dir / "e2e_context.png"))
    return out


def _plot_context(plt, recs: list[dict], ttft: list[dict], suffix: str, path: Path) -> Path:
    """TTFT per configuration and the decode ratios of :func:`compute_ratios` against context."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    fig.suptitle("Cost growth with context" + suffix, fontsize=10)
    for name in dict.fromkeys(r["config"] for r in ttft):
        pts = sorted({r["context"]: r["ttft_s"] for r in ttft if r["config"] == name}.items())
        axes[0].plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=name)
    axes[0].set_ylabel("TTFT (s), one request, idle engine")
    ratios = compute_ratios(recs, sorted({r["context"] for r in recs if "context" in r}))["decode_vs_fp8"]
    names = dict.fromkeys(r["config"] for r in recs if r["kind"] == "decode" and r["config"] not in FP8_CONFIGS)
    for name in names:
        for key, style, what in ((name, "-", "fp8's batch"), (f"{name}_at_own_max_batch", "--", "own batch")):
            pts = sorted((int(c), row[key] if key == name else row[key]["vs_best_fp8"])
                         for c, row in ratios.items() if row.get(key) is not None)
            if pts:
                axes[1].plot([c for c, _ in pts], [v for _, v in pts], style, marker="o",
                             label=f"{name}, {what}")
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[1].set_ylabel("decode tokens/s / fp8's")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("prompt tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
