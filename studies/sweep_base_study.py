#!/usr/bin/env python
"""Which sensitivity sweep picks the FP8 slots that recover the most top-1 agreement (CPU).

    python -m studies.sweep_base_study STEP MODEL TEXT --out DIR [--window 512]
        [--analysis-windows 2] [--heldout-windows 4] [--budget 0.62] [--dtype float32]

STEP ``fp8`` / ``nvfp4``: the sweep of ``vllm-nvfp4 analyze --base`` (every K/V slot moved alone
to the other format, KL / delta NLL / top-1 per slot) on the analysis windows, written to
``DIR/sweep_<step>.json``; the two can run at once. STEP ``heldout`` (after both): for each
ranking - sweep from all-FP8 or all-NVFP4, by KL or by top-1 - the slots ``select`` would keep in
FP8 at ``--budget`` (:func:`~vllm_nvfp4.calibration.selection.fp8_slots_for_budget`), measured
with all-FP8 and all-NVFP4 on held-out windows from the end of TEXT; writes ``DIR/heldout.json``
with each policy's top-1 and delta-NLL gap recovery ``(x - all-NVFP4) / (all-FP8 - all-NVFP4)``.

Windows: calibration = the first window of TEXT (scales and K centering as ``analyze
--k-center``), analysis = the next ``--analysis-windows``, held-out = the last
``--heldout-windows`` windows of TEXT's final 50,000 characters. Transformers with the cache
fake-quantized (:mod:`vllm_nvfp4.calibration.kv_hooks`), one CPU thread.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, Sequence

from studies.common import Progress, load_study, recovery, study_parser, with_fp8_slots


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy
    from vllm_nvfp4.calibration.selection import fp8_slots_for_budget
    from vllm_nvfp4.calibration.sensitivity import all_format, downgrade, upgrade
    from vllm_nvfp4.policy import KVPolicy

    a = study_parser(__doc__, ("fp8", "nvfp4", "heldout")).parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    w = a.window
    model, info, head, tail = load_study(a.model, a.text, a.dtype)
    calib = torch.tensor(head[:w]).view(1, w)
    layers = info.num_layers
    observer = observe_amax(model, calib, layers, kv_layers=info.kv_layers)
    scaled = scaled_policy(KVPolicy.from_compact("*:fp8", layers, layer_types=info.layer_types),
                           observer, False, {}, None, True)
    fp8, nv = all_format(scaled, "fp8"), all_format(scaled, "nvfp4")

    if a.step in ("fp8", "nvfp4"):
        windows = torch.tensor(head[w:w * (1 + a.analysis_windows)]).view(a.analysis_windows, w)
        ev = Evaluator(model, windows)
        ev.reference()
        base, switch = (fp8, downgrade) if a.step == "fp8" else (nv, upgrade)
        result: dict[str, Any] = {"base": ev.set_baseline(base).to_dict(), "slots": {}}
        bar = Progress()
        for i in info.kv_layers:
            for kv in ("k", "v"):
                result["slots"][f"{i}{kv}"] = ev.measure(switch(base, i, kv), bar).to_dict()
        (a.out / f"sweep_{a.step}.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0

    n = fp8_slots_for_budget(layers, a.budget)
    sweeps = {b: json.loads((a.out / f"sweep_{b}.json").read_text()) for b in ("fp8", "nvfp4")}

    def ranked(base: str, metric: str) -> list[str]:
        """The at most ``n`` slots of largest positive marginal (NVFP4 minus FP8 damage)."""
        sw = sweeps[base]
        b, sign = sw["base"], (1.0 if base == "fp8" else -1.0)  # slot moved to NVFP4 / to FP8
        if metric == "top1":
            score = {s: -sign * (m["top1"] - b["top1"]) for s, m in sw["slots"].items()}
        else:
            score = {s: sign * (m[metric] - b[metric]) for s, m in sw["slots"].items()}
        return [s for s in sorted(score, key=lambda s: -score[s])[:n] if score[s] > 0]

    windows = torch.tensor(tail[-w * a.heldout_windows:]).view(a.heldout_windows, w)
    ev = Evaluator(model, windows, reuse_prefix=False)
    ev.reference()
    out: dict[str, Any] = {"all_fp8": ev.measure(fp8).to_dict(), "all_nvfp4": ev.measure(nv).to_dict()}
    f8, n4 = out["all_fp8"], out["all_nvfp4"]
    for base in ("fp8", "nvfp4"):
        for metric in ("kl", "top1"):
            slots = ranked(base, metric)
            mix = with_fp8_slots(nv, slots)
            m = ev.measure(mix).to_dict()
            m.update(slots=slots, policy=mix.to_compact(), fraction_of_fp8=round(mix.fraction_of_fp8(), 6),
                     **recovery(m, f8, n4))
            out[f"base_{base}_by_{metric}"] = m
            print(f"base {base:5s} by {metric:4s}: {slots} top-1 {m['top1']:.4f} "
                  f"(gap recovery {m['top1_gap_recovery']:.0%}), delta NLL {m['dnll']:.4f} "
                  f"({m['dnll_gap_recovery']:.0%})", flush=True)
    summary = {"model": str(a.model), "text": str(a.text), "window": w,
               "analysis_windows": a.analysis_windows, "heldout_windows": a.heldout_windows,
               "budget": a.budget, "fp8_slots": n, "configs": out}
    (a.out / "heldout.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
