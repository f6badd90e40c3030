"""Python overhead of one ``vllm_nvfp4.ops`` call: the argument checks and the dispatch, not the compute.

The torch path's compute is replaced by a no-op, so what is timed is what every layer of an eager
step pays before its kernel launches, for a decode batch (64 sequences, 32 query / 8 KV heads,
head_dim 128, block 16), alternating an NVFP4 and an FP8 layer: ``LayerOps.attend`` and
``LayerOps.write`` (what the attention impl calls: the layer checked once, the step's metadata by
its first layer) and the one-shot ``ops.paged_attention`` and ``ops.write_kv_cache`` (every
argument checked). Reports CPU time per call (``time.process_time``, so a busy machine inflates it
less than wall time): the minimum and median of 9 repetitions.

    python benchmarks/ops_overhead.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from vllm_nvfp4 import ops, paged_torch
from vllm_nvfp4.layout import KVPageLayout

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 32, 8, 128, 16


def decode_calls() -> dict[str, Callable[[int], object]]:
    """``name -> call(i)``: one op on layer ``i`` (even: NVFP4, odd: FP8) of a decode step."""
    layouts = [KVPageLayout(KV_HEADS, HEAD_DIM, BLOCK, "nvfp4", "nvfp4"),
               KVPageLayout(KV_HEADS, HEAD_DIM, BLOCK, "fp8", "fp8")]
    caches = [torch.zeros(100, lay.page_bytes, dtype=torch.uint8) for lay in layouts]
    query = torch.randn(BATCH, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    key = torch.randn(BATCH, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    block_table = torch.zeros(BATCH, 20, dtype=torch.int32)
    seq_lens = torch.full((BATCH,), 300, dtype=torch.int32)
    query_start_loc = torch.arange(BATCH + 1, dtype=torch.int32)
    slots = torch.arange(BATCH, dtype=torch.int64)
    scale = torch.ones(KV_HEADS)
    layers = [ops.LayerOps(cache, lay, scale, scale, backend="torch") for cache, lay in zip(caches, layouts)]
    return {
        "LayerOps.attend": lambda i: layers[i % 2].attend(
            query, block_table, seq_lens, query_start_loc, 1, 320, 0.1, out),
        "LayerOps.write": lambda i: layers[i % 2].write(key, value, slots),
        "paged_attention": lambda i: ops.paged_attention(
            query, caches[i % 2], layouts[i % 2], scale, scale, block_table, seq_lens,
            query_start_loc, 1, 320, 0.1, out, backend="torch"),
        "write_kv_cache": lambda i: ops.write_kv_cache(
            key, value, caches[i % 2], slots, layouts[i % 2], scale, scale, backend="torch"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000, help="calls per round (default 3000)")
    calls = ap.parse_args().calls
    paged_torch.paged_attention = lambda *args: args[11]  # the compute is not what is timed
    paged_torch.write_kv_cache = lambda *args: None
    for name, call in decode_calls().items():
        rounds = []
        for _ in range(9):
            t0 = time.process_time()
            for i in range(calls):
                call(i)
            rounds.append((time.process_time() - t0) / calls * 1e6)
        print(f"{name}: {min(rounds):.1f} us min, {statistics.median(rounds):.1f} us median "
              "(CPU time per call)")


if __name__ == "__main__":
    main()
