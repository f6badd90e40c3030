#!/usr/bin/env python
"""How accurate is vLLM's own ``--kv-cache-dtype nvfp4`` against ``nvfp4_mixed``? (CPU, emulated)

    python -m studies.upstream_nvfp4_numerics heldout MODEL TEXT --startup-policy POLICY.json
        --out DIR [--window 512] [--heldout-windows 8] [--dtype float32]
    python -m studies.upstream_nvfp4_numerics check-flashinfer     # CUDA + flashinfer: the bytes

vLLM's ``nvfp4`` KV cache on Hopper (the FlashInfer fa2 path, vLLM 0.33/0.34) writes K and V of
every layer (``--kv-cache-dtype-skip-layers`` aside) with FlashInfer's
``nvfp4_append_quantize_block`` (``include/flashinfer/page.cuh``, FlashInfer 0.7.4), emulated
here by :func:`flashinfer_nvfp4_quantize`: per 16 consecutive elements of a head vector,
``sf = e4m3(amax16 / (6 g))`` (FP32 division, E4M3 round-to-nearest-even saturating at 448:
``__nv_fp8_e4m3(float)`` is ``__NV_SATFINITE``; subnormal E4M3 scales down to 2^-9, a quotient
of 2^-10 or less becomes 0), then each element ``e2m1(x * r)`` with ``r = 1 / (float(sf) g)``
(an FP32 reciprocal, then a product: not a division) and the thresholds of
``nvfp4_append_quantize_e2m1`` (round to nearest, ties to the even code, saturating at 6); the
sign bit is ``signbit(x * r)`` (so ``-0`` keeps it); ``sf = 0`` (an all-zero block, or
underflow) stores ``r = 0`` and decodes to 0. ``g`` is the layer's ``_k_scale`` / ``_v_scale``:
1.0 for a checkpoint without KV scales (vLLM's default, :data:`VLLM_DEFAULT_SCALE`). There is no
K centering, no smoothing, no choice of block scale; queries stay in the model dtype
(``q_scale`` 1.0 on fa2). The read-back is ``e2m1 * sf`` (``* g``), exact in FP32 and in bf16.

What the emulation assumes of the build: FlashInfer compiles ``page.cu`` with ``-use_fast_math``,
under which ``1.0f / y`` and ``amax / y`` may become approximate (``rcp.approx`` / ``div.full``,
at most 1-2 ulp off); the emulation uses IEEE-rounded FP32 (FlashInfer's ``precise_rounding``
variant). The two can differ only for an element whose ``x / sf`` sits exactly on a rounding
threshold with a non-power-of-two ``sf``, or a block whose ``amax16 / 6`` sits exactly on an
E4M3 rounding midpoint. ``check-flashinfer`` measures that on a GPU: it writes random bf16 K/V
and the hand vectors of the unit test through FlashInfer's
``nvfp4_quantize_append_paged_kv_cache_with_slot_mapping`` and counts the bytes that differ.

``heldout`` measures, on the last ``--heldout-windows`` windows of TEXT's final 50,000 characters
against the unquantized cache (delta NLL with its 95% CI, top-1 agreement, KL) and with each
configuration's KV bytes as a fraction of FP8's: our all-FP8 (calibrated on the first window of
TEXT, K centering); vLLM's nvfp4 emulated with ``g = 1.0``, on every layer and with the first and
last layer skipped (stored in the model dtype, counted as bf16: 2 bytes); our all-NVFP4 (the same
calibration, K centering, the sink key uncentered where it fits, the lowest-error block scale of
:func:`vllm_nvfp4.formats.nvfp4_quantize`); and ``--startup-policy``, the policy start-up
calibration chose for MODEL (the file ``--kv-cache-dtype nvfp4_mixed`` with no policy writes into
its start-up cache). Writes ``DIR/heldout.json`` and ``DIR/table.md``. Transformers on the CPU
with the cache fake-quantized (:mod:`vllm_nvfp4.calibration.kv_hooks`), one thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from studies.common import Progress, Z95, load_study, row, study_parser
from vllm_nvfp4 import formats as F
from vllm_nvfp4.calibration.kv_hooks import KVOption, LayerQuant
from vllm_nvfp4.policy import KVPolicy

#: ``layer._k_scale`` / ``layer._v_scale`` of a checkpoint without KV scales
VLLM_DEFAULT_SCALE = 1.0
#: KV bytes per element of a layer ``--kv-cache-dtype-skip-layers`` leaves in the model dtype
BF16_BYTES = 2.0


# ---------------------------------------------------------------------------- the quantizer
def flashinfer_nvfp4_quantize(x: torch.Tensor, global_scale: float = VLLM_DEFAULT_SCALE
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's NVFP4 write of ``x [..., D]`` (``D % 16 == 0``, finite) with global scale
    ``global_scale`` (positive, finite): ``(packed uint8 [..., D/2], block scales
    float8_e4m3fn [..., D/16])`` in the layout of :mod:`vllm_nvfp4.formats` (low nibble first).
    The rule is the module doc's; ``ValueError`` on non-finite input or a bad scale (the kernel
    traps on the scale)."""
    if not x.is_floating_point() or x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % F.NVFP4_BLOCK_SIZE:
        raise ValueError(f"expected a float tensor [..., D] with D a positive multiple of 16, got "
                         f"{x.dtype} {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("the emulated FlashInfer write takes finite K/V only")
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if g.dim() != 0 or not bool(torch.isfinite(g)) or not bool(g > 0):
        raise ValueError(f"the global scale (vLLM's layer._k_scale / _v_scale) must be one positive "
                         f"finite float, got {global_scale!r}")
    d = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], d // F.NVFP4_BLOCK_SIZE, F.NVFP4_BLOCK_SIZE)
    amax = xb.abs().amax(dim=-1)
    sf = F.e4m3_round(amax / (6.0 * g))  # amax 0 -> 0; saturating at 448
    sf_value = sf.float()
    recip = torch.where(sf_value > 0, 1.0 / torch.where(sf_value > 0, sf_value * g, 1.0), 0.0)
    q = xb * recip.unsqueeze(-1)
    magnitude = F.e2m1_code(q.abs())  # the thresholds of nvfp4_append_quantize_e2m1
    codes = magnitude | (torch.signbit(q).to(torch.uint8) << 3)
    codes = codes.reshape(*x.shape[:-1], d // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), sf


def flashinfer_nvfp4_fake_quantize(x: torch.Tensor, global_scale: float = VLLM_DEFAULT_SCALE
                                   ) -> torch.Tensor:
    """``x [..., D]`` written by :func:`flashinfer_nvfp4_quantize` and read back
    (``e2m1 * sf * g`` in FP32), cast to ``x.dtype``."""
    packed, sf = flashinfer_nvfp4_quantize(x, global_scale)
    return F.nvfp4_dequantize(packed, sf, global_scale, dtype=x.dtype)


@dataclass(frozen=True)
class UpstreamNVFP4(KVOption):
    """vLLM's ``nvfp4`` KV cache: K and V of every layer but ``skip_layers`` written by
    :func:`flashinfer_nvfp4_fake_quantize` with global scales ``k_scale`` / ``v_scale``;
    ``skip_layers`` keep K/V as computed (``--kv-cache-dtype-skip-layers``). Replaces what the
    policy stores, so run it with :func:`placeholder_policy` (no K transforms: the keys it gets are
    the model's)."""

    skip_layers: frozenset[int] = frozenset()
    k_scale: float = VLLM_DEFAULT_SCALE
    v_scale: float = VLLM_DEFAULT_SCALE

    def bind(self, policy: Optional[KVPolicy], num_kv_heads: int) -> KVOption:
        if policy is None or any(lp.k_center is not None or lp.k_smooth is not None or
                                 lp.k_perm is not None for lp in policy.layers):
            raise ValueError("UpstreamNVFP4 replaces the stored K/V of a policy without K "
                             "transforms: pass placeholder_policy(...)")
        return self

    def stored_key(self, layer: int, stored: torch.Tensor, key: torch.Tensor, raw_key: torch.Tensor,
                   quant: LayerQuant, nonfinite: F.NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        return raw_key if layer in self.skip_layers else flashinfer_nvfp4_fake_quantize(raw_key, self.k_scale)

    def stored_value(self, layer: int, stored: torch.Tensor, value: torch.Tensor,
                     quant: LayerQuant, nonfinite: F.NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        return value if layer in self.skip_layers else flashinfer_nvfp4_fake_quantize(value, self.v_scale)

    def fraction_of_fp8(self, kv_layers: Sequence[int]) -> float:
        """KV bytes against an all-FP8 cache over ``kv_layers``: 0.5625 per NVFP4 element, 2 per
        skipped (bf16) one, 1 per FP8 one."""
        nv = F.KVFormat.NVFP4.bytes_per_element
        return sum(BF16_BYTES if i in self.skip_layers else nv for i in kv_layers) / len(kv_layers)


def placeholder_policy(num_layers: int, layer_types: Sequence[Any]) -> KVPolicy:
    """The policy :class:`UpstreamNVFP4` runs under: FP8 with default scales, no K transforms (its
    stores are replaced; it only routes every layer through the hook)."""
    return KVPolicy.from_compact("*:fp8", num_layers, layer_types=layer_types)


# ---------------------------------------------------------------------------- held-out accuracy
def _table(out: dict[str, dict[str, Any]]) -> str:
    lines = ["| configuration | KV bytes vs FP8 | top-1 agreement | delta NLL [95% CI] | KL |",
             "|---|---:|---:|---:|---:|"]
    for name, m in out.items():
        lo, hi = m["dnll"] - Z95 * m["dnll_se"], m["dnll"] + Z95 * m["dnll_se"]
        lines.append(f"| {name} | {m['fraction_of_fp8']:.3f} | {m['top1']:.4f} | "
                     f"{m['dnll']:+.4f} [{lo:+.4f}, {hi:+.4f}] | {m['kl']:.4f} |")
    return "\n".join(lines) + "\n"


def heldout(argv: Sequence[str]) -> int:
    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy
    from vllm_nvfp4.calibration.sensitivity import all_format

    ap = study_parser(__doc__, ())
    ap.add_argument("--startup-policy", type=Path, required=True,
                    help="the policy start-up calibration chose for MODEL (its start-up cache file)")
    ap.set_defaults(heldout_windows=8)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model, info, head, tail = load_study(a.model, a.text, a.dtype)
    startup = KVPolicy.load(a.startup_policy)
    startup.check_model(info.num_layers, info.num_kv_heads, layer_types=info.layer_types)
    w, kv_layers = a.window, list(info.kv_layers)
    print(f"model loaded ({info.num_layers} layers, head_dim {info.head_dim}), "
          f"{time.time() - t0:.0f} s; calibrating on the first {w} tokens", flush=True)
    observer = observe_amax(model, torch.tensor(head[:w]).view(1, w), info.num_layers,
                            kv_layers=kv_layers)
    scaled = scaled_policy(KVPolicy.from_compact("*:fp8", info.num_layers, layer_types=info.layer_types),
                           observer, False, {}, None, k_center=True, k_sink_uncentered=True)
    windows = torch.tensor(tail[-w * a.heldout_windows:]).view(a.heldout_windows, w)
    ev = Evaluator(model, windows, reuse_prefix=False)
    progress = Progress()
    ev.reference(progress)
    print(f"reference: {a.heldout_windows} x {w} held-out tokens, {time.time() - t0:.0f} s", flush=True)
    skip = frozenset({kv_layers[0], kv_layers[-1]})
    upstream = placeholder_policy(info.num_layers, info.layer_types)
    configs: list[tuple[str, KVPolicy, Sequence[KVOption], float]] = [
        ("ours all-FP8 (calibrated, K centering)", all_format(scaled, "fp8"), (), 1.0),
        ("vLLM nvfp4, emulated (g = 1.0)", upstream, (UpstreamNVFP4(),),
         UpstreamNVFP4().fraction_of_fp8(kv_layers)),
        (f"vLLM nvfp4, emulated, layers {sorted(skip)} skipped (bf16)", upstream,
         (UpstreamNVFP4(skip),), UpstreamNVFP4(skip).fraction_of_fp8(kv_layers)),
        ("ours all-NVFP4 (calibrated, K centering, lowest-error block scale)",
         all_format(scaled, "nvfp4"), (), None),
        ("ours flag only (start-up policy)", startup, (), None),
    ]
    out: dict[str, dict[str, Any]] = {"unquantized (reference)": {
        "kl": 0.0, "dnll": 0.0, "dnll_se": 0.0, "top1": 1.0, "fraction_of_fp8": BF16_BYTES}}
    for name, policy, options, fraction in configs:
        ev.options = tuple(options)
        m = ev.measure(policy, progress).to_dict()
        m["fraction_of_fp8"] = round(policy.fraction_of_fp8() if fraction is None else fraction, 6)
        out[name] = m
        print(f"{row(name[:34], m)}  bytes {m['fraction_of_fp8']:.3f}  ({time.time() - t0:.0f} s)",
              flush=True)
    summary = {"model": str(a.model), "text": str(a.text), "window": w, "dtype": a.dtype,
               "heldout_windows": a.heldout_windows, "startup_policy": str(a.startup_policy),
               "startup_provenance": startup.provenance, "upstream_skip_layers": sorted(skip),
               "upstream_global_scale": VLLM_DEFAULT_SCALE, "configs": out}
    (a.out / "heldout.json").write_text(json.dumps(summary, indent=1) + "\n")
    (a.out / "table.md").write_text(_table(out))
    print(f"wrote {a.out / 'heldout.json'} and table.md ({time.time() - t0:.0f} s)", flush=True)
    return 0


# ---------------------------------------------------------------------------- the GPU check
def check_flashinfer(argv: Sequence[str]) -> int:
    """Write random bf16 K/V through FlashInfer's NVFP4 append (page size 1, NHD, one slot per
    row) and compare its bytes with :func:`flashinfer_nvfp4_quantize`; exit 1 on any difference."""
    ap = argparse.ArgumentParser(description=check_flashinfer.__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args(argv)
    from flashinfer.page import nvfp4_quantize_append_paged_kv_cache_with_slot_mapping

    torch.manual_seed(0)
    dev = torch.device("cuda")
    shape = (a.rows, a.heads, a.head_dim)
    # spread over the E4M3 range, subnormal block scales included; every 7th row bf16 values that
    # sit on an E2M1 threshold times a non-power-of-two block scale (amax 11.25: sf 1.875)
    k = (torch.randn(shape, device=dev) * torch.exp2(torch.randint(-12, 9, (a.rows, a.heads, 1), device=dev).float()))
    ties = torch.tensor([11.25, 2.34375, 4.6875, 9.375, 0.46875, 1.40625, 3.28125, 6.5625] * 2,
                        device=dev)
    k[::7] = ties.repeat(a.heads, a.head_dim // 16).view(a.heads, a.head_dim)
    k, v = k.bfloat16(), (-k).bfloat16()
    data = torch.zeros((2, a.rows, 1, a.heads, a.head_dim // 2), dtype=torch.uint8, device=dev)
    sf = torch.zeros((2, a.rows, 1, a.heads, a.head_dim // 16), dtype=torch.float8_e4m3fn, device=dev)
    slots = torch.arange(a.rows, dtype=torch.int64, device=dev)
    nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
        k, v, slots, (data[0], data[1]), (sf[0], sf[1]), VLLM_DEFAULT_SCALE, VLLM_DEFAULT_SCALE,
        kv_layout="NHD")
    bad = 0
    for i, x in enumerate((k, v)):
        packed, scales = flashinfer_nvfp4_quantize(x.cpu())
        got_p, got_s = data[i, :, 0].cpu(), sf[i, :, 0].cpu()
        dp = int((got_p != packed).sum())
        ds = int((got_s.view(torch.uint8) != scales.view(torch.uint8)).sum())
        print(f"{'KV'[i]}: {dp} of {packed.numel()} data bytes and {ds} of {scales.numel()} "
              f"block scales differ", flush=True)
        bad += dp + ds
    return 1 if bad else 0


STEPS = {"heldout": heldout, "check-flashinfer": check_flashinfer}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in STEPS:
        raise SystemExit(f"usage: python -m studies.upstream_nvfp4_numerics {{{','.join(STEPS)}}} ... "
                         "(see the module doc)")
    return STEPS[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(main())
