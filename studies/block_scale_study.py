#!/usr/bin/env python
"""How should the NVFP4 write choose each block's E4M3 scale? Three rules on held-out text (CPU).

    python -m studies.block_scale_study MODEL TEXT --policy POLICY.json --out DIR
        [--window 512] [--heldout-windows 8] [--heldout-skip 0] [--rules amax6,four_over_six,search]
        [--dtype float32]

Rules (the stored bytes and the decoding are the same for all three; only the scale differs):

* ``amax6``: ``s = e4m3(amax16 / (6 g))``, the largest element maps to 6 (the rule of
  :func:`vllm_nvfp4.formats.nvfp4_quantize` up to this study).
* ``four_over_six``: quantize the block with ``s6 = e4m3(amax16 / (6 g))`` and with
  ``s4 = e4m3(min(amax16 / (4 g), 448))`` (the largest element maps to 4), keep the one whose
  block squared error is lower (ties: ``s6``).
* ``search``: the lowest block squared error of five candidates: ``s6``, the E4M3 values one step
  below and above ``s6``, ``e4m3(amax16 / (5 g))`` and ``s4`` (ties: the first in that order).

A candidate's error is the block's squared error in units of ``g`` (:func:`block_sq_error`).
The rules are implemented here, independent of :mod:`vllm_nvfp4.formats`, and replace its
``nvfp4_quantize`` in the fake quantization for the measurement.

Configurations (every one with the scales and K centering of POLICY, e.g. the ``tune`` policy of
``results/2026-12-01-zeroconfig-tables-cpu``): all-FP8 (the reference of the gap), all-NVFP4 and
POLICY's own formats (the 0.62x mix), each NVFP4 configuration under each rule. Held-out text:
the last ``--heldout-windows`` windows of ``--window`` tokens of TEXT's final 50,000 characters
(``--heldout-skip`` windows before the end: another set). Writes ``DIR/heldout[_skipN].json``
with, per configuration, delta NLL vs the unquantized model with its 95% CI, top-1 agreement, KL,
the top-1 and KL gap recovered (``(x - all-NVFP4 amax6) / (all-FP8 - all-NVFP4 amax6)``), and
per rule the paired difference to ``amax6`` of the same configuration (delta NLL and top-1, 95% CI).
Transformers with the cache fake-quantized (:mod:`vllm_nvfp4.calibration.kv_hooks`), one thread.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from studies.common import load_study, study_parser
from vllm_nvfp4 import formats as F

Z95 = 1.96
RULES = ("amax6", "four_over_six", "search")


# ---------------------------------------------------------------------------- the rules
def _candidates(amax: torch.Tensor, g: torch.Tensor, rule: str) -> list[torch.Tensor]:
    """Candidate E4M3 block scales (FP32 values of E4M3 numbers) ``[..., D/16]`` for ``rule``."""
    s6 = F.e4m3_round(amax / (g * 6.0))
    if rule == "amax6":
        return [s6.float()]
    s4 = F.e4m3_round(torch.clamp(amax / (g * 4.0), max=F.E4M3_MAX))
    if rule == "four_over_six":
        return [s6.float(), s4.float()]
    if rule != "search":
        raise ValueError(f"unknown rule {rule!r}")
    b = s6.view(torch.uint8).to(torch.int16)  # positive E4M3: byte order = value order
    down = torch.clamp(b - 1, min=0).to(torch.uint8).view(torch.float8_e4m3fn)
    up = torch.clamp(b + 1, max=0x7E).to(torch.uint8).view(torch.float8_e4m3fn)
    s5 = F.e4m3_round(torch.clamp(amax / (g * 5.0), max=F.E4M3_MAX))
    return [s6.float(), down.float(), up.float(), s5.float(), s4.float()]


def block_sq_error(xg: torch.Tensor, codes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Squared error of NVFP4 blocks in units of ``g``: ``sum((e2m1 * s - x / g)^2)`` over the 16
    elements; ``e2m1 * s`` is exact in FP32, the difference rounds once, the squares are exact in
    FP64 and are summed as a pairwise tree of neighbours (an order a kernel can repeat)."""
    e = (F.e2m1_value(codes) * s.unsqueeze(-1) - xg).double() ** 2
    while e.shape[-1] > 1:
        e = e[..., 0::2] + e[..., 1::2]
    return e.squeeze(-1)


def quantize_rule(x: torch.Tensor, global_scale: F.ScaleLike, rule: str,
                  nonfinite: F.NonFinite = "raise") -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of ``x [..., D]`` (finite) with the block scale chosen by ``rule``: the arguments and
    outputs of :func:`vllm_nvfp4.formats.nvfp4_quantize`; ``amax6`` gives its pre-study bytes."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError("the study's rules take finite K/V only")
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    g = torch.broadcast_to(g, x.shape[:-1]).unsqueeze(-1)  # [..., 1]
    d = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], d // 16, 16)
    xg = xb / g.unsqueeze(-1)
    amax = xb.abs().amax(dim=-1)
    best_err: Optional[torch.Tensor] = None
    best_s = best_codes = None
    for s in _candidates(amax, g, rule):
        se = (s * g).unsqueeze(-1)
        zero = se == 0
        codes = torch.where(zero, 0, F.e2m1_code(xb / torch.where(zero, 1.0, se)).to(torch.int32)).to(torch.uint8)
        if best_err is None:
            best_s, best_codes = s, codes
            if rule != "amax6":
                best_err = block_sq_error(xg, codes, s)
            continue
        err = block_sq_error(xg, codes, s)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
    codes = best_codes.reshape(*x.shape[:-1], d // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), best_s.to(torch.float8_e4m3fn)


def use_rule(rule: str) -> None:
    """Make the calibration fake quantization write NVFP4 with ``rule``."""
    from vllm_nvfp4.calibration import kv_hooks

    kv_hooks.nvfp4_quantize = lambda x, g, nonfinite="raise": quantize_rule(x, g, rule, nonfinite)


# ---------------------------------------------------------------------------- measurement
def _ci(d: torch.Tensor) -> tuple[float, float]:
    """Mean and 95% half-width of ``d`` (per-token values)."""
    d = d.double()
    return float(d.mean()), Z95 * float(d.std(unbiased=True)) / math.sqrt(d.numel())


def _measure(model: Any, windows: torch.Tensor, refs: list, policy: Any) -> dict[str, torch.Tensor]:
    from vllm_nvfp4.calibration.kv_hooks import kv_cache_quantization
    from vllm_nvfp4.calibration.metrics import per_token_damage

    kls, nlls, agree = [], [], []
    with torch.no_grad(), kv_cache_quantization(model, policy):
        for w, ref in zip(windows, refs):
            kl, nll, top1 = per_token_damage(model(w.unsqueeze(0), use_cache=False).logits[0], ref)
            kls.append(kl)
            nlls.append(nll - ref.nll)
            agree.append(top1)
    return {"kl": torch.cat(kls), "dnll": torch.cat(nlls), "top1": torch.cat(agree).double()}


def _summary(t: dict[str, torch.Tensor]) -> dict[str, float]:
    dnll, hw = _ci(t["dnll"])
    return {"dnll": round(dnll, 6), "dnll_ci95": round(hw, 6), "top1": round(float(t["top1"].mean()), 6),
            "kl": round(float(t["kl"].double().mean()), 6), "tokens": int(t["dnll"].numel())}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from vllm_nvfp4.calibration.metrics import reference_from_logits
    from vllm_nvfp4.calibration.sensitivity import all_format
    from vllm_nvfp4.policy import KVPolicy

    ap = study_parser(__doc__, ("heldout",))
    ap.add_argument("--policy", type=Path, required=True)
    ap.add_argument("--heldout-skip", type=int, default=0)
    ap.add_argument("--rules", default=",".join(RULES))
    ap.set_defaults(heldout_windows=8)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rules = a.rules.split(",")
    t0 = time.time()
    model, info, _head, tail = load_study(a.model, a.text, a.dtype)
    w = a.window
    end = len(tail) - w * a.heldout_skip
    windows = torch.tensor(tail[end - w * a.heldout_windows:end]).view(a.heldout_windows, w)
    policy = KVPolicy.load(a.policy)
    print(f"model loaded, {a.heldout_windows} x {w} held-out tokens, {time.time() - t0:.0f} s", flush=True)

    refs = []
    with torch.no_grad():
        for row in windows:
            refs.append(reference_from_logits(model(row.unsqueeze(0), use_cache=False).logits[0], row))
    configs: dict[str, tuple[Any, Sequence[str]]] = {
        "all_fp8": (all_format(policy, "fp8"), ("amax6",)),
        "all_nvfp4": (all_format(policy, "nvfp4"), rules),
        "mix": (policy, rules),
    }
    raw: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, Any] = {}
    for cname, (p, crules) in configs.items():
        for rule in crules:
            use_rule(rule)
            name = f"{cname}/{rule}"
            raw[name] = _measure(model, windows, refs, p)
            out[name] = _summary(raw[name])
            m = out[name]
            print(f"{name:28s} dNLL {m['dnll']:+.4f} +- {m['dnll_ci95']:.4f}  top-1 {m['top1']:.4f}  "
                  f"KL {m['kl']:.4f}  ({time.time() - t0:.0f} s)", flush=True)
    use_rule("amax6")
    f8, n4 = out["all_fp8/amax6"], out["all_nvfp4/amax6"]
    for name, m in out.items():
        cname, rule = name.split("/")
        if cname == "all_fp8":
            continue
        m["top1_gap_recovery"] = round((m["top1"] - n4["top1"]) / (f8["top1"] - n4["top1"]), 4)
        m["kl_gap_recovery"] = round((n4["kl"] - m["kl"]) / (n4["kl"] - f8["kl"]), 4)
        if rule != "amax6":
            base = raw[f"{cname}/amax6"]
            d, hw = _ci(raw[name]["dnll"] - base["dnll"])
            t, thw = _ci(raw[name]["top1"] - base["top1"])
            k, khw = _ci(raw[name]["kl"] - base["kl"])
            m["vs_amax6"] = {"dnll": round(d, 6), "dnll_ci95": round(hw, 6), "top1": round(t, 6),
                             "top1_ci95": round(thw, 6), "kl": round(k, 6), "kl_ci95": round(khw, 6)}
            print(f"{name:28s} vs amax6: dNLL {d:+.4f} +- {hw:.4f}  top-1 {t:+.4f} +- {thw:.4f}  "
                  f"KL {k:+.4f} +- {khw:.4f}", flush=True)
    skip = f"_skip{a.heldout_skip}" if a.heldout_skip else ""
    summary = {"model": str(a.model), "text": str(a.text), "policy": str(a.policy), "window": w,
               "heldout_windows": a.heldout_windows, "heldout_skip": a.heldout_skip,
               "fraction_of_fp8": round(policy.fraction_of_fp8(), 6), "configs": out}
    (a.out / f"heldout{skip}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {a.out / f'heldout{skip}.json'} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
