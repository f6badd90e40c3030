#!/usr/bin/env python
"""Does ordering each KV head's K channels by RMS (``k_perm``) make NVFP4 keys more accurate (CPU)?

    python -m studies.k_permutation_study MODEL TEXT --out DIR [--window 512] [--heldout-windows 4]
        [--dtype float32] [--fp8-slots 1k 8k 0v ...]

On held-out windows, against the unquantized cache: calibrated all-FP8 and all-NVFP4 with K
centering (``calibrate --k-center``), all-NVFP4 with the K channel permutation as well
(``--k-center --k-permute``: :func:`~vllm_nvfp4.calibration.scales.channel_permutation`), and with
``--fp8-slots`` (the slots a ``tune`` policy keeps in FP8) the same mix without and with the
permutation. Each row gets its top-1 and delta-NLL gap recovery ``(x - all-NVFP4) / (all-FP8 -
all-NVFP4)``; writes ``DIR/k_permutation.json``. A permutation does not change an FP8 cache
(one scale per layer), so all-FP8 is measured once.

Windows as ``studies/sweep_base_study.py``: calibration = the first window of TEXT, held-out =
the last ``--heldout-windows`` windows of TEXT's final 50,000 characters. Transformers with the
cache fake-quantized (:mod:`vllm_nvfp4.calibration.kv_hooks`), one CPU thread.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, Sequence

from studies.common import load_slot_study, recovery, row, study_parser, with_fp8_slots


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy
    from vllm_nvfp4.calibration.sensitivity import all_format
    from vllm_nvfp4.policy import KVPolicy

    ap = study_parser(__doc__, ())
    ap.add_argument("--fp8-slots", nargs="*", default=[], help="slots like 14k 3v kept in FP8 in the mix")
    a = ap.parse_args(argv)
    w = a.window
    model, info, head, tail = load_slot_study(a)
    observer = observe_amax(model, torch.tensor(head[:w]).view(1, w), info.num_layers,
                            kv_layers=info.kv_layers)
    formats = KVPolicy.from_compact("*:fp8", info.num_layers, layer_types=info.layer_types)
    plain = scaled_policy(formats, observer, k_center=True)
    permuted = scaled_policy(formats, observer, k_center=True, k_permute=True)
    configs = {"all_nvfp4": all_format(plain, "nvfp4"),
               "all_nvfp4_k_permuted": all_format(permuted, "nvfp4")}
    if a.fp8_slots:
        configs["mix"] = with_fp8_slots(configs["all_nvfp4"], a.fp8_slots)
        configs["mix_k_permuted"] = with_fp8_slots(configs["all_nvfp4_k_permuted"], a.fp8_slots)
    ev = Evaluator(model, torch.tensor(tail[-w * a.heldout_windows:]).view(a.heldout_windows, w),
                   reuse_prefix=False)
    ev.reference()
    out: dict[str, Any] = {"all_fp8": ev.measure(all_format(plain, "fp8")).to_dict()}
    print(row("all_fp8", out["all_fp8"]), flush=True)
    for name, policy in configs.items():
        m = ev.measure(policy).to_dict()
        m["fraction_of_fp8"] = round(policy.fraction_of_fp8(), 6)
        if "all_nvfp4" in out:
            m.update(recovery(m, out["all_fp8"], out["all_nvfp4"]))
        out[name] = m
        gap = (f"  gap recovery top-1 {m['top1_gap_recovery']:.0%}, dNLL {m['dnll_gap_recovery']:.0%}"
               if "top1_gap_recovery" in m else "")
        print(row(name, m) + gap, flush=True)
    summary = {"model": str(a.model), "text": str(a.text), "window": w, "dtype": a.dtype,
               "heldout_windows": a.heldout_windows, "k_center": True, "fp8_slots": a.fp8_slots,
               "configs": out}
    (a.out / "k_permutation.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
