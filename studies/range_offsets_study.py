#!/usr/bin/env python
"""How many position-shifted runs does the calibrated K range need to hold long contexts (CPU)?

    python -m studies.range_offsets_study MODEL TEXT --out DIR [--served 8192] [--window 1024]
        [--windows 3] [--counts 0 1 2 4 7] [--range-windows 1 3] [--dtype float32]

K centering offsets from ``--windows`` windows of ``--window`` tokens of the built-in text (the
start-up calibration's), then, for each offset count ``n`` of ``--counts`` and each number of
range windows ``r`` of ``--range-windows``, the first ``r`` of those windows run at the offsets
of :func:`~vllm_nvfp4.calibration.position_range.range_offsets` ``(served, window, n)``, range
statistics only. Per decoder layer, the largest ``|K - mu|`` (over heads and channels, the amax
behind a per-layer K scale; the first key of each window, the sink key, left out) of the last 3 windows of ``served - 16`` tokens of TEXT's end (the
held-out windows of ``position_damage_study``) against the calibrated one: above 1, K clips
there. Writes ``DIR/range_offsets.json`` and ``DIR/range_offsets.md``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from studies.position_damage_study import TAIL_CHARS, tail_windows, write_results

HELD_OUT_WINDOWS = 3


def channel_range(observer: Any, layer: int) -> tuple[Any, Any]:
    """``(max, min)`` per K channel ``[kv_heads, head_dim]`` of ``layer``."""
    return observer.k_channel_max[layer], observer.k_channel_min[layer]


def centered_amax(top: Any, low: Any, mu: Any) -> float:
    """Largest ``|K - mu|`` over heads and channels from the channel max / min."""
    import torch

    return float(torch.maximum(top - mu, mu - low).max())


def study(model: Any, calib: Any, held_out: Any, served: int, counts: Sequence[int],
          range_windows: Sequence[int]) -> dict[str, Any]:
    """Per ``(count, range windows)``: per-layer held-out / calibrated centered K amax."""
    import torch

    from vllm_nvfp4.calibration.kv_hooks import KVObserver, kv_cache_quantization
    from vllm_nvfp4.calibration.modeling import shifted_position_ids
    from vllm_nvfp4.calibration.position_range import range_offsets
    from vllm_nvfp4.calibration.scales import observe_amax

    layers = len(model.model.layers)
    window = calib.shape[1]
    base = observe_amax(model, calib, layers)
    mus = [base.k_channel_mean(i) for i in range(layers)]
    plans = {(n, r): range_offsets(served, window, n) for n in counts for r in range_windows}
    runs: dict[tuple[int, int], KVObserver] = {}  # (window index, offset) -> its observer
    for (n, r), offsets in plans.items():
        for w in range(min(r, calib.shape[0])):
            for o in offsets:
                if (w, o) in runs:
                    continue
                obs = KVObserver(layers)
                with torch.no_grad(), kv_cache_quantization(model, observer=obs), obs.range_only():
                    model(calib[w:w + 1], position_ids=shifted_position_ids(model, window, o),
                          use_cache=False)
                runs[(w, o)] = obs
    held = KVObserver(layers)  # range_only: without the sink key, which the policy holds apart
    with torch.no_grad(), kv_cache_quantization(model, observer=held), held.range_only():
        for row in held_out:
            print(f"held-out window of {held_out.shape[1]} tokens", flush=True)
            model(row[None], use_cache=False)
    seen = [centered_amax(*channel_range(held, i), mus[i]) for i in range(layers)]
    out: dict[str, Any] = {"served": served, "window": window, "windows": int(calib.shape[0]),
                           "held_out": list(held_out.shape), "plans": []}
    for (n, r), offsets in plans.items():
        ratios = []
        for i in range(layers):
            top, low = channel_range(base, i)
            for w in range(min(r, calib.shape[0])):
                for o in offsets:
                    t, b = channel_range(runs[(w, o)], i)
                    top, low = torch.maximum(top, t), torch.minimum(low, b)
            ratios.append(round(seen[i] / centered_amax(top, low, mus[i]), 4))
        out["plans"].append({"offsets": list(offsets), "count": n, "range_windows": r,
                             "forwards": len(offsets) * min(r, calib.shape[0]),
                             "worst": max(ratios), "median": statistics.median(ratios),
                             "ratios": ratios})
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per plan."""
    lines = ["| offsets | range windows | extra forwards | held-out / calibrated K amax: worst layer | median layer |",
             "|---:|---:|---:|---:|---:|"]
    for p in result["plans"]:
        lines.append(f"| {p['count']} | {p['range_windows']} | {p['forwards']} | {p['worst']:.2f} | "
                     f"{p['median']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT
    from vllm_nvfp4.calibration.data import load_windows
    from vllm_nvfp4.calibration.modeling import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("text", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--served", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--counts", type=int, nargs="+", default=[0, 1, 2, 4, 7])
    ap.add_argument("--range-windows", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    a = ap.parse_args(argv)
    if (a.out / "range_offsets.json").exists():
        raise SystemExit(f"{a.out}/range_offsets.json exists; choose another --out")
    torch.manual_seed(0)
    model, tok, _ = load_model(a.model, a.dtype, "cpu")
    calib = load_windows([BUILTIN_TEXT], tok, a.window, count=0, calib=a.windows).calib
    length = a.served - 16
    ids = tok(a.text.read_text(encoding="utf-8")[-TAIL_CHARS:], add_special_tokens=False)["input_ids"]
    held = tail_windows(ids, length, HELD_OUT_WINDOWS)
    result = study(model, calib, held, a.served, a.counts, a.range_windows)
    result.update(model=str(a.model), text=str(a.text), dtype=a.dtype)
    write_results(a.out, "range_offsets", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
