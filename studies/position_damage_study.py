#!/usr/bin/env python
"""Where along a long window does a policy's damage sit, and does the sink-key choice depend on
the window length (CPU)?

    python -m studies.position_damage_study MODEL TEXT --policy POLICY.json --out DIR
        [--window 8176] [--windows 3] [--dtype float32] [--edges 1024 2048 4096]

Teacher-forced on the last ``--windows`` windows of ``--window`` tokens of TEXT, in transformers
with the cache fake-quantized as served (:mod:`vllm_nvfp4.calibration.kv_hooks`), against the
unquantized cache: next-token KL and top-1 agreement per position range (``--edges`` split the
window) for

* ``served``: POLICY as vLLM serves it (sink keys uncentered where it flags them);
* ``centered``: POLICY with every sink key centered
  (:func:`~vllm_nvfp4.calibration.sink_choice.without_sink_key`);
* ``all-FP8``: every layer FP8 with POLICY's scales and K centering (the same sink flags);
* ``all-FP8, K scale x4``: ``all-FP8`` with every K scale 4x larger (headroom: does K clip?);
* ``all-FP8, not centered``: ``all-FP8`` without the K centering offsets (same scales);
* ``FP8, scale 1``: every layer FP8 at the default scale, no centering (vLLM's ``fp8`` cache
  without calibrated scales).

The start-up calibration chooses the sink key on 2048 positions
(:mod:`vllm_nvfp4.calibration.sink_choice`); the ranges past 2048 say whether a longer window
would choose otherwise. Writes ``DIR/position_damage.json`` and ``DIR/position_damage.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

#: the characters of TEXT's end that the windows come from (Brown: ~8 tokens per 40 characters)
TAIL_CHARS = 400_000


def configurations(policy: Any) -> dict[str, Any]:
    """The policies compared (module docstring) for the calibrated ``policy``."""
    from vllm_nvfp4.calibration.sensitivity import all_format
    from vllm_nvfp4.calibration.sink_choice import without_sink_key
    from vllm_nvfp4.policy import KVPolicy

    fp8 = all_format(policy, "fp8")
    return {"served": policy, "centered": without_sink_key(policy), "all-FP8": fp8,
            "all-FP8, K scale x4": _edit_layers(fp8, lambda lp: replace(lp, k_scale=_times(lp.k_scale, 4))),
            "all-FP8, not centered": _edit_layers(without_sink_key(fp8), lambda lp: replace(lp, k_center=None)),
            "FP8, scale 1": KVPolicy.from_compact("*:fp8", policy.num_layers, layer_types=policy.layer_types)}


def _edit_layers(policy: Any, edit: Callable[[Any], Any]) -> Any:
    return replace(policy, layers=tuple(edit(lp) for lp in policy.layers))


def _times(scale: Any, factor: float) -> Any:
    """A policy scale (None, a float or one per KV head) times ``factor``."""
    if scale is None:
        return None
    return tuple(s * factor for s in scale) if isinstance(scale, (list, tuple)) else scale * factor


def position_damage(model: Any, windows: Any, policies: dict[str, Any],
                    edges: Sequence[int],
                    options: Optional[dict[str, Sequence[Any]]] = None) -> dict[str, dict[str, Any]]:
    """Per policy: ``kl`` and ``top1`` over all positions of ``windows [n, T]`` and per range
    ``a-b`` of ``edges`` (``kl_by_pos``, ``top1_by_pos``) against the unquantized forward.
    ``options``: per policy name, the study options (:class:`~vllm_nvfp4.calibration.kv_hooks.KVOption`)
    it runs with (default none)."""
    import torch

    from vllm_nvfp4.calibration.kv_hooks import kv_cache_quantization

    t = windows.shape[1]
    cuts = [0, *[e for e in edges if 0 < e < t], t]
    kls: dict[str, list[Any]] = {n: [] for n in policies}
    agree: dict[str, list[Any]] = {n: [] for n in policies}
    with torch.no_grad():
        for i, w in enumerate(windows):
            print(f"window {i + 1} of {len(windows)}: {len(policies)} policies", flush=True)
            ref = model(w[None]).logits[0].float().log_softmax(-1)
            for name, policy in policies.items():
                with kv_cache_quantization(model, policy, options=(options or {}).get(name, ())):
                    lp = model(w[None]).logits[0].float().log_softmax(-1)
                kls[name].append((ref.exp() * (ref - lp)).sum(-1))
                agree[name].append((lp.argmax(-1) == ref.argmax(-1)).float())
    out = {}
    for name in policies:
        kl, top1 = torch.stack(kls[name]), torch.stack(agree[name])
        ranges = list(zip(cuts, cuts[1:]))
        out[name] = {"kl": round(kl.mean().item(), 6), "top1": round(top1.mean().item(), 5),
                     "kl_by_pos": {f"{a}-{b}": round(kl[:, a:b].mean().item(), 6) for a, b in ranges},
                     "top1_by_pos": {f"{a}-{b}": round(top1[:, a:b].mean().item(), 5) for a, b in ranges}}
    return out


def table(result: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per policy, KL and top-1 over all positions and per range."""
    ranges = list(next(iter(result.values()))["kl_by_pos"])
    lines = ["| policy | KL | top-1 | " + " | ".join(f"KL {r}" for r in ranges) + " | "
             + " | ".join(f"top-1 {r}" for r in ranges) + " |",
             "|---|" + "---:|" * (2 + 2 * len(ranges))]
    for name, m in result.items():
        lines.append(f"| {name} | {m['kl']:.4f} | {m['top1']:.4f} | "
                     + " | ".join(f"{m['kl_by_pos'][r]:.4f}" for r in ranges) + " | "
                     + " | ".join(f"{m['top1_by_pos'][r]:.4f}" for r in ranges) + " |")
    return "\n".join(lines) + "\n"


def long_window_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments both long-window studies take: MODEL TEXT --policy --out --window --edges
    --dtype."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("text", type=Path)
    ap.add_argument("--policy", type=Path, required=True, help="policy JSON (calibrated, K centering)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--window", type=int, default=8176)
    ap.add_argument("--edges", type=int, nargs="*", default=[1024, 2048, 4096])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    return ap


def load_long_text(a: argparse.Namespace, out_file: str, tokens: int) -> tuple[Any, Any, list[int]]:
    """``(policy, model, ids)`` for a study's arguments: refuses an existing ``--out/out_file`` and
    a TEXT whose last :data:`TAIL_CHARS` characters hold fewer than ``tokens`` tokens."""
    import torch

    from vllm_nvfp4.calibration.modeling import load_model
    from vllm_nvfp4.policy import KVPolicy

    if (a.out / out_file).exists():
        raise SystemExit(f"{a.out}/{out_file} exists; choose another --out")
    policy = KVPolicy.load(a.policy)
    torch.manual_seed(0)
    model, tok, _ = load_model(a.model, a.dtype, "cpu")
    ids = tok(a.text.read_text(encoding="utf-8")[-TAIL_CHARS:], add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise SystemExit(f"{a.text}: its last {TAIL_CHARS} characters hold {len(ids)} tokens, fewer "
                         f"than the {tokens} the windows need")
    return policy, model, ids


def tail_windows(ids: Sequence[int], window: int, count: int) -> Any:
    """The last ``count`` windows of ``window`` tokens of ``ids``, as a tensor ``[count, window]``."""
    import torch

    return torch.tensor(list(ids[len(ids) - window * count:])).view(count, window)


def write_results(out: Path, stem: str, summary: dict[str, Any], markdown: str) -> None:
    """``out/stem.json`` (``summary``) and ``out/stem.md`` (``markdown``); prints the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown, end="")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = long_window_parser(__doc__)
    ap.add_argument("--windows", type=int, default=3)
    a = ap.parse_args(argv)
    t0 = time.time()
    policy, model, ids = load_long_text(a, "position_damage.json", a.window * a.windows)
    result = position_damage(model, tail_windows(ids, a.window, a.windows), configurations(policy), a.edges)
    write_results(a.out, "position_damage",
                  {"model": str(a.model), "text": str(a.text), "policy": str(a.policy), "window": a.window,
                   "windows": a.windows, "dtype": a.dtype, "seconds": round(time.time() - t0, 1),
                   "configs": result}, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
