"""The zero-config / tune / our-FP8 table of each model's eval/results.json, and the target check.

usage: python make_tables.py MODEL_SUBDIR... > tables.md   (run in this folder)
Rows: auto, flag_only, tune (eval_accuracy's ``mixed_calibrated`` run with the tune policy),
ours_fp8, nvfp4_all. Gap recovered = (top-1 of the row - nvfp4_all's) / (ours_fp8's - nvfp4_all's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROWS = (("auto", "auto"), ("flag_only", "flag_only"), ("tune", "mixed_calibrated"),
        ("ours_fp8", "ours_fp8"), ("nvfp4_all", "nvfp4_all"))


def _gap(top1: float, nvfp4: float, fp8: float) -> float:
    return (top1 - nvfp4) / (fp8 - nvfp4)


def _passkey(c: dict[str, Any]) -> str:
    pk = c.get("passkey")
    if not pk:
        return "-"
    return f"{pk['correct']}/{len(pk['trials'])}"


def table(d: dict[str, Any]) -> list[str]:
    """Markdown lines: the table of one results.json, then the target check."""
    cfg = d["configs"]
    s = d["settings"]
    top1 = {row: cfg[name]["nll"]["top1_agreement"] for row, name in ROWS if row != "auto"}
    out = [f"**{d['model_name']}**: {s['nll_windows']} x {s['window_tokens']}-token held-out windows "
           f"(end of Brown); passkey at {s['passkey_context']} tokens x {len(s['passkey_depths'])} trials",
           "", "| config | KV bytes vs FP8 | ΔNLL nats/token [95% CI] | top-1 agree | gap recovered | passkey |",
           "|---|---|---|---|---|---|"]
    for row, name in ROWS:
        c = cfg[name]
        n = c["nll"]
        if row == "auto":
            dn, t1, gap = "0 (reference)", "1 (reference)", "-"
        else:
            m = n["delta_nll"]
            dn = f"{m['mean']:+.4f} [{m['lo']:+.4f}, {m['hi']:+.4f}]"
            t1 = f"{n['top1_agreement']:.4f}"
            gap = f"{_gap(top1[row], top1['nvfp4_all'], top1['ours_fp8']):.0%}"
        out.append(f"| {row} | {c['fraction_of_fp8']:.3f} | {dn} | {t1} | {gap} | {_passkey(c)} |")
    fo, tu = cfg["flag_only"]["nll"], cfg["mixed_calibrated"]["nll"]
    fo_d, tu_d = fo["delta_nll"], tu["delta_nll"]
    checks = [
        ("flag_only top-1 within 0.02 of tune's", abs(fo["top1_agreement"] - tu["top1_agreement"]) <= 0.02,
         f"{fo['top1_agreement']:.4f} vs {tu['top1_agreement']:.4f}"),
        ("flag_only ΔNLL within tune's 95% CI or <= 1.5x tune's",
         tu_d["lo"] <= fo_d["mean"] <= tu_d["hi"] or fo_d["mean"] <= 1.5 * tu_d["mean"],
         f"{fo_d['mean']:+.4f} vs tune {tu_d['mean']:+.4f} [{tu_d['lo']:+.4f}, {tu_d['hi']:+.4f}]"),
        ("flag_only top-1 never below nvfp4_all's", fo["top1_agreement"] >= top1["nvfp4_all"],
         f"{fo['top1_agreement']:.4f} vs {top1['nvfp4_all']:.4f}"),
        ("tune recovers >= 60% of the nvfp4_all -> ours_fp8 top-1 gap",
         _gap(top1["tune"], top1["nvfp4_all"], top1["ours_fp8"]) >= 0.6,
         f"{_gap(top1['tune'], top1['nvfp4_all'], top1['ours_fp8']):.0%}"),
    ]
    out += ["", "| target | met? | measured |", "|---|---|---|"]
    out += [f"| {t} | {'met' if ok else 'NOT met'} | {m} |" for t, ok, m in checks]
    return out


def main(dirs: list[str]) -> None:
    for sub in dirs:
        d = json.loads((Path(sub) / "eval" / "results.json").read_text())
        print("\n".join(table(d)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
