"""The ``calibrate`` and ``select`` workflows behind the CLI (``analyze`` is in :mod:`sensitivity`)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import vllm_nvfp4
from vllm_nvfp4.calibration.data import load_windows
from vllm_nvfp4.calibration.evaluator import Evaluator
from vllm_nvfp4.calibration.modeling import config_sha256, load_model
from vllm_nvfp4.calibration.progress import progress
from vllm_nvfp4.calibration.report_files import ReportError
from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy, with_formats
from vllm_nvfp4.calibration.selection import (
    count_fp8_slots,
    fraction_for_slots,
    naive_formats,
    report_layer_types,
    predict,
    select_formats,
)
from vllm_nvfp4.calibration.sensitivity import all_format, load_report, utc_now
from vllm_nvfp4.policy import KVPolicy, default_policy

logger = logging.getLogger(__name__)


def _tool(command: str) -> dict[str, str]:
    return {"name": "vllm-nvfp4", "version": vllm_nvfp4.__version__, "command": command}


def run_calibrate(model_dir: Path, data: Sequence[Path], formats: Optional[str] = None,
                  window: int = 2048, windows: int = 4, per_head: bool = False,
                  dtype: str = "bfloat16", k_smooth: Optional[float] = None,
                  k_center: bool = False) -> KVPolicy:
    """Calibrate K/V scales on ``windows`` windows; formats from the compact ``formats`` string
    (default rule when ``None``). Returns the policy with scales and provenance (not saved)."""
    model, tokenizer, info = load_model(model_dir, dtype)
    fmt = (KVPolicy.from_compact(formats, info.num_layers, source="--policy",
                                 layer_types=info.layer_types) if formats
           else default_policy(info.num_layers, info.layer_types))
    toks = load_windows(data, tokenizer, window, count=0, calib=windows, max_positions=info.max_positions)
    observer = observe_amax(model, toks.calib, info.num_layers, kv_layers=info.kv_layers)
    prov = {"tool": _tool("calibrate"), "created": utc_now(), "model": info.to_dict(),
            "data": toks.describe(), "formats_from": "--policy" if formats else "default rule",
            "scales": "per KV head" if per_head else "per layer",
            "k_smooth_alpha": k_smooth, "k_center": k_center,
            "conventions": {"fp8_scale": "amax/448", "nvfp4_global_scale": "amax/2688"}}
    return scaled_policy(fmt, observer, per_head, prov, k_smooth, k_center)


def _check_same_inputs(report: dict[str, Any]) -> None:
    """Refuse to measure when the model config or data changed since ``analyze``."""
    model_dir = Path(report["model"]["path"])
    if config_sha256(model_dir) != report["model"]["config_sha256"]:
        raise ReportError(f"{model_dir}/config.json changed since the analysis; re-run analyze")
    for f in report["data"]["files"]:
        p = Path(f["path"])
        if not p.is_file() or hashlib.sha256(p.read_bytes()).hexdigest() != f["sha256"]:
            raise ReportError(f"data file {p} is missing or changed since the analysis; re-run analyze")


def run_select(report_dir: Path, fp8_slots: int, metric: str = "kl", measure: bool = True,
               budget: Optional[float] = None, measure_windows: Optional[int] = None,
               ) -> tuple[KVPolicy, dict[str, Any]]:
    """Select formats for at most ``fp8_slots`` FP8 slots (:func:`select_formats`); measure them
    and the naive rule with as many FP8 slots (unless ``measure=False``); write
    ``selection-<fp8_slots>.json`` into ``report_dir``.

    Measurement uses the analysis' held-out windows, or the first ``measure_windows`` windows from
    the same starting point (more than the analysis used = partly fresh text; all-FP8 and
    all-NVFP4 are then re-measured on exactly those windows). Returns
    ``(policy with scales and provenance, selection summary)``.
    """
    report, scales = load_report(report_dir)
    num_layers = len(report["layers"])  # KV layers (one analysis entry each)
    chosen = select_formats(report, fp8_slots, metric)
    used = count_fp8_slots(chosen)  # < fp8_slots when fewer slots lose anything in NVFP4
    naive = naive_formats(num_layers, used, report_layer_types(report))
    summary: dict[str, Any] = {
        "fp8_slots": used, "fp8_slots_allowed": fp8_slots, "budget": budget, "metric": metric,
        "fraction_of_fp8": round(fraction_for_slots(num_layers, used), 6),
        "selected": {"policy": chosen.to_compact(),
                     "predicted": {m: round(predict(report, chosen, m), 8) for m in ("kl", "dnll")}},
        "naive": {"policy": naive.to_compact(),
                  "predicted": {m: round(predict(report, naive, m), 8) for m in ("kl", "dnll")}},
        "all_fp8": report["configs"]["all_fp8"], "all_nvfp4": report["configs"]["all_nvfp4"],
    }
    if measure:
        measured = _measure(report, scales, {"selected": chosen, "naive": naive}, measure_windows)
        summary["measured_on"] = measured.pop("measured_on")
        for name in ("selected", "naive"):
            summary[name]["measured"] = measured.pop(name)
        summary.update(measured)  # all-FP8 / all-NVFP4 re-measured on other windows, if any
        for name in ("selected", "naive"):
            meas, pred = summary[name]["measured"], summary[name]["predicted"]
            summary[name]["measured_over_predicted"] = {
                m: round(meas[m] / pred[m], 4) if pred[m] else None for m in ("kl", "dnll")}
        nv = summary["all_nvfp4"]["dnll"]
        summary["selected_dnll_over_all_nvfp4"] = round(summary["selected"]["measured"]["dnll"] / nv, 4) if nv else None
    summary["date"] = utc_now()
    (Path(report_dir) / f"selection-{fp8_slots}.json").write_text(json.dumps(summary, indent=2) + "\n")
    prov = {"tool": _tool("select"), "created": summary["date"],
            "model": {k: report["model"][k] for k in ("path", "config_sha256", "num_layers", "num_kv_heads", "head_dim")},
            "data": report["data"], "report": str(Path(report_dir).resolve()),
            "selection": {k: v for k, v in summary.items() if k != "date"}}
    return with_formats(scales, chosen, prov, source=f"vllm-nvfp4 select ({chosen.to_compact()})"), summary


def _measure(report: dict[str, Any], scales: KVPolicy, policies: dict[str, KVPolicy],
             windows: Optional[int]) -> dict[str, Any]:
    """Metrics of ``policies`` (formats; the report's scales) by name, plus ``measured_on``; also
    ``all_fp8`` / ``all_nvfp4`` when the windows differ from the analysis'."""
    _check_same_inputs(report)
    s = report["settings"]
    n = windows or s["windows"]
    model, tokenizer, info = load_model(report["model"]["path"], report["model"]["dtype"])
    toks = load_windows([Path(f["path"]) for f in report["data"]["files"]], tokenizer,
                        s["window"], n, s["calib_windows"], info.max_positions)
    todo = {name: with_formats(scales, f) for name, f in policies.items()}
    same = n == s["windows"]
    if not same:
        todo["all_fp8"] = all_format(scales, "fp8")
        todo["all_nvfp4"] = all_format(scales, "nvfp4")
    ev = Evaluator(model, toks.eval, reuse_prefix=False)
    out: dict[str, Any] = {"measured_on": {"windows": n, "window_tokens": s["window"],
                                           "same_windows_as_analysis": same}}
    with progress(total=(1 + len(todo)) * n, desc="select: measure", unit="fwd") as bar:
        ev.reference(bar)
        for name, policy in todo.items():
            bar.set_postfix_str(name)
            out[name] = ev.measure(policy, bar).to_dict()
    return out
