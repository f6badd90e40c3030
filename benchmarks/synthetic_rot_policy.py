"""Write a policy JSON with the rotating K center on synthetic values, for timing an engine with
random weights (``benchmarks.e2e --mixed-policy FILE``)::

    python -m benchmarks.synthetic_rot_policy --preset llama8b --pairs 8 --out /tmp/rot8.json

The formats are nvfp4-mixed's of the benchmark (:func:`benchmarks.e2e.configs.mixed_policy`: the
first eighth of the layers FP8) unless ``--compact`` gives others; every layer gets a random
``k_center`` and a ``k_rot`` of ``--pairs`` pairs (:mod:`vllm_nvfp4.testing.rot_policy`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.e2e.configs import mixed_policy
from vllm_nvfp4.policy import KVPolicy
from vllm_nvfp4.testing.rot_policy import synthetic_rot_policy
from vllm_nvfp4.testing.weightless import PRESETS, build_weightless_model


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    ap.add_argument("--pairs", type=int, default=8, help="rotated RoPE pairs per KV head")
    ap.add_argument("--compact", default=None, help="formats as a compact policy (default: the "
                    "benchmark's nvfp4-mixed)")
    ap.add_argument("--without-k-rot", action="store_true", help="the same k_center (0 on the pairs) "
                    "without k_rot: the baseline of a timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="policy JSON to write (must not exist)")
    a = ap.parse_args(argv)
    if Path(a.out).exists():
        ap.error(f"{a.out} exists; name a new file with --out (an existing one is not overwritten)")
    if PRESETS[a.preset]["arch"] != "llama":
        ap.error(f"preset {a.preset} is a hybrid; this writes policies for the dense (llama) presets")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = json.loads((build_weightless_model(Path(tmp), a.preset) / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    rot = None if a.without_k_rot else "random"
    what = "k_center only" if rot is None else f"k_rot, {a.pairs} pairs"
    try:
        formats = KVPolicy.from_compact(a.compact or mixed_policy(n), n)
        pairs = [(row.k.value, row.v.value) for row in formats.layers]
        policy = synthetic_rot_policy(cfg, pairs, pairs=a.pairs, rot=rot, seed=a.seed,
                                      meta={"synthetic": f"{what}, preset {a.preset}"})
    except ValueError as e:  # PolicyError included
        ap.error(f"--compact / --pairs: {e}")
    print(f"wrote {policy.save(a.out)}: {policy.to_compact()}, {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
