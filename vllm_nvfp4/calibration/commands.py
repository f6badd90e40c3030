"""The ``calibrate``, ``select`` and ``tune`` workflows behind the CLI (``analyze`` is in
:mod:`sensitivity`)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import vllm_nvfp4
from vllm_nvfp4.calibration.data import load_windows
from vllm_nvfp4.calibration.evaluator import Evaluator
from vllm_nvfp4.calibration.modeling import (config_sha256, config_shape, load_model,
                                             read_text_config)
from vllm_nvfp4.calibration.position_range import describe as describe_range
from vllm_nvfp4.calibration.position_range import range_offsets, served_length
from vllm_nvfp4.calibration.progress import progress, single_bar
from vllm_nvfp4.calibration.report_files import ReportError
from vllm_nvfp4.calibration.scales import observe_calibration, scaled_policy, with_formats
from vllm_nvfp4.calibration.selection import (
    DEFAULT_BASE,
    count_fp8_slots,
    fraction_for_slots,
    naive_formats,
    report_layer_types,
    predict,
    select_formats,
)
from vllm_nvfp4.calibration.sensitivity import all_format, analyze, load_report, utc_now
from vllm_nvfp4.calibration import sink_choice
from vllm_nvfp4.policy import KVPolicy, default_policy

logger = logging.getLogger(__name__)


def _tool(command: str) -> dict[str, str]:
    return {"name": "vllm-nvfp4", "version": vllm_nvfp4.__version__, "command": command}


def run_calibrate(model_dir: Path, data: Sequence[Path], formats: Optional[str] = None,
                  window: int = 2048, windows: int = 4, per_head: bool = False,
                  dtype: str = "bfloat16", k_smooth: Optional[float] = None,
                  k_center: bool = False, device: str = "cpu", k_permute: bool = False,
                  k_sink_uncentered: bool = False,
                  max_model_len: Optional[int] = None, k_rot_pairs: int = 0) -> KVPolicy:
    """Calibrate K/V scales on ``windows`` windows, their range also at the positions up to
    ``max_model_len`` (:func:`~vllm_nvfp4.calibration.position_range.served_length`: None = the
    model's positions, 0 = none); formats from the compact ``formats`` string (default rule
    when ``None``); with ``k_rot_pairs`` > 0 (needs ``k_center``) the rotating K center on that
    many RoPE pairs per KV head (:mod:`~vllm_nvfp4.calibration.rot_center`). Returns the policy
    with scales and provenance (not saved)."""
    check_k_rot_args(k_rot_pairs, k_center, k_smooth, k_permute)
    served = served_length(max_model_len, config_shape(Path(model_dir))[1])
    model, tokenizer, info = load_model(model_dir, dtype, device, window, 0)
    fmt = (KVPolicy.from_compact(formats, info.num_layers, source="--policy",
                                 layer_types=info.layer_types) if formats
           else default_policy(info.num_layers, info.layer_types))
    toks = load_windows(data, tokenizer, window, count=0, calib=windows, max_positions=info.max_positions)
    offsets = range_offsets(served, window)
    observer, rot = observe_calibration(model, toks.calib, info, offsets, k_rot_pairs)
    prov = {"tool": _tool("calibrate"), "created": utc_now(), "model": info.to_dict(),
            "data": toks.describe(), "position_range": describe_range(served, offsets),
            "formats_from": "--policy" if formats else "default rule",
            "scales": "per KV head" if per_head else "per layer",
            "k_smooth_alpha": k_smooth, "k_center": k_center, "k_permute": k_permute,
            "k_sink_uncentered": k_sink_uncentered, "k_rot_pairs": k_rot_pairs if rot else 0,
            "conventions": {"fp8_scale": "amax/448", "nvfp4_global_scale": "amax/2688"}}
    return scaled_policy(fmt, observer, per_head, prov, k_smooth, k_center, k_permute,
                         k_sink_uncentered, rot)


def check_k_rot_args(k_rot_pairs: int, k_center: bool, k_smooth: Optional[float],
                     k_permute: bool) -> None:
    """``ValueError`` where ``k_rot_pairs`` (> 0: the rotating K center) cannot combine with the
    other K options: it needs K centering, and neither smoothing nor a channel permutation."""
    if not k_rot_pairs:
        return
    if not k_center:
        raise ValueError("--k-rot-pairs centers K on a rotating offset on top of K centering; "
                         "it needs --k-center")
    if k_smooth is not None or k_permute:
        raise ValueError("--k-rot-pairs does not combine with --k-smooth or --k-permute (the "
                         "rotated pairs would not be the cache's channels (i, i + head_dim/2))")


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
               device: str = "cpu", sink_key: bool = False) -> tuple[KVPolicy, dict[str, Any]]:
    """Select formats for at most ``fp8_slots`` FP8 slots (:func:`select_formats`); measure them
    and the naive rule with as many FP8 slots (unless ``measure=False``); write
    ``selection-<fp8_slots>.json`` into ``report_dir``.

    Measurement uses the analysis' held-out windows, or the first ``measure_windows`` windows from
    the same starting point (more than the analysis used = partly fresh text; all-FP8 and
    all-NVFP4 are then re-measured on exactly those windows). ``sink_key`` (``tune`` where the
    user did not choose): where the report's scales store some sink key uncentered, the selected
    policy is also measured without the flags, even with ``measure=False``, and the better by
    ``metric`` is kept (:mod:`~vllm_nvfp4.calibration.sink_choice`; ``"sink_key"`` in the
    summary); it adds one forward per window to the measurement (with ``measure=False``: a
    reference and two). Returns ``(policy with scales and provenance, selection summary)``.
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
    sink_key = sink_key and sink_choice.has_sink_key(scales)
    if measure or sink_key:
        todo = {"selected": chosen, "naive": naive} if measure else {"selected": chosen}
        measured = _measure(report, scales, todo, measure_windows, device,
                            metric if sink_key else None)
        if sink_key:
            summary["sink_key"] = measured.pop("sink_key")
            scales = sink_choice.chosen_policy(scales, summary["sink_key"])
    if measure:
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
             windows: Optional[int], device: str = "cpu",
             sink_metric: Optional[str] = None) -> dict[str, Any]:
    """Metrics of ``policies`` (formats; the report's scales) by name, plus ``measured_on``; also
    ``all_fp8`` / ``all_nvfp4`` when the windows differ from the analysis'. ``sink_metric``:
    also ``policies["selected"]`` with its sink key centered, and ``sink_key``, the choice
    between the two by that metric (:func:`~vllm_nvfp4.calibration.sink_choice.choose`);
    ``selected`` is then the chosen variant's metrics."""
    _check_same_inputs(report)
    s = report["settings"]
    n = windows or s["windows"]
    model, tokenizer, info = load_model(report["model"]["path"], report["model"]["dtype"], device,
                                        s["window"], n)
    toks = load_windows([Path(f["path"]) for f in report["data"]["files"]], tokenizer,
                        s["window"], n, s["calib_windows"], info.max_positions)
    todo = {name: with_formats(scales, f) for name, f in policies.items()}
    if sink_metric is not None:
        todo[sink_choice.CENTERED] = sink_choice.without_sink_key(todo["selected"])
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
    if sink_metric is not None:
        centered = out.pop(sink_choice.CENTERED)
        out["sink_key"] = sink_choice.choose(
            {sink_choice.UNCENTERED: out["selected"][sink_metric],
             sink_choice.CENTERED: centered[sink_metric]}, sink_metric, windows=n)
        if out["sink_key"]["chosen"] == sink_choice.CENTERED:
            out["selected"] = centered
    return out


@dataclass
class TuneResult:
    """What ``tune`` produced: the policy (scales + selected formats) and the numbers behind it."""

    policy: KVPolicy
    report: dict[str, Any]
    selection: dict[str, Any]
    seconds: float
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The human-readable report printed at the end of ``tune``."""
        c, s = self.report["configs"], self.selection
        out = [*self.notes,
               f"analyzed {len(self.report['layers'])} layers on {self.report['data']['eval_windows']} x "
               f"{self.report['data']['window_tokens']} tokens; delta NLL (nats/token): all-FP8 "
               f"{c['all_fp8']['dnll']:.5f}, all-NVFP4 {c['all_nvfp4']['dnll']:.5f}",
               f"selected {self.policy.to_compact()} ({self.policy.fraction_of_fp8():.4f}x FP8 bytes, "
               f"{s['fp8_slots']} FP8 slots)"]
        if "measured" in s["selected"]:
            sel, naive, nv = s["selected"]["measured"], s["naive"]["measured"], s["all_nvfp4"]
            out.append(f"measured delta NLL: selected {sel['dnll']:.5f}, naive first/last {naive['dnll']:.5f}, "
                       f"all-NVFP4 {nv['dnll']:.5f}; KL {sel['kl']:.5f}, {naive['kl']:.5f}, {nv['kl']:.5f}")
        if "sink_key" in s:
            out.append(f"{sink_choice.sink_line(s['sink_key'])} on the selected policy, "
                       f"{s['sink_key']['windows']} held-out window(s)")
        out.append(f"tune took {self.seconds:.0f} s")
        return out


def soft_capped(model_dir: Path) -> bool:
    """Whether the model's attention logits are soft-capped (K centering is then not exact)."""
    return bool(read_text_config(model_dir).get("attn_logit_softcapping"))


def run_tune(model_dir: Path, data: Sequence[Path], report_dir: Path, fp8_slots: int,
             budget: Optional[float] = None, window: int = 2048, windows: int = 2,
             calib_windows: int = 1, per_head: bool = False, dtype: str = "bfloat16",
             k_smooth: Optional[float] = None, k_center: bool = True, k_permute: bool = False,
             k_sink_uncentered: Optional[bool] = None,
             metric: str = "kl",
             measure: bool = True, measure_windows: Optional[int] = None,
             device: str = "cpu", base: str = DEFAULT_BASE,
             max_model_len: Optional[int] = None, k_rot_pairs: int = 0) -> TuneResult:
    """``analyze`` (calibrating on the first ``calib_windows`` windows, scoring the next
    ``windows``, the range also at the positions up to ``max_model_len``: :func:`run_calibrate`)
    then ``select`` for ``fp8_slots`` FP8 slots, under one progress bar; the
    report (plots, REPORT.md) is rendered into ``report_dir``. The policy is not saved.
    ``k_sink_uncentered`` None (with ``k_center``): the analysis flags the sink key where it
    fits and ``select`` keeps the flags only if the selected policy measures better with them
    (``run_select``'s ``sink_key``); True / False: as given, nothing measured for it.
    ``k_rot_pairs`` > 0: the rotating K center (:func:`run_calibrate`; dropped with the
    centering under a soft-cap); every measured forward stores the keys as served with it."""
    from vllm_nvfp4.calibration.report import render

    start = time.time()
    notes = []
    if k_center and soft_capped(Path(model_dir)):
        k_center = k_sink_uncentered = False
        k_rot_pairs = 0
        notes.append("note: the model soft-caps its attention logits; K centering is off")
    check_k_rot_args(k_rot_pairs, k_center, k_smooth, k_permute)
    measure_sink = k_center and k_sink_uncentered is None
    with single_bar("tune", unit="step"):
        report = analyze(model_dir, data, report_dir, window, windows, calib_windows,
                         per_head=per_head, dtype=dtype, k_smooth=k_smooth, k_center=k_center,
                         k_sink_uncentered=k_center and k_sink_uncentered is not False,
                         k_permute=k_permute, device=device, base=base,
                         max_model_len=max_model_len, k_rot_pairs=k_rot_pairs)
        for stale in Path(report_dir).glob("selection-*.json"):  # of an earlier analysis
            stale.unlink()
        policy, summary = run_select(report_dir, fp8_slots, metric, measure=measure, budget=budget,
                                     measure_windows=measure_windows, device=device,
                                     sink_key=measure_sink)
    render(report_dir)
    policy = KVPolicy(policy.layers, {**policy.provenance, "tool": _tool("tune")}, policy.source)
    return TuneResult(policy, report, summary, time.time() - start, notes)
