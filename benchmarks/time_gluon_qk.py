"""Time the Gluon FP8-tensor-core K-side prototypes (:mod:`benchmarks.gluon_qk`, running-
max mode: the K side alone) against today's whole NVFP4 decode, on
the H200 (sm_90). Shapes as ``scripts/bench_decode.py`` (32 q / 8 KV heads, head_dim 128, block
16, decode batch x context), CUDA-graph replays (``bench_decode.timer``). JSON to ``--out``,
a table printed last.

    python3 benchmarks/time_gluon_qk.py --out $OUT/gluon_qk.json [--shapes 64x32768 ...]

Rows: ``decode_nvfp4`` (today's kernel, K and V NVFP4, default launch), ``k_side_<mma>`` (the
prototype over the same K bytes, 8 splits), each with the bytes it reads and TB/s on them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
import bench_decode as bd  # noqa: E402
from benchmarks import gluon_qk  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout  # noqa: E402

SPLITS = 8
TILE_N = 64


def time_k_side(name: str, lay: KVPageLayout, b: "bd.Batch", cache: torch.Tensor) -> float:
    """Microseconds of prototype ``name`` over every key of ``b`` (running-max mode)."""
    fn, warps = gluon_qk.PROTOTYPES[name]
    k_scale = torch.full((bd.HKV,), 0.01, device=cache.device)
    out = torch.empty(b.batch, bd.HQ, SPLITS, device=cache.device)
    q = b.query

    def run():
        fn[(b.batch, bd.HKV, SPLITS)](
            q, out, cache, k_scale, b.block_table, b.seq_lens, q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), cache.stride(0), b.block_table.stride(0),
            G=bd.HQ // bd.HKV, D=bd.D, BLOCK=bd.BS, K_DATA=lay.k_data_offset,
            K_SCALE=lay.k_scale_offset, TILE_N=TILE_N, NUM_SPLITS=SPLITS, WRITE_SCORES=False,
            num_warps=warps)
    us = bd.timer(run, False)
    if not bool(torch.isfinite(out).all()):
        raise RuntimeError(f"{name}: non-finite maxima")
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["16x4096", "64x4096", "16x32768", "64x32768"],
                    help="BATCHxCONTEXT decode shapes")
    ap.add_argument("--out", help="write the records as JSON here")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    lay = KVPageLayout(bd.HKV, bd.D, bd.BS, "nvfp4", "nvfp4")
    per_token_head = lay.bytes_per_token // bd.HKV  # K and V, scales included
    recs = []
    for shape in args.shapes:
        batch, ctx = (int(x) for x in shape.split("x"))
        b = bd.Batch(batch, ctx, 1, "cuda", gen)
        cache = bd.our_cache(lay, b, "cuda", gen)
        out = torch.empty_like(b.query)
        rows = [("decode_nvfp4", bd.run_ours(lay, b, cache, out, False),
                 bd.kv_bytes(b, per_token_head))]
        for name in gluon_qk.PROTOTYPES:
            try:
                rows.append((f"k_side_{name}", time_k_side(name, lay, b, cache),
                             bd.kv_bytes(b, per_token_head // 2)))
            except Exception as e:  # noqa: BLE001
                print(f"  {name} at {shape} failed: {e!r}"[:400], flush=True)
        for kernel, us, nbytes in rows:
            recs.append({"kernel": kernel, "batch": batch, "context": ctx, "us": us,
                         "bytes": nbytes, "tb_s": nbytes / us / 1e6})
        del cache, b
        torch.cuda.empty_cache()
    result = {"versions": bd.versions(), "splits": SPLITS, "records": recs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(f"{'kernel':16} {'shape':>10} {'us':>9} {'MB read':>9} {'TB/s':>6}")
    for r in recs:
        print(f"{r['kernel']:16} {r['batch']:>4}x{r['context']:<5} {r['us']:9.1f} "
              f"{r['bytes'] / 1e6:9.1f} {r['tb_s']:6.2f}")


if __name__ == "__main__":
    main()
