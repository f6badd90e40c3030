"""What people look at: per-layer sensitivity PNG, damage-vs-bytes PNG and ``REPORT.md``.

Everything is rendered from the JSON files of a report directory (``sensitivity.json`` and any
``selection-*.json``), so re-rendering is cheap and always consistent with the numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_nvfp4.calibration.report_files import check_schema, read_json
from vllm_nvfp4.calibration.selection import NVFP4_SLOT, predicted_curve, sweep_base
from vllm_nvfp4.calibration.sink_choice import sink_line

SENSITIVITY_PNG = "sensitivity.png"
DAMAGE_PNG = "damage_vs_bytes.png"
REPORT_MD = "REPORT.md"


def _unspent(sel: dict) -> str:
    """Note for a selection that left FP8 slots of its budget unused (NVFP4 measured no worse)."""
    allowed = sel.get("fp8_slots_allowed", sel["fp8_slots"])
    if allowed == sel["fp8_slots"]:
        return ""
    return f" of {allowed} allowed: the others measured no worse in NVFP4"


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: what the report reads from a ``selection-N.json`` (``run_select`` writes it)
_SELECTION_SCHEMA: dict[str, Any] = {
    "fp8_slots": int, "metric": str, "fraction_of_fp8": float,
    "selected": {"policy": str}, "naive": {"policy": str},
    "all_fp8": {"kl": float, "dnll": float}, "all_nvfp4": {"kl": float, "dnll": float},
}
_MEASURED_SCHEMA: dict[str, Any] = {
    "measured_on": {"same_windows_as_analysis": bool},
    "selected": {"measured": {"kl": float, "dnll": float}},
    "naive": {"measured": {"kl": float, "dnll": float}},
}


def load_selections(report_dir: Path) -> list[dict[str, Any]]:
    """All ``selection-*.json`` of a report directory, by number of FP8 slots (checked:
    :class:`~vllm_nvfp4.calibration.report_files.ReportError` names a malformed or incomplete file)."""
    out = []
    for path in sorted(Path(report_dir).glob("selection-*.json")):
        sel = read_json(path)
        check_schema(sel, _SELECTION_SCHEMA, path)
        if isinstance(sel["selected"], dict) and "measured" in sel["selected"]:
            check_schema(sel, _MEASURED_SCHEMA, path)
        out.append(sel)
    return sorted(out, key=lambda s: s["fp8_slots"])


def plot_sensitivity(report: dict[str, Any], path: Path) -> None:
    """Bars of each layer's marginal KL and delta NLL for K and V (what the slot costs in NVFP4,
    the rest at the sweep's base)."""
    plt = _plt()
    idx = [e["index"] for e in report["layers"]]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.3 * len(idx) + 3), 7), sharex=True)
    for ax, metric, label in ((axes[0], "kl_marginal", "KL vs reference (nats/token)"),
                              (axes[1], "dnll_marginal", "delta NLL (nats/token)")):
        for off, kv, color in ((-0.2, "k", "tab:red"), (0.2, "v", "tab:blue")):
            ax.bar([i + off for i in idx], [e[kv][metric] for e in report["layers"]], width=0.4,
                   color=color, label=f"{kv.upper()} -> NVFP4")
        ax.axhline(0, color="black", lw=0.6)
        ax.set_ylabel(f"marginal {label}")
        ax.legend(loc="upper right")
    se = max(e[kv].get("dnll_vs_base_se", 0.0) for e in report["layers"] for kv in ("k", "v"))
    base = sweep_base(report)
    axes[1].axhspan(-se, se, color="grey", alpha=0.25, label=f"+-1 s.e. (paired vs all-{base.upper()})")
    axes[1].legend(loc="upper right")
    axes[1].set_xlabel("layer")
    axes[1].set_xticks(idx)
    alone = "one K or V slot in NVFP4, the rest FP8" if base == "fp8" else \
        "one K or V slot in FP8, the rest NVFP4"
    axes[0].set_title(f"{Path(report['model']['path']).name}: {alone}\n"
                      f"(damage with the slot in NVFP4 minus in FP8; {report['data']['eval_windows']} x "
                      f"{report['data']['window_tokens']} held-out tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_damage_vs_bytes(report: dict[str, Any], selections: list[dict[str, Any]], path: Path) -> None:
    """Measured delta NLL and KL of the candidate policies against their KV bytes."""
    plt = _plt()
    cfg = report["configs"]
    rank_by = selections[-1]["metric"] if selections else "kl"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, label in ((axes[0], "dnll", "delta NLL vs reference (nats/token)"),
                              (axes[1], "kl", "KL vs reference (nats/token)")):
        if metric == rank_by:  # the additive prediction is only smooth for the ranking metric
            xs, ys = zip(*predicted_curve(report, metric, rank_by))
            ax.plot(xs, ys, color="grey", lw=1, ls="--", label="selected, predicted (additive)")
        ax.scatter([1.0], [cfg["all_fp8"][metric]], marker="s", color="black", label="all-FP8 (analysis windows)", zorder=3)
        ax.scatter([NVFP4_SLOT], [cfg["all_nvfp4"][metric]], marker="X", color="tab:red", s=70, label="all-NVFP4 (analysis windows)", zorder=3)
        for n, sel in enumerate(selections):
            if "measured" not in sel["selected"]:
                continue
            if not sel["measured_on"]["same_windows_as_analysis"]:
                ax.scatter([1.0, NVFP4_SLOT], [sel["all_fp8"][metric], sel["all_nvfp4"][metric]], marker="D",
                           facecolors="none", edgecolors="black",
                           label="all-FP8 / all-NVFP4 on the selection's windows" if n == 0 else None, zorder=3)
            x = sel["fraction_of_fp8"]
            ax.scatter([x], [sel["naive"]["measured"][metric]], marker="v", color="tab:orange",
                       label="naive first/last (measured)" if n == 0 else None, zorder=3)
            ax.scatter([x], [sel["selected"]["measured"][metric]], marker="o", color="tab:green",
                       label="selected (measured)" if n == 0 else None, zorder=3)
        ax.set_xlabel("KV bytes (fraction of all-FP8)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"{Path(report['model']['path']).name}: damage against KV-cache size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _row(name: str, frac: float, m: dict[str, Any]) -> str:
    top1 = "-" if m.get("top1") is None else f"{m['top1']:.4f}"  # absent from older reports
    return f"| {name} | {frac:.4f} | {m['dnll']:.5f} ± {m['dnll_se']:.5f} | {m['kl']:.5f} | {top1} |"


def commands(report: dict[str, Any], selections: list[dict[str, Any]], report_dir: str = "REPORT_DIR") -> list[str]:
    """Command lines that reproduce the report (rebuilt from the recorded settings)."""
    st, model = report["settings"], report["model"]
    analyze = (f"vllm-nvfp4 analyze {model['path']} --data {' '.join(f['path'] for f in report['data']['files'])} "
               f"--out {report_dir} --window {st['window']} --windows {st['windows']}")
    if st["calib_windows"]:
        analyze += f" --calib-windows {st['calib_windows']}"
    else:
        analyze += f" --scales {st['scales_from']}"
    if st.get("k_smooth") is not None:  # absent from reports written before the flag existed
        analyze += f" --k-smooth {st['k_smooth']}"
    if st.get("k_center"):
        analyze += " --k-center"
    if st.get("k_permute"):  # absent from reports written before the flag existed
        analyze += " --k-permute"
    if st.get("k_rot_pairs"):  # absent from reports written before the flag existed
        analyze += f" --k-rot-pairs {st['k_rot_pairs']}"
    analyze += " --per-head" * bool(st["per_head"]) + f" --dtype {model['dtype']}"
    analyze += f" --base {sweep_base(report)}"
    out = [analyze]
    for sel in selections:
        allowed = sel.get("fp8_slots_allowed", sel["fp8_slots"])  # absent before "at most"
        size = f"--budget {sel['budget']}" if sel.get("budget") is not None else f"--fp8-slots {allowed}"
        cmd = f"vllm-nvfp4 select {report_dir} {size} --metric {sel['metric']}"
        on = sel.get("measured_on")
        if on and not on["same_windows_as_analysis"]:
            cmd += f" --measure-windows {on['windows']}"
        out.append(cmd + " --out POLICY.json")
    return out


def markdown(report: dict[str, Any], selections: list[dict[str, Any]]) -> str:
    """The short human report."""
    cfg, model, data, st = report["configs"], report["model"], report["data"], report["settings"]
    lines = [
        f"# KV-cache sensitivity: {Path(model['path']).name}",
        "",
        f"Generated {report['date']} by vllm-nvfp4 {report['tool']['version']} (`analyze`: "
        f"{report['seconds']:.0f} s, {st['forwards']} forwards, prefix reuse {'on' if st['prefix_reuse'] else 'off'}).",
        f"Model: {model['num_layers']} layers, {model['num_kv_heads']} KV heads, head_dim {model['head_dim']}, "
        f"{model['dtype']}; config sha256 `{model['config_sha256'][:16]}`.",
        f"Data: {', '.join(Path(f['path']).name for f in data['files'])}; {data['calib_windows']} calibration + "
        f"{data['eval_windows']} held-out windows of {data['window_tokens']} tokens "
        f"({cfg['reference']['tokens']} scored tokens). Reference NLL {cfg['reference']['nll']:.4f} nats/token.",
        "",
        "Damage against the unquantized reference (delta NLL ± one paired standard error; KL of the",
        "next-token distributions), in nats/token:",
        "",
        "| configuration | KV bytes / FP8 | delta NLL | KL | top-1 agreement |",
        "|---|---|---|---|---|",
        _row("reference repeat (noise floor)", 2.0, cfg["reference_repeat"]),
        _row("all-FP8 (calibrated)", 1.0, cfg["all_fp8"]),
        _row("all-NVFP4 (calibrated)", NVFP4_SLOT, cfg["all_nvfp4"]),
    ]
    top = sorted(((e[kv]["kl_marginal"], e["index"], kv) for e in report["layers"] for kv in ("k", "v")),
                 reverse=True)[:8]
    lines += ["", f"Most sensitive slots (marginal KL, swept from all-{sweep_base(report).upper()}): "
              + ", ".join(f"L{i}.{kv.upper()} {d:.4f}" for d, i, kv in top) + ".", ""]
    for sel in selections:
        if "measured" not in sel["selected"]:
            continue
        s, n = sel["selected"], sel["naive"]
        nv = sel["all_nvfp4"]["dnll"]  # on the windows the selection was measured on
        on = sel.get("measured_on", {})
        ratio = s["measured"]["dnll"] / nv if nv else float("nan")
        lines += [
            f"## Selection at {sel['fraction_of_fp8']:.4f}x FP8 bytes ({sel['fp8_slots']} FP8 slots"
            f"{_unspent(sel)}, by {sel['metric']})",
            "",
            f"Measured on {on.get('windows', '?')} windows of {on.get('window_tokens', '?')} tokens "
            f"({'the analysis windows' if on.get('same_windows_as_analysis') else 'starting with the analysis windows; partly fresh text'}).",
            "",
            "| policy | KV bytes / FP8 | delta NLL | KL | top-1 agreement |",
            "|---|---|---|---|---|",
            _row("all-FP8", 1.0, sel["all_fp8"]),
            _row("all-NVFP4", NVFP4_SLOT, sel["all_nvfp4"]),
            _row(f"selected `{s['policy']}`", sel["fraction_of_fp8"], s["measured"]),
            _row(f"naive `{n['policy']}`", sel["fraction_of_fp8"], n["measured"]),
            "",
            f"- selected delta NLL = {s['measured']['dnll']:.5f} = {100 * ratio:.1f}% of all-NVFP4's {nv:.5f}; "
            f"naive = {n['measured']['dnll']:.5f} ({100 * n['measured']['dnll'] / nv if nv else float('nan'):.1f}%).",
            f"- additivity (measured / predicted from the analysis windows): selected KL {s['measured_over_predicted']['kl']}, "
            f"delta NLL {s['measured_over_predicted']['dnll']}; naive KL {n['measured_over_predicted']['kl']}, "
            f"delta NLL {n['measured_over_predicted']['dnll']}.",
            *([f"- {sink_line(sel['sink_key'])} on the selected policy (its row: the kept one)."]
              if "sink_key" in sel else []),
            "",
        ]
    lines += [f"![sensitivity]({SENSITIVITY_PNG})", "", f"![damage vs bytes]({DAMAGE_PNG})", "",
              "## Commands", "", "```", *commands(report, selections), "```", ""]
    return "\n".join(lines)


def render(report_dir: Path) -> list[Path]:
    """(Re)write both PNGs and ``REPORT.md`` of a report directory; returns their paths."""
    from vllm_nvfp4.calibration.sensitivity import load_report

    report_dir = Path(report_dir)
    report, _ = load_report(report_dir)
    selections = load_selections(report_dir)
    outs = [report_dir / SENSITIVITY_PNG, report_dir / DAMAGE_PNG, report_dir / REPORT_MD]
    plot_sensitivity(report, outs[0])
    plot_damage_vs_bytes(report, selections, outs[1])
    outs[2].write_text(markdown(report, selections), encoding="utf-8")
    return outs
