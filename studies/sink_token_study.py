#!/usr/bin/env python
"""How much of the NVFP4 damage sits in the attention-sink keys, the first keys of a sequence (CPU)?

    python -m studies.sink_token_study MODEL TEXT --out DIR [--window 1024] [--heldout-windows 4]
        [--dtype float32] [--sinks fp8:1 uncentered:1 exact:16 ...] [--fp8-slots 14k 15k ...]

On held-out windows, against the unquantized cache: calibrated all-FP8 and all-NVFP4 (K
centering on), then all-NVFP4 with each ``--sinks`` entry ``STORE:N`` (the first N keys of every
window stored as :class:`~studies.kv_options.KeySink` ``STORE`` says: ``fp8``,
``exact``, or ``uncentered`` = NVFP4 before K centering, no extra bytes). With ``--fp8-slots``
(e.g. the slots a ``tune`` policy keeps in FP8) the same for that mix. ``uncentered-fit:N`` is
``uncentered`` only in the layers where the calibration window's first key fits the NVFP4 range
before centering (elsewhere the keys stay as the policy stores them); ``uncentered-fit+fp8:N``
adds an FP8 copy in the other layers (an FP8 sink slot only where the no-byte flag cannot go).
Each row gets its top-1 and
delta-NLL gap recovery ``(x - all-NVFP4) / (all-FP8 - all-NVFP4)``; writes ``DIR/sink.json``,
with ``key_stats``: per KV layer, on the held-out windows, the first key's norm against the median
key's before and after K centering, and its largest centered element against the other keys'.

Windows as ``studies/sweep_base_study.py``: calibration = the first window of TEXT, held-out =
the last ``--heldout-windows`` windows of TEXT's final 50,000 characters. Transformers with the
cache fake-quantized (:mod:`vllm_nvfp4.calibration.kv_hooks`).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional, Sequence

from studies.common import load_slot_study, recovery, row, study_parser, with_fp8_slots

DEFAULT_SINKS = ("fp8:1", "uncentered:1", "fp8:16", "uncentered:16", "exact:16")
FIT_STORE = "uncentered-fit"
FIT_ELSE_FP8_STORE = "uncentered-fit+fp8"


def parse_sink(text: str, fitting_layers: Optional[frozenset[int]] = None,
               kv_layers: Sequence[int] = ()) -> tuple[Any, ...]:
    """``STORE:N`` -> the :class:`~studies.kv_options.KeySink` options it stands for
    (``uncentered-fit``: ``uncentered`` in ``fitting_layers``; ``uncentered-fit+fp8``: that and
    ``fp8`` in the other ``kv_layers``); ``SystemExit`` naming the valid form otherwise."""
    from studies.kv_options import KeySink

    store, _, n = text.partition(":")
    try:
        if store == FIT_STORE:
            return (KeySink(int(n), "uncentered", fitting_layers),)
        if store == FIT_ELSE_FP8_STORE:
            rest = frozenset(kv_layers) - (fitting_layers or frozenset())
            return (KeySink(int(n), "uncentered", fitting_layers), KeySink(int(n), "fp8", rest))
        return (KeySink(int(n), store),)
    except ValueError as e:
        raise SystemExit(f"--sinks entry {text!r}: expected STORE:N, e.g. fp8:1 ({e})") from None


def key_stats(model: Any, windows: Any, policy: Any) -> dict[str, dict[str, float]]:
    """Per KV layer (``policy``'s K centering offsets): ``raw_norm_ratio`` = |k_0| / median |k_t|,
    ``centered_norm_ratio`` the same of ``k - mu``, and ``centered_amax_ratio`` = max |k_0 - mu| /
    max over t >= 1 of |k_t - mu|; medians over heads and windows; ``raw_amax_over_range`` = the
    largest max |k_0| / (2688 x the NVFP4 global scale) over heads and windows (above 1 the
    ``uncentered`` store saturates)."""
    import torch

    from vllm_nvfp4.calibration.kv_hooks import KVObserver, kv_cache_quantization
    from vllm_nvfp4.formats import E2M1_MAX, E4M3_MAX

    rows: dict[int, list[list[float]]] = {}

    class FirstKeys(KVObserver):
        def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
            lp = policy.layers[layer]
            center = lp.k_center
            top = E2M1_MAX * E4M3_MAX * torch.as_tensor(lp.k_global_scale, dtype=torch.float32).reshape(-1)
            mu = torch.zeros(key.shape[1], key.shape[-1]) if center is None else torch.tensor(center)
            k = key.detach().float()[0]  # [kv_heads, T, D]
            c = k - mu[:, None, :]
            for h, (raw, cen) in enumerate(zip(k, c)):
                norms, cnorms = raw.norm(dim=-1), cen.norm(dim=-1)
                rows.setdefault(layer, []).append([
                    float(norms[0] / norms.median()), float(cnorms[0] / cnorms.median()),
                    float(cen[0].abs().max() / cen[1:].abs().max()),
                    float(raw[0].abs().max() / top[h if top.numel() > 1 else 0])])

    obs = FirstKeys(policy.num_layers)
    with torch.no_grad(), kv_cache_quantization(model, observer=obs):
        for w in windows:
            model(w.view(1, -1), use_cache=False)
    names = ("raw_norm_ratio", "centered_norm_ratio", "centered_amax_ratio")
    out = {}
    for layer, v in sorted(rows.items()):
        t = torch.tensor(v)
        out[str(layer)] = {n: round(float(t[:, i].median()), 4) for i, n in enumerate(names)}
        out[str(layer)]["raw_amax_over_range"] = round(float(t[:, 3].max()), 4)
    return out


def centered_scales(model: Any, info: Any, calib: Any) -> tuple[Any, frozenset[int]]:
    """The all-FP8 policy with scales and K centering calibrated on ``calib`` (token ids ``[1,
    T]``), and the layers whose first calibration key fits the NVFP4 range uncentered (where the
    served sink key goes)."""
    from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy
    from vllm_nvfp4.policy import KVPolicy

    observer = observe_amax(model, calib, info.num_layers, kv_layers=info.kv_layers)
    scaled = scaled_policy(KVPolicy.from_compact("*:fp8", info.num_layers,
                                                 layer_types=info.layer_types),
                           observer, False, {}, None, True)
    fitting = frozenset(int(i) for i, v in key_stats(model, calib, scaled).items()
                        if v["raw_amax_over_range"] <= 1)
    return scaled, fitting


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from vllm_nvfp4.calibration.evaluator import Evaluator
    from vllm_nvfp4.calibration.sensitivity import all_format

    ap = study_parser(__doc__, ())
    ap.set_defaults(window=1024)
    ap.add_argument("--sinks", nargs="+", default=list(DEFAULT_SINKS), help="STORE:N entries")
    ap.add_argument("--fp8-slots", nargs="*", default=[], help="slots like 14k 3v kept in FP8 in the mix")
    a = ap.parse_args(argv)
    for s in a.sinks:
        parse_sink(s)  # bad entries fail before the model loads
    w = a.window
    model, info, head, tail = load_slot_study(a)
    calib = torch.tensor(head[:w]).view(1, w)
    scaled, fitting = centered_scales(model, info, calib)
    sinks = [parse_sink(s, fitting, info.kv_layers) for s in a.sinks]
    nv = all_format(scaled, "nvfp4")
    bases = {"all_nvfp4": nv}
    if a.fp8_slots:
        bases["mix"] = with_fp8_slots(nv, a.fp8_slots)
    heldout = torch.tensor(tail[-w * a.heldout_windows:]).view(a.heldout_windows, w)
    stats = key_stats(model, heldout, scaled)
    leads = sum(v["centered_amax_ratio"] >= 1 for v in stats.values())
    print("first key / median key, norm before -> after K centering; its largest centered element /"
          " the other keys' largest; its largest raw element / the NVFP4 range:", flush=True)
    for layer, v in stats.items():
        print(f"  layer {layer:>3}: {v['raw_norm_ratio']:.2f} -> {v['centered_norm_ratio']:.2f}; "
              f"{v['centered_amax_ratio']:.2f}; {v['raw_amax_over_range']:.2f}", flush=True)
    over = sum(v["raw_amax_over_range"] > 1 for v in stats.values())
    print(f"the first key holds the largest centered element in {leads} of {len(stats)} layers; "
          f"uncentered, it exceeds the NVFP4 range in {over}", flush=True)
    ev = Evaluator(model, heldout, reuse_prefix=False)
    ev.reference()
    out: dict[str, Any] = {"all_fp8": ev.measure(all_format(scaled, "fp8")).to_dict()}
    print(row("all_fp8", out["all_fp8"]), flush=True)
    for base_name, policy in bases.items():
        for sink, sink_text in [(None, ""), *zip(sinks, a.sinks)]:
            ev.options = () if sink is None else sink
            name = base_name + (f" + sink {sink_text}" if sink else "")
            m = ev.measure(policy).to_dict()
            m.update(fraction_of_fp8=round(policy.fraction_of_fp8(), 6))
            if "all_nvfp4" in out:
                m.update(recovery(m, out["all_fp8"], out["all_nvfp4"]))
            out[name] = m
            gap = f"  gap recovery {m['top1_gap_recovery']:.0%}" if "top1_gap_recovery" in m else ""
            print(row(name, m) + gap, flush=True)
    summary = {"model": str(a.model), "text": str(a.text), "window": w, "dtype": a.dtype,
               "heldout_windows": a.heldout_windows, "k_center": True, "fp8_slots": a.fp8_slots,
               "uncentered_fit_layers": sorted(fitting), "configs": out, "key_stats": stats}
    (a.out / "sink.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
