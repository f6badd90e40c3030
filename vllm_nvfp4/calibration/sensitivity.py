"""Layer-wise KV sensitivity (``vllm-nvfp4 analyze``).

From a base policy with calibrated scales - all-FP8 (``base="fp8"``) or all-NVFP4
(``base="nvfp4"``) - each layer's K (then V) alone is switched to the other format and the damage
against the unquantized reference is measured on held-out windows (mean next-token KL, delta NLL
and top-1 agreement). Also measured: all-FP8, all-NVFP4 and a repeat of the reference (noise
floor). A slot's *marginal* (``kl_marginal``, ``dnll_marginal``, ``top1_marginal``) is what that
slot in NVFP4 costs against that slot in FP8, the rest at the base: damage with the slot in NVFP4
minus damage with it in FP8 (top-1: agreement in FP8 minus agreement in NVFP4). The all-NVFP4 base
measures each slot among NVFP4 neighbours, as a tight budget leaves it; docs/CALIBRATION.md says
which base ranked better where it was measured.

Writes to the report directory: ``sensitivity.json`` (everything, see :func:`analyze`),
``scales.json`` (the calibrated all-FP8 policy) and, via :mod:`report`, plots and ``REPORT.md``.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

import vllm_nvfp4
from vllm_nvfp4.calibration.data import load_windows
from vllm_nvfp4.calibration.evaluator import Evaluator
from vllm_nvfp4.calibration.metrics import Metrics
from vllm_nvfp4.calibration.modeling import config_shape, load_model
from vllm_nvfp4.calibration.position_range import describe as describe_range
from vllm_nvfp4.calibration.position_range import range_offsets, served_length
from vllm_nvfp4.calibration.progress import progress
from vllm_nvfp4.calibration.report_files import ReportError, check_schema, read_json
from vllm_nvfp4.calibration.scales import amax_table, observe_calibration, scaled_policy, with_formats
from vllm_nvfp4.calibration.selection import BASES, DEFAULT_BASE
from vllm_nvfp4.policy import KVPolicy

REPORT_FILE = "sensitivity.json"
SCALES_FILE = "scales.json"
REPORT_KIND = "vllm-nvfp4-sensitivity"


def utc_now() -> str:
    """ISO-8601 UTC timestamp (seconds)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def downgrade(policy: KVPolicy, layer: int, kv: str) -> KVPolicy:
    """``policy`` with ``kv`` ("k" or "v") of ``layer`` in NVFP4 (scales kept)."""
    return policy.with_layer(layer, **{kv: "nvfp4"})


def upgrade(policy: KVPolicy, layer: int, kv: str) -> KVPolicy:
    """``policy`` with ``kv`` ("k" or "v") of ``layer`` in FP8 (scales kept)."""
    return policy.with_layer(layer, **{kv: "fp8"})


def all_format(scaled: KVPolicy, fmt: str) -> KVPolicy:
    """Every K and V in ``fmt``, with ``scaled``'s scales."""
    return with_formats(scaled, KVPolicy.from_compact(f"*:{fmt}", scaled.num_layers,
                                                      layer_types=scaled.layer_types))


def analyze(
    model_dir: str | Path,
    data: Sequence[Path],
    out_dir: Path,
    window: int = 2048,
    windows: int = 2,
    calib_windows: int = 1,
    scales: Optional[KVPolicy] = None,
    per_head: bool = False,
    dtype: str = "bfloat16",
    reuse_prefix: bool = True,
    k_smooth: Optional[float] = None,
    k_center: bool = False,
    device: str = "cpu",
    base: str = DEFAULT_BASE,
    k_permute: bool = False,
    k_sink_uncentered: bool = False,
    max_model_len: Optional[int] = None,
    k_rot_pairs: int = 0,
) -> dict[str, Any]:
    """Run the sensitivity analysis and write ``out_dir/sensitivity.json`` (+ ``scales.json``).

    Args:
        model_dir: local HF model directory.
        data: text / JSONL files; the first ``calib_windows`` windows calibrate the scales (skipped
            when ``scales`` is given), the next ``windows`` windows of ``window`` tokens are scored.
        scales: a calibrated policy (``vllm-nvfp4 calibrate``) whose scales to use.
        per_head: calibrate one scale per KV head instead of one per layer.
        k_smooth: with calibration, the K smoothing exponent (None: no smoothing).
        k_center: with calibration, K centering (store K minus its channel means).
        k_permute: with calibration, the K channel permutation (channels by falling RMS).
        k_sink_uncentered: with calibration and ``k_center``, the sink key stored uncentered
            where it fits (:func:`~vllm_nvfp4.calibration.scales.scaled_policy`).
        device: ``cpu``, ``cuda`` (every visible GPU), ``cuda:N`` or ``auto``
            (:func:`~vllm_nvfp4.calibration.modeling.load_model`).
        base: ``"fp8"`` (every slot moved to NVFP4 alone from all-FP8) or ``"nvfp4"`` (every
            slot moved to FP8 alone from all-NVFP4).
        max_model_len: with calibration, the served length the K/V range covers
            (:func:`~vllm_nvfp4.calibration.position_range.served_length`: None = the model's
            positions, 0 = only the calibration windows' own).
        k_rot_pairs: with calibration and ``k_center``, the rotating K center on that many RoPE
            pairs per KV head (0: off; :mod:`~vllm_nvfp4.calibration.rot_center`); the
            measured forwards store the keys as served with it.
    Returns:
        The report dictionary (also written as JSON).
    """
    if base not in BASES:
        raise ValueError(f"base must be one of {', '.join(BASES)}, got {base!r}")
    t_start = time.time()
    served = served_length(max_model_len, config_shape(Path(model_dir))[1]) if scales is None else 0
    model, tokenizer, info = load_model(model_dir, dtype, device, window, windows)
    n_calib = 0 if scales is not None else calib_windows
    toks = load_windows(data, tokenizer, window, windows, n_calib, info.max_positions)
    position_range = None
    if scales is None:
        offsets = range_offsets(served, window)
        position_range = describe_range(served, offsets)
        observer, rot = observe_calibration(model, toks.calib, info, offsets, k_rot_pairs)
        k_rot_pairs = k_rot_pairs if rot else 0
        formats = KVPolicy.from_compact("*:fp8", info.num_layers, layer_types=info.layer_types)
        scaled = scaled_policy(formats, observer, per_head,
                               {"calibrated_on": toks.describe(), "position_range": position_range,
                                "k_rot_pairs": k_rot_pairs},
                               k_smooth, k_center, k_permute, k_sink_uncentered, rot)
        amax = amax_table(observer)
    else:
        scales.check_model(info.num_layers, info.num_kv_heads, layer_types=info.layer_types)
        scaled = all_format(scales, "fp8")
        amax = None

    ev = Evaluator(model, toks.eval, reuse_prefix=reuse_prefix)
    n_win = len(toks.eval)
    total = n_win * (4 + 2 * len(info.kv_layers))
    results: dict[str, Metrics] = {}
    layers: list[dict[str, Any]] = []
    with progress(total=total, desc="analyze", unit="fwd") as bar:
        bar.set_postfix_str("reference")
        results["reference"] = ev.reference(bar)
        bar.set_postfix_str("reference repeat")
        results["reference_repeat"] = ev.measure(None, bar)
        other = "nvfp4" if base == "fp8" else "fp8"
        name = {"fp8": "all_fp8", "nvfp4": "all_nvfp4"}
        bar.set_postfix_str(f"all-{base.upper()}")
        baseline = all_format(scaled, base)
        results[name[base]] = ev.set_baseline(baseline, bar)
        bar.set_postfix_str(f"all-{other.upper()}")
        results[name[other]] = ev.measure(all_format(scaled, other), bar)
        switch = downgrade if base == "fp8" else upgrade
        for i in info.kv_layers:
            entry: dict[str, Any] = {"index": i, **info.layer_types[i].to_json()}
            for kv in ("k", "v"):
                bar.set_postfix_str(f"layer {i} {kv.upper()}->{other.upper()}")
                entry[kv] = ev.measure(switch(baseline, i, kv), bar).to_dict()
            layers.append(entry)

    at_base = results[name[base]].to_dict()
    for entry in layers:
        for kv in ("k", "v"):
            nv, f8 = (entry[kv], at_base) if base == "fp8" else (at_base, entry[kv])
            entry[kv]["kl_marginal"] = round(nv["kl"] - f8["kl"], 8)
            entry[kv]["dnll_marginal"] = round(nv["dnll"] - f8["dnll"], 8)
            entry[kv]["top1_marginal"] = round(f8["top1"] - nv["top1"], 8)

    report = {
        "kind": REPORT_KIND,
        "tool": {"name": "vllm-nvfp4", "version": vllm_nvfp4.__version__, "command": "analyze"},
        "date": utc_now(),
        "model": info.to_dict(),
        "data": toks.describe(),
        "settings": {"window": window, "windows": windows, "calib_windows": n_calib,
                     "per_head": per_head, "k_smooth": k_smooth, "k_center": k_center,
                     "k_sink_uncentered": k_sink_uncentered,
                     "k_permute": k_permute, "k_rot_pairs": k_rot_pairs, "base": base, "position_range": position_range,
                     "scales_from": "calibration" if scales is None else scales.source,
                     "prefix_reuse": ev.layers is not None, "forwards": ev.forwards,
                     "torch_threads": torch.get_num_threads()},
        "configs": {k: v.to_dict() for k, v in results.items()},
        "layers": layers,
        "amax": amax,
        "seconds": round(time.time() - t_start, 1),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    scaled.save(out_dir / SCALES_FILE, overwrite=True)
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


#: what ``select`` and the report renderer read from ``sensitivity.json`` (key -> type or nested)
_REPORT_SCHEMA: dict[str, Any] = {
    "model": {"path": str, "config_sha256": str, "num_layers": int, "num_kv_heads": int,
              "head_dim": int, "dtype": str},
    "data": {"files": list, "window_tokens": int, "eval_windows": int},
    "settings": {"window": int, "windows": int, "calib_windows": int},
    "configs": {"all_fp8": {"kl": float, "dnll": float}, "all_nvfp4": {"kl": float, "dnll": float}},
    "layers": list,
}
_SLOT_SCHEMA: dict[str, Any] = {"index": int, "k": {"kl": float, "dnll": float},
                                "v": {"kl": float, "dnll": float}}


def load_report(report_dir: Path) -> tuple[dict[str, Any], KVPolicy]:
    """Read and check ``sensitivity.json`` and ``scales.json`` of a report directory.

    Raises :class:`ReportError` (file missing, malformed, a key absent or of the wrong type, layer
    counts that disagree) or :class:`~vllm_nvfp4.policy.PolicyError` (``scales.json``).
    """
    path = Path(report_dir) / REPORT_FILE
    if not path.is_file():
        raise ReportError(f"{path} not found; run `vllm-nvfp4 analyze MODEL --out {report_dir}` first")
    report = read_json(path)
    if not isinstance(report, dict) or report.get("kind") != REPORT_KIND:
        raise ReportError(f"{path} is not a vllm-nvfp4 sensitivity report (no \"kind\": {REPORT_KIND!r})")
    check_schema(report, _REPORT_SCHEMA, path)
    for i, entry in enumerate(report["data"]["files"]):
        check_schema(entry, {"path": str, "sha256": str}, path, f"data.files[{i}].")
    for i, entry in enumerate(report["layers"]):
        check_schema(entry, _SLOT_SCHEMA, path, f"layers[{i}].")
        if entry["index"] != i:
            raise ReportError(f"{path}: layers[{i}].index is {entry['index']}, expected {i}")
    n = report["model"]["num_layers"]
    if len(report["layers"]) != n:
        raise ReportError(f"{path}: model.num_layers is {n} but {len(report['layers'])} layers are "
                          "listed (truncated? re-run analyze)")
    scales = KVPolicy.load(Path(report_dir) / SCALES_FILE)
    if scales.num_layers != n:
        raise ReportError(f"{Path(report_dir) / SCALES_FILE} has {scales.num_layers} layers, "
                          f"{path} {n}: the files are of different analyses; re-run analyze")
    return report, scales
