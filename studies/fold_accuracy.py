"""Accuracy cost of folding the NVFP4 block scale into one E4M3 value per element (the operand of
an FP8 tensor-core decode) against the exact NVFP4 decoding, on a real model and text.

Both decodings read the same cache bytes (:func:`vllm_nvfp4.formats.nvfp4_dequantize` and
:func:`~vllm_nvfp4.formats.nvfp4_dequantize_folded`). Every layer's K and V are NVFP4 with scales
calibrated on the first window (per layer, as ``vllm-nvfp4 analyze`` does); the next ``--windows``
windows are scored:

* element level, over the post-RoPE K and V of the first scored window: the share of elements the
  folding changes, the max / mean relative change ``|folded - exact| / |exact|`` (non-zero exact
  values), and the per-vector relative error ``||dec - x|| / ||x||`` of both decodings;
* model level, with transformers fake quantization (:mod:`vllm_nvfp4.calibration.kv_hooks`):
  delta NLL and top-1 agreement of both against the unquantized model, and folded against exact
  (paired delta NLL with its standard error, KL, top-1 agreement).

    python -m studies.fold_accuracy MODEL_DIR --data brown.txt [--window 1024] [--windows 3]
                                       [--dtype float32] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from vllm_nvfp4.calibration.data import add_text_arguments, load_windows
from vllm_nvfp4.calibration.kv_hooks import KVObserver, kv_cache_quantization
from vllm_nvfp4.calibration.metrics import per_token_damage, reference_from_logits, summarize
from vllm_nvfp4.calibration.modeling import load_model
from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy
from vllm_nvfp4.formats import nvfp4_dequantize, nvfp4_dequantize_folded, nvfp4_quantize
from vllm_nvfp4.policy import KVPolicy


class _Capture(KVObserver):
    """An observer that also keeps every layer's K and V ``[batch, kv_heads, seq, head_dim]``."""

    def __init__(self, num_layers: int, kv_layers: list[int]) -> None:
        super().__init__(num_layers, kv_layers)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        super().observe(layer, key, value)
        self.kv[layer] = (key.detach().float(), value.detach().float())


def element_errors(x: torch.Tensor, global_scale: float) -> dict[str, float]:
    """Folded against exact decoding of ``x [..., D]`` quantized to NVFP4 with ``global_scale``."""
    packed, scales = nvfp4_quantize(x, global_scale)
    exact = nvfp4_dequantize(packed, scales, global_scale).double()
    folded = nvfp4_dequantize_folded(packed, scales, global_scale).double()
    nz = exact != 0
    rel = (folded - exact).abs()[nz] / exact.abs()[nz]
    norm = x.double().norm(dim=-1).clamp_min(1e-30)
    return {"elements": x.numel(), "changed": float((folded != exact).double().mean()),
            "rel_change_max": float(rel.max()), "rel_change_mean": float(rel.mean()),
            "vec_err_exact": float(((exact - x.double()).norm(dim=-1) / norm).mean()),
            "vec_err_folded": float(((folded - x.double()).norm(dim=-1) / norm).mean())}


def _pool(rows: list[dict[str, float]]) -> dict[str, float]:
    """Element-weighted means (maxima for ``*_max``) of per-layer :func:`element_errors`."""
    n = sum(r["elements"] for r in rows)
    return {k: (max(r[k] for r in rows) if k.endswith("_max")
                else sum(r[k] * r["elements"] for r in rows) / n)
            for k in rows[0] if k != "elements"}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_text_arguments(ap, window=1024, windows=3)
    ap.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    ap.add_argument("--json", help="also write the results as JSON here")
    args = ap.parse_args()
    model, tokenizer, info = load_model(args.model, args.dtype, "cpu", args.window, args.windows)
    toks = load_windows(args.data, tokenizer, args.window, args.windows, 1, info.max_positions)
    observer = observe_amax(model, toks.calib, info.num_layers, kv_layers=info.kv_layers)
    formats = KVPolicy.from_compact("*:nvfp4", info.num_layers, layer_types=info.layer_types)
    policy = scaled_policy(formats, observer)

    capture = _Capture(info.num_layers, info.kv_layers)
    refs, runs = [], {"exact": [], "folded": []}
    with torch.no_grad():
        for w, ids in enumerate(toks.eval):
            ids = ids.unsqueeze(0)
            with kv_cache_quantization(model, observer=capture if w == 0 else None):
                refs.append(reference_from_logits(model(ids, use_cache=False).logits[0], ids[0]))
            for name in runs:
                with kv_cache_quantization(model, policy, nvfp4_decoding=name):
                    runs[name].append(model(ids, use_cache=False).logits[0])

    per_layer = {kv: [element_errors(capture.kv[i][j], float(policy.layers[i].quant_scale(kv)))
                      for i in info.kv_layers] for j, kv in enumerate("kv")}
    result: dict[str, Any] = {"model": info.path, "dtype": args.dtype, "data": toks.describe(),
                              "elements": {kv: _pool(rows) for kv, rows in per_layer.items()}}
    for name, logits in runs.items():
        damage = [per_token_damage(lg, r) for lg, r in zip(logits, refs)]
        result[name] = summarize(*zip(*damage), refs).to_dict()
    exact_refs = [reference_from_logits(e, ids) for e, ids in zip(runs["exact"], toks.eval)]
    vs = [per_token_damage(f, r) for f, r in zip(runs["folded"], exact_refs)]
    d = torch.cat([nll - r.nll for (_, nll, _), r in zip(vs, exact_refs)]).double()
    result["folded_vs_exact"] = {
        "dnll": float(d.mean()), "dnll_se": float(d.std()) / math.sqrt(d.numel()),
        "kl": float(torch.cat([kl for kl, _, _ in vs]).double().mean()),
        "top1": float(torch.cat([t for _, _, t in vs]).double().mean())}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
