"""Compile a Gluon FP8-tensor-core K-side prototype (:mod:`benchmarks.gluon_qk`) for
sm_90 WITHOUT a GPU and count its whole-tile loop like ``compile_sm90.py`` counts today's kernel
(registers, spills, SASS instructions per token-head, the MMA opcodes; optional SASS dump).

    PYTHONPATH=/tmp/t36:. TRITON_CACHE_DIR=/tmp/tc36 python3 benchmarks/compile_gluon_sm90.py \\
        [--mma mma_v2|wgmma] [--write-scores] [--splits 8] [--group 4] [--sass DIR]

(Triton 3.6, the H200's, installed as ``compile_sm90.py``'s docstring says.)
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import triton
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.compile_sm90 import TARGET, cubin_sass, tile_loops, write_sass  # noqa: E402
from benchmarks import gluon_qk  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout  # noqa: E402


def kernel_src(lay: KVPageLayout, tile_n: int, group: int, mma: str, splits: int,
               write_scores: bool) -> GluonASTSource:
    """The prototype ``mma`` (a key of ``gluon_qk.PROTOTYPES``) for layout ``lay`` (NVFP4 K), as
    Gluon source for ``triton.compile``."""
    fn = gluon_qk.PROTOTYPES[mma][0]
    sig = dict(query_ptr="*bf16", out_ptr="*fp32", cache_ptr="*u8", k_scale_ptr="*fp32",
               block_table_ptr="*i32", seq_lens_ptr="*i32")
    for n in ("stride_qt", "stride_qh", "stride_os", "stride_oh", "stride_blk", "stride_bt"):
        sig[n] = "i32"
    const = dict(G=group, D=lay.head_dim, BLOCK=lay.block_size,
                 K_DATA=lay.k_data_offset, K_SCALE=lay.k_scale_offset, TILE_N=tile_n,
                 NUM_SPLITS=splits, WRITE_SCORES=write_scores)
    sig.update({k: "constexpr" for k in const})
    sig = {n: sig[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if n.endswith("_ptr") or n in ("stride_qt", "stride_blk", "stride_os")}
    return GluonASTSource(fn=fn, signature=sig,
                          constexprs={(list(sig).index(k),): v for k, v in const.items()},
                          attrs=attrs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tile", type=int, default=64, help="keys per tile (TILE_N)")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head (<= 8)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--splits", type=int, default=8, help="NUM_SPLITS (key ranges per program)")
    ap.add_argument("--write-scores", action="store_true",
                    help="write every score (the test's mode) instead of a running max")
    ap.add_argument("--mma", choices=list(gluon_qk.PROTOTYPES), default="mma_v2",
                    help="mma_v2: mma.sync m16n8k32 e4m3, 1 warp; wgmma: m64n32k32, 4 warps")
    ap.add_argument("--sass", help="write the SASS and TTGIR into this folder")
    args = ap.parse_args()
    lay = KVPageLayout(8, args.head_dim, 16, "nvfp4", "nvfp4")
    warps = gluon_qk.PROTOTYPES[args.mma][1]
    k = triton.compile(kernel_src(lay, args.tile, args.group, args.mma, args.splits,
                                  args.write_scores), target=TARGET,
                       options=dict(num_warps=warps, num_stages=1))
    sass, regs = cubin_sass(k.asm["cubin"])
    loops = tile_loops(sass)
    if not loops:
        raise SystemExit("no tile loop found in the SASS")
    body = loops[0]
    total = sum(body.values())
    stores = sum(c for o, c in body.items() if o.startswith("STG"))
    mma = {o: c for o, c in body.items() if "MMA" in o}
    spills = sum(c for o, c in body.items() if o.startswith(("STL", "LDL")))
    per = warps / args.tile  # token-heads per warp-instruction of the loop
    print(f"triton {triton.__version__} gluon K-side prototype {args.mma} D {args.head_dim} "
          f"tile {args.tile} warps {warps} group {args.group} splits {args.splits}"
          f"{' write-scores' if args.write_scores else ''}: regs {regs} spill {spills} "
          f"loop {total} instr/warp ({total * per:.2f} per token-head"
          f"{f'; without the {stores} score stores {(total - stores) * per:.2f}' if stores else ''}"
          f") MMA {mma}")
    print("  " + ", ".join(f"{o}:{c}" for o, c in body.most_common(20)))
    print("  ptx mma:", sorted(set(re.findall(r"(?:mma\.sync|wgmma\.mma_async)\.[\w.]+",
                                               k.asm["ptx"]))))
    if args.sass:
        write_sass(args.sass, f"gluon_qk_{args.mma}_d{args.head_dim}_t{args.tile}_g{args.group}",
                   sass, k.asm["ttgir"])


if __name__ == "__main__":
    main()
