#!/usr/bin/env python
"""Does centering V help NVFP4 as centering K does (CPU)?

    python -m studies.value_center_study MODEL TEXT --out DIR [--window 1024] [--heldout-windows 4]
        [--dtype float32] [--fp8-slots 14k 15k ...]

V stored as ``V - nu`` (``nu``: per KV head and channel, the mean value of the calibration
window) with ``nu`` added back after decoding: the attention output gains ``sum_i p_i nu = nu``
(softmax weights sum to 1 without sinks), so serving would add ``nu`` to each layer's output and
store no extra bytes. On held-out windows, against the unquantized cache: calibrated all-FP8 and
all-NVFP4 (K centering on), then all-NVFP4 and the ``--fp8-slots`` mix, each plain, with V
centered (:class:`~studies.kv_options.ValueCenter`; also with the first value left as it is),
with the served sink key (NVFP4 before K centering in the layers where the calibration window's
first key fits) and with both; and the sink key with the first value stored FP8 or exact
(:class:`~studies.kv_options.ValueSink`: what a sink slot holding the value would add). Each row
gets its top-1 and delta-NLL gap recovery; writes ``DIR/value_center.json`` with, per layer,
the median over heads of ``|nu| / rms(V - nu)`` (how much of V is constant).

Windows and model as ``studies/sink_token_study.py``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, Sequence

from studies.common import load_slot_study, recovery, row, study_parser, with_fp8_slots


def value_means(model: Any, window: Any, num_layers: int) -> dict[int, Any]:
    """Per decoder layer, the mean value over ``window``'s positions: float32 ``[kv_heads, D]``."""
    import torch

    from vllm_nvfp4.calibration.kv_hooks import KVObserver, kv_cache_quantization

    means: dict[int, torch.Tensor] = {}

    class Means(KVObserver):
        def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
            means[layer] = value.detach().float()[0].mean(dim=1)

    with torch.no_grad(), kv_cache_quantization(model, observer=Means(num_layers)):
        model(window, use_cache=False)
    return means


def constant_share(model: Any, windows: Any, means: dict[int, Any], num_layers: int) -> dict[str, float]:
    """Per layer, over ``windows``: the median over KV heads of ``|nu| / rms(V - nu)``."""
    import torch

    from vllm_nvfp4.calibration.kv_hooks import KVObserver, kv_cache_quantization

    ratios: dict[int, list[float]] = {}

    class Share(KVObserver):
        def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
            v = value.detach().float()[0]  # [kv_heads, T, D]
            nu = means[layer]
            spread = (v - nu[:, None, :]).pow(2).mean(dim=(1, 2)).sqrt()
            ratios.setdefault(layer, []).extend((nu.norm(dim=-1) / nu.shape[-1] ** 0.5 / spread).tolist())

    with torch.no_grad(), kv_cache_quantization(model, observer=Share(num_layers)):
        for w in windows:
            model(w.view(1, -1), use_cache=False)
    return {str(k): round(float(torch.tensor(v).median()), 4) for k, v in sorted(ratios.items())}


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from studies.kv_options import KeySink, ValueCenter, ValueSink
    from studies.sink_token_study import centered_scales
    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.sensitivity import all_format

    ap = study_parser(__doc__, ())
    ap.set_defaults(window=1024)
    ap.add_argument("--fp8-slots", nargs="*", default=[], help="slots like 14k 3v kept in FP8 in the mix")
    a = ap.parse_args(argv)
    w = a.window
    model, info, head, tail = load_slot_study(a)
    layers = info.num_layers
    calib = torch.tensor(head[:w]).view(1, w)
    scaled, fitting = centered_scales(model, info, calib)
    means = value_means(model, calib, layers)
    heldout = torch.tensor(tail[-w * a.heldout_windows:]).view(a.heldout_windows, w)
    share = constant_share(model, heldout, means, layers)
    print("per layer, |mean value| / rms(value - mean), median over KV heads:", flush=True)
    print("  " + ", ".join(f"{k}: {v:.2f}" for k, v in share.items()), flush=True)
    sink = KeySink(1, "uncentered", fitting)
    options = {"": (), " + V centered": (ValueCenter(means),),
               " + V centered but the first": (ValueCenter(means, first_uncentered=True),),
               " + sink key": (sink,),
               " + sink key + V centered": (sink, ValueCenter(means)),
               " + sink key + V centered but the first": (sink, ValueCenter(means, first_uncentered=True)),
               " + sink key + first value fp8": (sink, ValueSink(1, "fp8")),
               " + sink key + first value exact": (sink, ValueSink(1, "exact"))}
    nv = all_format(scaled, "nvfp4")
    bases = {"all_nvfp4": nv}
    if a.fp8_slots:
        bases["mix"] = with_fp8_slots(nv, a.fp8_slots)
    ev = Evaluator(model, heldout, reuse_prefix=False)
    ev.reference()
    out: dict[str, Any] = {"all_fp8": ev.measure(all_format(scaled, "fp8")).to_dict()}
    print(row("all_fp8", out["all_fp8"]), flush=True)
    for base_name, policy in bases.items():
        for suffix, opts in options.items():
            ev.options = opts
            m = ev.measure(policy).to_dict()
            m.update(fraction_of_fp8=round(policy.fraction_of_fp8(), 6))
            if "all_nvfp4" in out:
                m.update(recovery(m, out["all_fp8"], out["all_nvfp4"]))
            out[base_name + suffix] = m
            gap = f"  gap recovery {m['top1_gap_recovery']:.0%}" if "top1_gap_recovery" in m else ""
            print(row(base_name + suffix, m) + gap, flush=True)
    summary = {"model": str(a.model), "text": str(a.text), "window": w, "dtype": a.dtype,
               "heldout_windows": a.heldout_windows, "k_center": True, "fp8_slots": a.fp8_slots,
               "uncentered_fit_layers": sorted(fitting), "value_constant_share": share,
               "configs": out}
    (a.out / "value_center.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
