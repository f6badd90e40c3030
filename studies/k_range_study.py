#!/usr/bin/env python
"""Does a policy's calibrated K range hold the keys of longer contexts (CPU)?

    python -m studies.k_range_study MODEL TEXT --policy POLICY.json --out DIR
        [--window 8176] [--edges 1024 2048 4096] [--dtype float32]

Per decoder layer: the amax of the stored (centered, smoothed) K that the policy's K scale was
calibrated for (``k_scale x 448``, the largest over KV heads) against the largest ``|K - mu| /
lam`` that transformers produces for the prefixes ``[0, e)`` of one ``--window``-token window of
TEXT's end, ``e`` in ``--edges`` and the window. Above 1, FP8 K clips there (and NVFP4's block
scales saturate). Writes ``DIR/k_range.json`` and ``DIR/k_range.md``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from studies.position_damage_study import load_long_text, long_window_parser, write_results


def k_range(model: Any, ids: Sequence[int], policy: Any, lengths: Sequence[int]) -> list[dict[str, Any]]:
    """Per KV layer: ``calibrated`` (largest K amax behind the policy's K scales) and
    ``observed`` (per prefix length, the largest ``|K - mu| / lam`` over heads and channels)."""
    import torch

    from vllm_nvfp4.calibration.kv_hooks import KVObserver, kv_cache_quantization
    from vllm_nvfp4.formats import E4M3_MAX

    observers = []
    for n in lengths:
        print(f"prefix of {n} tokens", flush=True)
        obs = KVObserver(policy.num_layers)
        with torch.no_grad(), kv_cache_quantization(model, observer=obs):
            model(torch.tensor([list(ids[:n])]), use_cache=False)
        observers.append(obs)
    rows = []
    for i, lp in policy.kv_layers():
        if lp.k_scale is None:
            continue
        mu = (torch.zeros(1) if lp.k_center is None else torch.tensor(lp.k_center, dtype=torch.float32))
        lam = (torch.ones(1) if lp.k_smooth is None else torch.tensor(lp.k_smooth, dtype=torch.float32))
        scale = max(lp.k_scale) if isinstance(lp.k_scale, (list, tuple)) else lp.k_scale
        seen = {}
        for n, obs in zip(lengths, observers):
            top, low = obs.k_channel_max[i], obs.k_channel_min[i]
            seen[str(n)] = round(float((torch.maximum(top - mu, mu - low) / lam).max()), 4)
        rows.append({"layer": i, "calibrated": round(scale * E4M3_MAX, 4), "observed": seen})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per layer the calibrated amax and each prefix's amax as a multiple of it."""
    lengths = list(rows[0]["observed"])
    lines = ["| layer | calibrated K amax | " + " | ".join(f"[0, {n}) / calibrated" for n in lengths) + " |",
             "|---:|---:|" + "---:|" * len(lengths)]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['calibrated']:.2f} | "
                     + " | ".join(f"{r['observed'][n] / r['calibrated']:.2f}" for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = long_window_parser(__doc__).parse_args(argv)
    policy, model, ids = load_long_text(a, "k_range.json", a.window)
    lengths = sorted({*[e for e in a.edges if 0 < e < a.window], a.window})
    rows = k_range(model, ids[-a.window:], policy, lengths)
    write_results(a.out, "k_range", {"model": str(a.model), "policy": str(a.policy), "window": a.window,
                                     "layers": rows}, table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
