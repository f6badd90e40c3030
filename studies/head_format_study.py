#!/usr/bin/env python
"""Would choosing FP8 per KV head instead of per layer recover more top-1 agreement (CPU)?

    python -m studies.head_format_study STEP MODEL TEXT --out DIR [--window 512]
        [--analysis-windows 2] [--heldout-windows 4] [--budget 0.62] [--dtype float32]

STEP ``sweep``: from calibrated all-FP8 (K centering, as ``analyze --k-center``), every K/V
slot of a layer moved alone to NVFP4 (what ``analyze`` measures), and every single KV head of
every slot moved alone (:class:`~studies.kv_options.HeadFormats`), KL / delta NLL /
top-1 on the analysis windows, written to ``DIR/sweep.json``. STEP ``heldout`` (after it): at
``--budget``, the layer slots and, separately, the head slots of largest KL increase kept in
FP8 (a head slot costs a ``1/kv_heads`` share of a layer slot's bytes, so the budget holds
``kv_heads`` times as many), measured with all-FP8 and all-NVFP4 on held-out windows; writes
``DIR/heldout.json`` with each row's top-1 and delta-NLL gap recovery ``(x - all-NVFP4) /
(all-FP8 - all-NVFP4)``. The paged cache holds one format per layer's K and V, so per-head
formats are a measurement here, not a served option.

Windows as ``studies/sweep_base_study.py``: calibration = the first window of TEXT, analysis =
the next ``--analysis-windows``, held-out = the last ``--heldout-windows`` windows of TEXT's
final 50,000 characters. Transformers with the cache fake-quantized, one CPU thread.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, Sequence

from studies.common import Progress, load_study, recovery, row, study_parser, with_fp8_slots


def _largest(sweep: dict[str, Any], n: int) -> list[str]:
    """The at most ``n`` slots of ``sweep`` whose move to NVFP4 raised KL the most (and at all)."""
    base = sweep["base"]["kl"]
    rise = {s: m["kl"] - base for s, m in sweep["slots"].items()}
    return [s for s in sorted(rise, key=lambda s: -rise[s])[:n] if rise[s] > 0]


def _head_formats(slots: Sequence[str], fmt: str) -> Any:
    """:class:`HeadFormats` with head slots ``"<layer><k|v><head>"`` (e.g. ``14k2``) in ``fmt``."""
    from studies.kv_options import HeadFormats

    heads: dict[tuple[int, str], dict[int, str]] = {}
    for s in slots:
        kv = "k" if "k" in s else "v"
        layer, head = s.split(kv)
        heads.setdefault((int(layer), kv), {})[int(head)] = fmt
    return HeadFormats(heads)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy
    from vllm_nvfp4.calibration.selection import fp8_slots_for_budget, fraction_for_slots
    from vllm_nvfp4.calibration.sensitivity import all_format, downgrade
    from vllm_nvfp4.policy import KVPolicy

    a = study_parser(__doc__, ("sweep", "heldout")).parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    w = a.window
    model, info, head, tail = load_study(a.model, a.text, a.dtype)
    kv_heads = model.config.get_text_config().num_key_value_heads
    observer = observe_amax(model, torch.tensor(head[:w]).view(1, w), info.num_layers,
                            kv_layers=info.kv_layers)
    scaled = scaled_policy(KVPolicy.from_compact("*:fp8", info.num_layers, layer_types=info.layer_types),
                           observer, k_center=True)
    fp8, nv = all_format(scaled, "fp8"), all_format(scaled, "nvfp4")

    if a.step == "sweep":
        ev = Evaluator(model, torch.tensor(head[w:w * (1 + a.analysis_windows)]).view(a.analysis_windows, w))
        ev.reference()
        base = ev.set_baseline(fp8).to_dict()
        bar = Progress()
        layer_slots, head_slots = {}, {}
        for i in info.kv_layers:
            for kv in ("k", "v"):
                layer_slots[f"{i}{kv}"] = ev.measure(downgrade(fp8, i, kv), bar).to_dict()
                for h in range(kv_heads):
                    ev.options = (_head_formats([f"{i}{kv}{h}"], "nvfp4"),)
                    head_slots[f"{i}{kv}{h}"] = ev.measure(fp8, bar).to_dict()
                    ev.options = ()
        result = {"kv_heads": kv_heads, "layers": {"base": base, "slots": layer_slots},
                  "heads": {"base": base, "slots": head_slots}}
        (a.out / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0

    sweep = json.loads((a.out / "sweep.json").read_text())
    n_layer = fp8_slots_for_budget(info.num_layers, a.budget)
    n_head = fp8_slots_for_budget(info.num_layers * kv_heads, a.budget)
    layer_pick, head_pick = _largest(sweep["layers"], n_layer), _largest(sweep["heads"], n_head)
    layer_mix = with_fp8_slots(nv, layer_pick)

    ev = Evaluator(model, torch.tensor(tail[-w * a.heldout_windows:]).view(a.heldout_windows, w),
                   reuse_prefix=False)
    ev.reference()
    out: dict[str, Any] = {"all_fp8": ev.measure(fp8).to_dict(), "all_nvfp4": ev.measure(nv).to_dict()}
    for name in out:
        print(row(name, out[name]), flush=True)
    rows = {"layer_mix": (layer_mix, None, layer_pick),
            "head_mix": (nv, _head_formats(head_pick, "fp8"), head_pick)}
    for name, (policy, heads, picked) in rows.items():
        ev.options = () if heads is None else (heads,)
        m = ev.measure(policy).to_dict()
        m.update(recovery(m, out["all_fp8"], out["all_nvfp4"]), fp8_slots=picked)
        out[name] = m
        print(row(name, m) + f"  gap recovery top-1 {m['top1_gap_recovery']:.0%}, "
              f"dNLL {m['dnll_gap_recovery']:.0%}  ({len(picked)} slots)", flush=True)
    fraction = {"layer_mix": layer_mix.fraction_of_fp8(),
                "head_mix": fraction_for_slots(info.num_layers * kv_heads, len(head_pick))}
    summary = {"model": str(a.model), "text": str(a.text), "window": w, "dtype": a.dtype,
               "analysis_windows": a.analysis_windows, "heldout_windows": a.heldout_windows,
               "budget": a.budget, "kv_heads": kv_heads,
               "fraction_of_fp8": {k: round(v, 6) for k, v in fraction.items()}, "configs": out}
    (a.out / "heldout.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
