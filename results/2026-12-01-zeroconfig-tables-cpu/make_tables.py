"""The zero-config / tune / our-FP8 table of each model's eval/results.json, and the target check.

usage: python make_tables.py MODEL_SUBDIR... > tables.md   (run in this folder)
A ``MODEL_SUBDIR/eval_tune/results.json`` (the tune row rerun) replaces the tune row (:func:`load`).
Rows: auto, flag_only, tune (eval_accuracy's ``mixed_calibrated`` run with the tune policy),
ours_fp8, nvfp4_all. Where :data:`SELECT_RUNS` names a later flag-only run (the start-up
selection), that run is the flag_only row and the one in eval/ becomes "flag_only, rule (before)". Gap recovered = (top-1 of the row - nvfp4_all's) / (ours_fp8's - nvfp4_all's).
KV bytes vs FP8: per token over all layers (what a short context holds); for models with sliding
layers also over the full-attention layers only (what grows with a long context).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from vllm_nvfp4.policy import KVPolicy, LayerType

ROWS = (("auto", "auto"), ("flag_only", "flag_only"), ("tune", "mixed_calibrated"),
        ("ours_fp8", "ours_fp8"), ("nvfp4_all", "nvfp4_all"))
BEFORE = ("flag_only, rule (before)", "flag_only_rule")
#: model subfolder -> results.json of a flag-only run with the start-up selection (same settings)
SELECT_RUNS = {"smollm2": "../2026-12-01-startup-select-cpu/smollm2_eval/results.json",
               "gemma3_270m": "../2026-12-01-startup-select-cpu/gemma3_270m_eval/results.json"}


def _gap(top1: float, nvfp4: float, fp8: float) -> float:
    return (top1 - nvfp4) / (fp8 - nvfp4)


def _full_layer_fraction(compact: str | None, layer_types: list[dict[str, Any]]) -> str:
    if compact is None:
        return "-"
    types = [LayerType(t["type"], t.get("window"), t.get("sinks", False)) for t in layer_types]
    return f"{KVPolicy.from_compact(compact, len(types), layer_types=types).fraction_of_fp8():.3f}"


def _passkey(c: dict[str, Any]) -> str:
    pk = c.get("passkey")
    if not pk:
        return "-"
    return f"{pk['correct']}/{len(pk['trials'])}"


def _checks(cfg: dict[str, Any], s: dict[str, Any], top1: dict[str, float]) -> list[tuple[str, Any, str]]:
    """``(target, met: bool or None = not measured, measured)`` of the zero-config and tune targets."""
    fo = cfg["flag_only"]["nll"]
    out: list[tuple[str, Any, str]] = [
        ("flag_only top-1 never below nvfp4_all's", fo["top1_agreement"] >= top1["nvfp4_all"],
         f"{fo['top1_agreement']:.4f} vs {top1['nvfp4_all']:.4f}")]
    tu = cfg["mixed_calibrated"].get("nll")
    if tu is None:
        out += [(t, None, "tune's engine did not start") for t in (
            "flag_only top-1 within 0.02 of tune's", "flag_only ΔNLL within tune's 95% CI or <= 1.5x tune's",
            "tune recovers >= 60% of the nvfp4_all -> ours_fp8 top-1 gap")]
    else:
        fo_d, tu_d = fo["delta_nll"], tu["delta_nll"]
        gap = _gap(top1["tune"], top1["nvfp4_all"], top1["ours_fp8"])
        out += [
            ("flag_only top-1 within 0.02 of tune's", abs(fo["top1_agreement"] - tu["top1_agreement"]) <= 0.02,
             f"{fo['top1_agreement']:.4f} vs {tu['top1_agreement']:.4f}"),
            ("flag_only ΔNLL within tune's 95% CI or <= 1.5x tune's",
             tu_d["lo"] <= fo_d["mean"] <= tu_d["hi"] or fo_d["mean"] <= 1.5 * tu_d["mean"],
             f"{fo_d['mean']:+.4f} vs tune {tu_d['mean']:+.4f} [{tu_d['lo']:+.4f}, {tu_d['hi']:+.4f}]"),
            ("tune recovers >= 60% of the nvfp4_all -> ours_fp8 top-1 gap", gap >= 0.6, f"{gap:.0%}")]
    pk = {row: cfg[name].get("passkey") for row, name in ROWS}
    target = f"passkey at {s['passkey_context']} tokens: flag_only and tune within one trial of ours_fp8"
    if all(pk.values()):
        n = {row: v["correct"] for row, v in pk.items()}
        out.append((target, abs(n["flag_only"] - n["ours_fp8"]) <= 1 and abs(n["tune"] - n["ours_fp8"]) <= 1,
                    f"{n['flag_only']}, {n['tune']} vs {n['ours_fp8']} of {len(pk['auto']['trials'])}"))
    elif s["passkey_depths"]:
        out.append((target, None, "a row has no passkey result"))
    return out


def table(d: dict[str, Any]) -> list[str]:
    """Markdown lines: the table of one results.json, then the target check."""
    cfg = d["configs"]
    s = d["settings"]
    types = d["shape"]["layer_types"]
    hybrid = any(t["type"] != "full" for t in types)
    rows = [*ROWS[:2], BEFORE, *ROWS[2:]] if BEFORE[1] in cfg else ROWS
    top1 = {row: cfg[name]["nll"]["top1_agreement"] for row, name in rows if "nll" in cfg[name] and row != "auto"}
    out = [f"**{d['model_name']}**: {s['nll_windows']} x {s['window_tokens']}-token held-out windows "
           f"(end of Brown); passkey at {s['passkey_context']} tokens x {len(s['passkey_depths'])} trials",
           "", "| config | KV bytes vs FP8 |" + (" x FP8, full layers |" if hybrid else "")
           + " ΔNLL nats/token [95% CI] | top-1 agree | gap recovered | passkey |",
           "|---|---|" + ("---|" if hybrid else "") + "---|---|---|---|"]
    for row, name in rows:
        c = cfg[name]
        if "error" in c:
            dn, t1, gap = c["error"].splitlines()[0].strip(), "-", "-"
        elif row == "auto":
            dn, t1, gap = "0 (reference)", "1 (reference)", "-"
        else:
            m = c["nll"]["delta_nll"]
            dn = f"{m['mean']:+.4f} [{m['lo']:+.4f}, {m['hi']:+.4f}]"
            t1 = f"{top1[row]:.4f}"
            gap = f"{_gap(top1[row], top1['nvfp4_all'], top1['ours_fp8']):.0%}"
        full = f" {_full_layer_fraction(c['policy'], types)} |" if hybrid else ""
        out.append(f"| {row} | {c['fraction_of_fp8']:.3f} |{full} {dn} | {t1} | {gap} | {_passkey(c)} |")
    out += ["", "| target | met? | measured |", "|---|---|---|"]
    out += [f"| {t} | {'not measured' if ok is None else 'met' if ok else 'NOT met'} | {m} |"
            for t, ok, m in _checks(cfg, s, top1)]
    return out


def load(sub: str) -> dict[str, Any]:
    """``sub/eval/results.json``; where ``sub/eval_tune/results.json`` exists (the ``tune`` row
    rerun with its own ``auto`` reference), its ``mixed_calibrated`` replaces the first run's."""
    d = json.loads((Path(sub) / "eval" / "results.json").read_text())
    rerun = Path(sub) / "eval_tune" / "results.json"
    if rerun.exists():
        d["configs"]["mixed_calibrated"] = json.loads(rerun.read_text())["configs"]["mixed_calibrated"]
    return d


def main(dirs: list[str]) -> None:
    for sub in dirs:
        d = load(sub)
        if sub.rstrip("/") in SELECT_RUNS:
            new = json.loads(Path(SELECT_RUNS[sub.rstrip("/")]).read_text())
            for key in ("nll_windows", "window_tokens", "passkey_context", "passkey_depths"):
                assert new["settings"][key] == d["settings"][key], key  # the same measurement
            d["configs"][BEFORE[1]] = d["configs"]["flag_only"]
            d["configs"]["flag_only"] = new["configs"]["flag_only"]
        print("\n".join(table(d)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
