#!/usr/bin/env python
"""Would K centering on a position-dependent offset remove the centering's damage at far
positions (CPU, reference path)?

    python -m studies.rotating_center_study MODEL TEXT --policy POLICY.json --out DIR
        [--served 8192] [--thetas 1.0 0.5] [--rot-pairs 4 8] [--configs NAME ...] [--window 8176]
        [--windows 3]

K centering stores ``K - mu`` with ``mu`` the mean post-RoPE key of calibration windows at
positions ``0 .. L-1``; at a far position RoPE has turned the keys' mean ``R(p) b`` (``b``: the
pre-RoPE mean) away from ``mu``. Calibrated here on POLICY's own data (its provenance: files,
window, windows; the served prefixes as ``vllm-nvfp4 calibrate`` cuts them) at position 0 and at
the position offsets of :func:`~vllm_nvfp4.calibration.position_range.range_offsets` up to
``--served`` (range only, first key of each shifted run left out, as
:meth:`~vllm_nvfp4.calibration.kv_hooks.KVObserver.range_only`):

* ``rotating``: :class:`~studies.kv_options.RotatingCenter`, the cache stores ``K - R(p) b``,
  ``b`` = the mean of ``R(p)^-1 K(p)`` over the windows at position 0; K scales from the amax of
  ``K - R(p) b`` over all runs;
* ``rotating k`` (``--rot-pairs``): ``R(p) b`` only on each KV head's ``k`` RoPE pairs of largest
  ``|b_pair|``, the constant ``mu`` on the others (:func:`~studies.kv_options.hybrid_offsets`:
  only the ``k`` pairs need a per-key logit term), K scales the same way;
* ``slow theta``: the policy's ``mu`` kept only on the channel pairs whose RoPE angle over the
  served length stays below ``theta`` rad (``inv_freq * served < theta``), 0 elsewhere; K scales
  from the amax of ``K - mu'`` over all runs (a calibration-only change).

Sink flags (``k_sink_uncentered``) follow the calibration's rule with each variant's K range.
Each variant with POLICY's formats (``served``) and every layer FP8 (``all-FP8``), measured as
:mod:`studies.position_damage_study` does (teacher-forced on the last ``--windows`` windows of
``--window`` tokens of TEXT, KL and top-1 per position range against the unquantized cache).
Checks first that ``R(p)`` applied to the pre-RoPE key (``k_proj``'s output) reproduces the
hooked post-RoPE key, and that the policy's ``mu`` and K scales come back from the calibration
here. Writes ``DIR/rotating_center.json`` and ``DIR/rotating_center.md``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from studies.position_damage_study import (long_window_parser, load_long_text, position_damage, table,
                                           tail_windows, write_results)


@dataclass
class KeyTap:
    """A :class:`~vllm_nvfp4.calibration.kv_hooks.KVOption` that records every layer's post-RoPE
    keys ``[kv_heads, seq, head_dim]`` (FP32, CPU; batch 1) of the last forward."""

    keys: dict[int, Any] = field(default_factory=dict)

    def as_option(self) -> Any:
        from vllm_nvfp4.calibration.kv_hooks import KVOption

        tap = self

        class _Tap(KVOption):
            def inputs(self, layer, query, key, value):  # type: ignore[no-untyped-def]
                tap.keys[layer] = key[0].detach().float().cpu()
                return query, key, value
        return _Tap()


def collect_keys(model: Any, windows: Any, offsets: Sequence[int]) -> list[tuple[int, dict[int, Any]]]:
    """``(offset, {layer: keys [kv_heads, seq, head_dim]})`` of every window at position 0, then
    of every window at each of ``offsets``."""
    import torch

    from vllm_nvfp4.calibration.kv_hooks import kv_cache_quantization
    from vllm_nvfp4.calibration.modeling import shifted_position_ids

    tap, runs = KeyTap(), []
    with torch.no_grad(), kv_cache_quantization(model, options=[tap.as_option()]):
        for o in (0, *offsets):
            for row in windows:
                ids = row[None]
                pos = None if not o else shifted_position_ids(model, ids.shape[1], o)
                model(ids, position_ids=pos, use_cache=False)
                runs.append((o, dict(tap.keys)))
    return runs


def check_rope(model: Any, ids: Any, offset: int = 0, atol: float = 1e-4) -> float:
    """Largest ``|R(p) k_pre - k_post|`` over layers (``k_pre``: ``k_proj``'s output, ``k_post``
    the key the attention hook gets) for ``ids [1, T]`` at positions ``offset ..``; raises
    ``AssertionError`` beyond ``atol`` (relative to the key's amax)."""
    import torch

    from studies.kv_options import rope_frequencies, rope_rotate
    from vllm_nvfp4.calibration.hf_model import attention_modules, text_config
    from vllm_nvfp4.calibration.kv_hooks import kv_cache_quantization
    from vllm_nvfp4.calibration.modeling import shifted_position_ids

    cfg = text_config(model)
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    pre: dict[int, Any] = {}
    hooks = [m.k_proj.register_forward_hook(
        lambda mod, inp, out, i=m.layer_idx: pre.__setitem__(i, out[0].detach().float()))
        for m in attention_modules(model)]
    tap = KeyTap()
    try:
        with torch.no_grad(), kv_cache_quantization(model, options=[tap.as_option()]):
            pos = None if not offset else shifted_position_ids(model, ids.shape[1], offset)
            model(ids, position_ids=pos, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    inv_freq, scaling = rope_frequencies(model)
    positions = torch.arange(offset, offset + ids.shape[1])
    worst = 0.0
    for layer, post in tap.keys.items():
        k = pre[layer].view(ids.shape[1], heads, dim).transpose(0, 1)
        err = float((rope_rotate(k, positions, inv_freq, scaling) - post).abs().max())
        rel = err / max(float(post.abs().max()), 1e-30)
        assert rel <= atol, f"layer {layer}: R(p) k_pre differs from the hooked key by {rel:.2e} of its amax"
        worst = max(worst, rel)
    return worst


def calibrate(runs: list[tuple[int, dict[int, Any]]], inv_freq: Any, scaling: float, served: int,
              thetas: Sequence[float], rot_pairs: Sequence[int] = ()) -> dict[str, Any]:
    """Per layer ``mu`` (post-RoPE mean), ``b`` (pre-RoPE mean) from the runs at offset 0; per
    variant (``policy mu``, ``rotating``, ``rotating <k>``, ``slow <theta>``) the K amax over all
    runs (shifted runs without their first key) and the per-head amax of the first keys
    (uncentered); ``hybrid[k][layer]``: ``rotating <k>``'s ``(b', mu')``."""
    import torch

    from studies.kv_options import hybrid_offsets, rope_rotate, rope_unrotate

    layers = sorted(runs[0][1])
    base = [keys for o, keys in runs if o == 0]
    seq = base[0][layers[0]].shape[1]
    pos0 = torch.arange(seq)
    mu = {i: torch.stack([r[i] for r in base]).mean(dim=(0, 2)) for i in layers}
    b = {i: torch.stack([rope_unrotate(r[i], pos0, inv_freq, scaling) for r in base]).mean(dim=(0, 2))
         for i in layers}
    pair_angle = torch.cat([inv_freq, inv_freq]) * served  # [head_dim]
    variants: dict[str, Callable[[int, Any], Any]] = {
        "policy mu": lambda i, p: mu[i][:, None, :],
        "rotating": lambda i, p: rope_rotate(b[i][:, None, :].expand(-1, len(p), -1), p, inv_freq, scaling)}
    hybrid = {k: {i: hybrid_offsets(b[i], mu[i], k) for i in layers} for k in rot_pairs}
    for k in rot_pairs:
        variants[f"rotating {k}"] = (lambda i, p, k=k: rope_rotate(
            hybrid[k][i][0][:, None, :].expand(-1, len(p), -1), p, inv_freq, scaling) + hybrid[k][i][1][:, None, :])
    slow_mu = {}
    for theta in thetas:
        keep = (pair_angle < theta).float()
        slow_mu[theta] = {i: mu[i] * keep for i in layers}
        variants[f"slow {theta:g}"] = (lambda i, p, t=theta: slow_mu[t][i][:, None, :])
    amax = {name: {} for name in variants}
    for o, keys in runs:
        start = 0 if o == 0 else 1
        p = torch.arange(o + start, o + seq)
        for i in layers:
            k = keys[i][:, start:]
            for name, off in variants.items():
                a = float((k - off(i, p)).abs().max())
                amax[name][i] = max(amax[name].get(i, 0.0), a)
    first = {i: torch.stack([r[i][:, 0] for r in base]).abs().amax(dim=(0, 2)) for i in layers}
    return {"mu": mu, "b": b, "hybrid": hybrid, "slow_mu": slow_mu, "amax": amax, "first_amax": first,
            "pairs_kept": {t: int((pair_angle[: len(inv_freq)] < t).sum()) for t in thetas}}


def _sink_flags(first_amax: Any, amax: float) -> Any:
    from vllm_nvfp4.calibration.scales import _sink_fits
    import torch

    return _sink_fits(first_amax, torch.tensor([amax]), per_head=False)


def baselines(policy: Any) -> dict[str, Any]:
    """POLICY's own constant-offset configs, the ends of the all-NVFP4 -> FP8 gap: as served, every
    layer FP8, every layer NVFP4 with the sink key centered (measured only when named)."""
    from vllm_nvfp4.calibration.sensitivity import all_format
    from vllm_nvfp4.calibration.sink_choice import without_sink_key

    return {"constant, served": policy, "constant, all-FP8": all_format(policy, "fp8"),
            "constant, all-NVFP4 centered": without_sink_key(all_format(policy, "nvfp4"))}


def variant_policies(policy: Any, cal: dict[str, Any], inv_freq: Any, scaling: float,
                     thetas: Sequence[float]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """``(policies, options)``: per config name its policy and study options (module doc)."""
    import torch

    from studies.kv_options import RotatingCenter
    from vllm_nvfp4.calibration.sensitivity import all_format
    from vllm_nvfp4.formats import fp8_scale_from_amax, nvfp4_global_scale

    def scaled(lp: Any, a: float) -> Any:
        return replace(lp, k_scale=float(fp8_scale_from_amax(a)), k_global_scale=float(nvfp4_global_scale(a)))

    layers = [i for i, lp in enumerate(policy.layers) if lp.layer_type.holds_kv]
    heads = cal["mu"][layers[0]].shape[0]
    policies: dict[str, Any] = {}
    options: dict[str, list[Any]] = {}
    rotating = {"rotating": ({i: cal["b"][i] for i in layers}, {})}
    for k, h in cal.get("hybrid", {}).items():
        rotating[f"rotating {k}"] = ({i: h[i][0] for i in layers}, {i: h[i][1] for i in layers})
    for variant, (offsets, constant) in rotating.items():
        rot_layers, sink = list(policy.layers), {}
        for i in layers:
            a = cal["amax"][variant][i]
            rot_layers[i] = replace(scaled(policy.layers[i], a), k_center=None, k_sink_uncentered=None)
            flags = _sink_flags(cal["first_amax"][i], a)
            sink[i] = torch.tensor([bool(flags)] * heads if not isinstance(flags, tuple) else list(flags))
        rot = replace(policy, layers=tuple(rot_layers))
        option = RotatingCenter(inv_freq, scaling, offsets, sink, constant)
        for name, p in ((f"{variant}, served", rot), (f"{variant}, all-FP8", all_format(rot, "fp8")),
                        (f"{variant}, all-NVFP4", all_format(rot, "nvfp4"))):
            policies[name], options[name] = p, [option]
    policies.update(baselines(policy))
    for theta in thetas:
        slow = list(policy.layers)
        for i in layers:
            a = cal["amax"][f"slow {theta:g}"][i]
            rows = tuple(tuple(float(x) for x in r) for r in cal["slow_mu"][theta][i])
            slow[i] = replace(scaled(policy.layers[i], a), k_center=rows, k_sink_uncentered=None)
            slow[i] = replace(slow[i], k_sink_uncentered=_sink_flags(cal["first_amax"][i], a))
        sp = replace(policy, layers=tuple(slow))
        policies[f"slow {theta:g}, served"] = sp
        policies[f"slow {theta:g}, all-FP8"] = all_format(sp, "fp8")
    return policies, options


def calibration_windows(policy: Any, tokenizer: Any, model: Any) -> Any:
    """POLICY's calibration windows ``[n, T]`` as ``vllm-nvfp4 calibrate`` cut them (provenance)."""
    from vllm_nvfp4.calibration.data import load_windows
    from vllm_nvfp4.calibration.hf_model import text_config

    data = policy.provenance["data"]
    paths = [Path(f["path"]) for f in data["files"]]
    return load_windows(paths, tokenizer, data["window_tokens"], count=0, calib=data["calib_windows"],
                        max_positions=getattr(text_config(model), "max_position_embeddings", None)).calib


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from studies.kv_options import rope_frequencies
    from vllm_nvfp4.calibration.modeling import load_model
    from vllm_nvfp4.calibration.position_range import range_offsets

    ap = long_window_parser(__doc__)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--served", type=int, default=8192, help="served length the range covers")
    ap.add_argument("--thetas", type=float, nargs="*", default=[1.0])
    ap.add_argument("--rot-pairs", type=int, nargs="*", default=[],
                    help="RoPE pairs per KV head of the hybrid variants 'rotating K' (module doc)")
    ap.add_argument("--configs", nargs="*", default=None,
                    help="config names to measure (default: every variant; the constant-offset baselines only by name)")
    a = ap.parse_args(argv)
    t0 = time.time()
    policy, model, ids = load_long_text(a, "rotating_center.json", a.window * a.windows)
    inv_freq, scaling = rope_frequencies(model)
    bad_pairs = [k for k in a.rot_pairs if not 0 <= k <= len(inv_freq)]
    if bad_pairs:
        ap.error(f"--rot-pairs {bad_pairs}: each must be 0 .. {len(inv_freq)} (the model's RoPE pairs per head)")
    _, tok, _ = load_model(a.model, a.dtype, "cpu")
    calib = calibration_windows(policy, tok, model)
    offsets = range_offsets(a.served, calib.shape[1])
    # the model's own RoPE rounds in its dtype (product and sum: two roundings of 2^-8 in bfloat16)
    tol = 1e-4 if a.dtype == "float32" else 2 ** -7 if a.dtype == "bfloat16" else 2 ** -10
    rope_err = max(check_rope(model, calib[:1], atol=tol), check_rope(model, calib[:1], offsets[-1], atol=tol))
    cal = calibrate(collect_keys(model, calib, offsets), inv_freq, scaling, a.served, a.thetas, a.rot_pairs)
    layers = sorted(cal["mu"])
    mu_err = max(float((cal["mu"][i] - torch.tensor(policy.layers[i].k_center)).abs().max()) for i in layers)
    scale_ratio = [cal["amax"]["policy mu"][i] / 448 / policy.layers[i].k_scale for i in layers]
    print(f"RoPE check {rope_err:.2e}; mu vs policy {mu_err:.2e}; policy K scale reproduced "
          f"{min(scale_ratio):.4f}-{max(scale_ratio):.4f}", flush=True)
    policies, options = variant_policies(policy, cal, inv_freq, scaling, a.thetas)
    unknown = sorted(set(a.configs or ()) - set(policies))
    if unknown:
        ap.error(f"unknown --configs {unknown}; choose from {sorted(policies)}")
    base_names = set(baselines(policy))
    policies = {n: p for n, p in policies.items() if (n in a.configs if a.configs else n not in base_names)}
    result = position_damage(model, tail_windows(ids, a.window, a.windows), policies, a.edges, options)
    per_layer = [{"layer": i,
                  "k_amax": {n: round(v[i], 4) for n, v in cal["amax"].items()},
                  "b_pair_norm_max": round(float(cal["b"][i].view(cal["b"][i].shape[0], 2, -1)
                                                 .norm(dim=1).max()), 4),
                  # share of |b|^2 on the rotated pairs of each hybrid variant
                  "b_sq_share_rotated": {str(k): round(float(h[i][0].square().sum() / cal["b"][i].square().sum()), 4)
                                         for k, h in cal["hybrid"].items()}}
                 for i in layers]
    summary = {"model": str(a.model), "text": str(a.text), "policy": str(a.policy), "window": a.window,
               "windows": a.windows, "dtype": a.dtype, "served": a.served, "offsets": list(offsets),
               "thetas": a.thetas, "rot_pairs": a.rot_pairs, "pairs_kept": {str(k): v for k, v in cal["pairs_kept"].items()},
               "rope_check_rel_err": rope_err, "mu_vs_policy_max_abs": mu_err,
               "policy_k_scale_reproduced": [round(min(scale_ratio), 5), round(max(scale_ratio), 5)],
               "seconds": round(time.time() - t0, 1), "layers": per_layer, "configs": result}
    write_results(a.out, "rotating_center", summary, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
