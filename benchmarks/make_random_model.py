#!/usr/bin/env python3
"""Write a weight-less model directory for speed benchmarks: ``config.json`` + a tokenizer.

vLLM runs it with ``load_format="dummy"`` (random weights initialised on the GPU, no checkpoint
read), so a Llama-3.1-8B-shaped model costs a few kilobytes on disk instead of 16 GB of bf16
weights. Speed does not depend on the values of the weights; the outputs are meaningless.

The builder is :func:`vllm_nvfp4.testing.weightless.build_weightless_model`. The tokenizer is a
byte-level BPE with no merges (one token per byte) padded with placeholder
tokens up to the model's vocabulary, so that EVERY id the random model can sample decodes
(``vllm serve`` detokenizes its outputs). Building it needs only the ``tokenizers`` package and
takes about a second; nothing is downloaded.

Presets (``--preset``):

* ``llama8b``: Llama-3.1-8B geometry: 32 layers, hidden 4096, 32 query / 8 KV heads, head_dim 128,
  intermediate 14336, vocab 128256, llama3 RoPE scaling, 131072 positions, bf16.
* ``small``:   8 layers, hidden 1024, 8 / 2 heads, head_dim 128, intermediate 2816, vocab 32000
  (quick GPU runs: same head geometry per KV head, a fraction of the weights).
* ``tiny``:    2 layers, hidden 128, 4 / 2 heads, head_dim 32, vocab 512 (CPU tests).

usage: python3 benchmarks/make_random_model.py OUT_DIR [--preset llama8b] [--max-pos N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from vllm_nvfp4.testing.weightless import PRESETS, build_weightless_model, weight_bytes  # noqa: E402


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output directory (created; reused when it matches)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama8b")
    ap.add_argument("--max-pos", type=int, default=None, help="max_position_embeddings override")
    a = ap.parse_args(argv)
    t0 = time.time()
    path = build_weightless_model(a.out, a.preset, a.max_pos)
    print(f"model {a.preset} ({weight_bytes(a.preset) / 1e9:.2f} GB of bf16 weights when loaded "
          f"with load_format=dummy) -> {path} ({time.time() - t0:.1f}s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
