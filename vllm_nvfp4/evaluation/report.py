"""Results of ``scripts/eval_accuracy.py`` as a markdown table, target checks and a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

TARGET_FRACTION = 0.62  # mixed at <= 0.62x FP8 bytes
TARGET_DNLL_RATIO = 0.30  # delta NLL <= 30% of all-NVFP4's
TARGET_GSM8K_POINTS = 0.01  # within 1 point of FP8 (or its stderr, whichever is larger)
TARGET_GSM8K_MIN_FP8 = 0.30  # ... on a model that scores >= 30% with FP8
FP8_REFERENCES = ("fp8", "ours_fp8")  # vLLM's FP8 cache and ours with calibrated scales: targets vs each


def _f(x: Optional[float], fmt: str = "{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: Optional[float], se: Optional[float] = None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}" + (f" ± {100 * se:.1f}" if se is not None else "")


def markdown_table(results: Mapping[str, Any]) -> str:
    """One row per configuration: bytes, delta NLL (95% CI), top-1, passkey, GSM8K."""
    head = ("| config | KV B/token (vLLM) | B/token (arith.) | x FP8 | ΔNLL nats/tok [95% CI] | top-1 agree | "
            "passkey (answer log-prob) | GSM8K n | GSM8K strict % | GSM8K flexible % | flex. Δ vs FP8 refs (paired) |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for name, r in results["configs"].items():
        kv = r.get("kv_bytes", {})
        nll = r.get("nll")
        if nll is None:
            dn, top = "-", "-"
        elif name == "auto":
            fl = results.get("noise_floor")
            dn = "0 (ref.)" + (f"; repeat {fl['delta_nll']['mean']:+.5f}" if fl else "")
            top = "1 (ref.)" + (f"; repeat {fl['top1_agreement']:.4f}" if fl else "")
        else:
            d = nll["delta_nll"]
            dn, top = f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}]", f"{nll['top1_agreement']:.4f}"
        pk = r.get("passkey")
        pk_s = f"{pk['correct']}/{len(pk['trials'])} ({pk['mean_answer_logprob']:.3f})" if pk else "-"
        g = r.get("gsm8k") or {}
        s, fx = g.get("strict-match") or {}, g.get("flexible-extract") or {}
        pds = [(ref, (g.get("paired_vs") or {}).get(ref, {}).get("flexible-extract")) for ref in FP8_REFERENCES]
        pd_s = "; ".join(f"{ref} {100 * pd['diff']:+.1f} ± {100 * pd['stderr']:.1f}" for ref, pd in pds
                         if pd and pd.get("diff") is not None) or "-"
        lines.append(f"| {name} | {_f(kv.get('measured'), '{:.1f}')} | {_f(kv.get('expected'), '{:.0f}')} | "
                     f"{_f(r.get('fraction_of_fp8'), '{:.3f}')} | {dn} | {top} | {pk_s} | {g.get('n') or '-'} | "
                     f"{_pct(s.get('acc'), s.get('stderr'))} | {_pct(fx.get('acc'), fx.get('stderr'))} | {pd_s} |")
    return "\n".join(lines)


def check_targets(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The accuracy targets for ``mixed_calibrated``, each with ``status`` pass / FAIL / n/a and why.

    The FP8 comparisons (GSM8K, passkey) are made against every FP8 reference that was run
    (:data:`FP8_REFERENCES`), one row each.
    """
    cfg = results["configs"]
    mixed, nv = cfg.get("mixed_calibrated"), cfg.get("nvfp4_all")
    out: list[dict[str, Any]] = []
    if mixed is None:
        return [{"target": "all", "status": "n/a", "detail": "mixed_calibrated was not evaluated"}]
    frac = mixed.get("fraction_of_fp8")
    out.append({"target": f"KV bytes <= {TARGET_FRACTION}x FP8", "status": "pass" if frac <= TARGET_FRACTION + 1e-9 else "FAIL",
                "detail": f"{frac:.4f}x"})
    ratio = results.get("dnll_ratio_mixed_over_nvfp4_all")
    if ratio is None:
        out.append({"target": "ΔNLL <= 30% of all-NVFP4", "status": "n/a", "detail": "needs auto, nvfp4_all, mixed_calibrated"})
    else:
        ok = ratio["ratio"] <= TARGET_DNLL_RATIO
        out.append({"target": "ΔNLL <= 30% of all-NVFP4", "status": "pass" if ok else "FAIL",
                    "detail": f"ratio {ratio['ratio']:.3f} (window bootstrap 95% CI {ratio['lo']:.3f}-{ratio['hi']:.3f})"})
    refs = [r for r in FP8_REFERENCES if r in cfg]
    if not refs:
        out.append({"target": "GSM8K and passkey vs FP8", "status": "n/a", "detail": "no FP8 reference evaluated"})
    for ref in refs:
        out += _fp8_targets(mixed, cfg[ref], ref)
    if nv is None:
        out.append({"target": "note", "status": "n/a", "detail": "nvfp4_all not evaluated"})
    return out


def _fp8_targets(mixed: Mapping[str, Any], fp8: Mapping[str, Any], ref: str) -> list[dict[str, Any]]:
    """GSM8K and passkey targets of ``mixed`` against the FP8 reference configuration ``ref``."""
    out: list[dict[str, Any]] = []
    g_m, g_f = (mixed.get("gsm8k") or {}), (fp8.get("gsm8k") or {})
    fm, ff = g_m.get("flexible-extract"), g_f.get("flexible-extract")
    if not fm or not ff or fm.get("acc") is None or ff.get("acc") is None:
        out.append({"target": f"GSM8K within 1 pt / stderr of FP8 ({ref})", "status": "n/a",
                    "detail": "GSM8K not run for both"})
    else:
        for filt in ("strict-match", "flexible-extract"):
            a, b = g_m[filt], g_f[filt]
            diff = a["acc"] - b["acc"]
            tol = max(TARGET_GSM8K_POINTS, b.get("stderr") or 0.0)
            within = abs(diff) <= tol or diff > 0
            status = ("pass" if within else "FAIL") if b["acc"] >= TARGET_GSM8K_MIN_FP8 else "n/a (model too weak)"
            out.append({"target": f"GSM8K {filt} within max(1 pt, stderr) of FP8 ({ref})", "status": status,
                        "detail": f"mixed {100 * a['acc']:.1f}% vs {ref} {100 * b['acc']:.1f}% (diff {100 * diff:+.1f}, "
                                  f"tolerance {100 * tol:.1f}; FP8 must score >= {100 * TARGET_GSM8K_MIN_FP8:.0f}% to judge)"})
    p_m, p_f = mixed.get("passkey"), fp8.get("passkey")
    if not p_m or not p_f:
        out.append({"target": f"passkey equal to FP8 ({ref})", "status": "n/a", "detail": "passkey not run for both"})
    else:
        ok = p_m["correct"] >= p_f["correct"]  # "equal to FP8": not fewer keys retrieved
        out.append({"target": f"passkey equal to FP8 ({ref})", "status": "pass" if ok else "FAIL",
                    "detail": f"mixed {p_m['correct']}/{len(p_m['trials'])} vs {ref} {p_f['correct']}/{len(p_f['trials'])}"})
    return out


def targets_markdown(checks: list[dict[str, Any]]) -> str:
    lines = ["| target | status | measured |", "|---|---|---|"]
    lines += [f"| {c['target']} | {c['status']} | {c['detail']} |" for c in checks]
    return "\n".join(lines)


def plot(results: Mapping[str, Any], path: Path) -> Optional[Path]:
    """Delta NLL and GSM8K (flexible) against KV bytes per token; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [(n, r) for n, r in results["configs"].items() if r.get("kv_bytes", {}).get("expected")]
    has_gsm = any((r.get("gsm8k") or {}).get("flexible-extract") for _, r in rows)
    fig, axes = plt.subplots(1, 2 if has_gsm else 1, figsize=(11 if has_gsm else 6, 4.2), squeeze=False)
    ax = axes[0][0]
    for name, r in rows:
        x = r["kv_bytes"]["expected"]
        if name == "auto":
            y, lo, hi = 0.0, 0.0, 0.0
        elif r.get("nll"):
            d = r["nll"]["delta_nll"]
            y, lo, hi = d["mean"], d["mean"] - d["lo"], d["hi"] - d["mean"]
        else:
            continue
        ax.errorbar([x], [y], yerr=[[lo], [hi]], fmt="o", capsize=4)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xlabel("KV-cache bytes per token")
    ax.set_ylabel("ΔNLL vs BF16 (nats/token, 95% CI)")
    ax.set_title(f"{results['model_name']}: teacher-forced ΔNLL", fontsize=10)
    if has_gsm:
        ax = axes[0][1]
        for name, r in rows:
            g = (r.get("gsm8k") or {}).get("flexible-extract")
            if not g or g.get("acc") is None:
                continue
            x = r["kv_bytes"]["expected"]
            ax.errorbar([x], [100 * g["acc"]], yerr=[100 * (g.get("stderr") or 0)], fmt="s", capsize=4)
            ax.annotate(name, (x, 100 * g["acc"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel("KV-cache bytes per token")
        ax.set_ylabel("GSM8K flexible-extract % (± stderr)")
        n = next(((r.get("gsm8k") or {}).get("n") for _, r in rows if r.get("gsm8k")), None)
        ax.set_title(f"GSM8K (lm-eval, n={n})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
