"""Which layer breaks vLLM's emulated ``nvfp4`` on a model, and why (reference path, CPU).

On the first ``--windows`` of the held-out windows of ``studies.upstream_nvfp4_numerics heldout``
(the last 8 x ``--window`` tokens of TEXT's final 50,000 characters), against the unquantized
cache: vLLM's nvfp4 write (``flashinfer_nvfp4_quantize``, global scale 1.0) on every layer while
recording, per layer, K and V's largest magnitude, the 16-element blocks whose block scale would
saturate (amax > 6 x 448) or underflow (amax / 6 < 2^-10), the write's error ``|q(x) - x| / |x|``
and the same error against the per-channel-centered part, ``|q(x) - x| / |x - mean_t(x)|`` (the
mean over the window's tokens, per KV head and channel); then that write on one layer only, and on
every layer but one, for the first and the last layer. Prints a table and one line per run.

    PYTHONPATH=. python results/2026-12-06-upstream-nvfp4-numerics-qwen25coder15b-cpu/layer_diagnosis.py \\
        MODEL TEXT --dtype bfloat16
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from studies.common import Progress, load_study, row
from studies.upstream_nvfp4_numerics import (UpstreamNVFP4, flashinfer_nvfp4_fake_quantize,
                                             placeholder_policy)
from vllm_nvfp4.calibration.evaluator import Evaluator

STATS: dict[tuple[str, int], dict[str, float]] = {}


def _record(kind: str, layer: int, x: torch.Tensor) -> None:
    x = x.float()
    err = flashinfer_nvfp4_fake_quantize(x).float() - x  # x of the model dtype: exact in FP32
    amax = x.reshape(*x.shape[:-1], -1, 16).abs().amax(-1)
    centered = x - x.mean(dim=-2, keepdim=True)  # [batch, heads, seq, head_dim]: over seq
    s = STATS.setdefault((kind, layer), {"max": 0.0, "saturated": 0, "underflow": 0, "blocks": 0,
                                         "err2": 0.0, "x2": 0.0, "c2": 0.0})
    s["max"] = max(s["max"], x.abs().max().item())
    s["saturated"] += int((amax > 6 * 448).sum())
    s["underflow"] += int((amax / 6 < 2 ** -10).sum())
    s["blocks"] += amax.numel()
    s["err2"] += float(err.pow(2).sum())
    s["x2"] += float(x.pow(2).sum())
    s["c2"] += float(centered.pow(2).sum())


@dataclass(frozen=True)
class Recorded(UpstreamNVFP4):
    """:class:`UpstreamNVFP4` that records what it writes."""

    def stored_key(self, layer, stored, key, raw_key, quant, nonfinite, nvfp4_decoding):
        _record("K", layer, raw_key)
        return super().stored_key(layer, stored, key, raw_key, quant, nonfinite, nvfp4_decoding)

    def stored_value(self, layer, stored, value, quant, nonfinite, nvfp4_decoding):
        _record("V", layer, value)
        return super().stored_value(layer, stored, value, quant, nonfinite, nvfp4_decoding)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("text", type=Path)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=2)
    a = ap.parse_args()
    model, info, _, tail = load_study(a.model, a.text, a.dtype)
    w = a.window
    windows = torch.tensor(tail[-w * 8:]).view(8, w)[:a.windows]
    ev = Evaluator(model, windows, reuse_prefix=False)
    progress = Progress()
    ev.reference(progress)
    policy = placeholder_policy(info.num_layers, info.layer_types)
    layers = list(info.kv_layers)
    ev.options = (Recorded(),)
    runs = [("every layer", ev.measure(policy, progress).to_dict())]
    print(f"{a.windows} x {w} held-out tokens, {a.dtype}; vLLM nvfp4 emulated, global scale 1.0")
    print("| | layer | max abs | blocks saturated | blocks underflow | write error / abs "
          "| write error / centered |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in "KV":
        for layer in layers:
            s = STATS[(kind, layer)]
            print(f"| {kind} | {layer} | {s['max']:.1f} | {s['saturated']}/{s['blocks']} | "
                  f"{s['underflow']} | {(s['err2'] / s['x2']) ** 0.5:.3f} | "
                  f"{(s['err2'] / s['c2']) ** 0.5:.3f} |")
    first, last = layers[0], layers[-1]
    for name, skip in [(f"layer {first} only", set(layers) - {first}),
                       (f"layer {last} only", set(layers) - {last}),
                       (f"every layer but {first}", {first}), (f"every layer but {last}", {last})]:
        ev.options = (UpstreamNVFP4(frozenset(skip)),)
        runs.append((name, ev.measure(policy, progress).to_dict()))
    for name, m in runs:
        print(row(name, m), flush=True)


if __name__ == "__main__":
    main()
