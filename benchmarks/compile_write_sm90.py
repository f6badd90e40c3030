"""Compile the KV-cache write kernel for sm_90 WITHOUT a GPU (Triton's bundled ptxas) and report
its registers and SASS instruction counts: in all, local-memory loads / stores (LDL / STL),
warp shuffles (SHFL), global loads (LDG), special-function ops (MUFU), calls; optional SASS dump.
One program writes one token's K and V of one KV head, so the counts are per (token, head).

    python3 benchmarks/compile_write_sm90.py [--formats nvfp4+nvfp4] [--rot-pairs 8] [--sass DIR]

Each format pair is compiled with K centering, without and with the rotating K center
(``USE_ROT``). Use the H200's Triton (3.6), as for ``benchmarks/compile_sm90.py``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import triton
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.compile_sm90 import TARGET, cubin_sass, write_sass  # noqa: E402
from vllm_nvfp4.kernels import cache_write as W  # noqa: E402
from vllm_nvfp4.kernels.constants import format_code  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout  # noqa: E402

#: pointer arguments of the write kernel that are not FP32 (the keys and values: bf16)
POINTER_TYPES = {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*u8",
                 "slot_ptr": "*i64", "first_ptr": "*i1", "pos_ptr": "*i32",
                 "rot_idx_ptr": "*i32", "key0_plain_ptr": "*i32"}
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)")


def write_src(lay: KVPageLayout, rot_pairs: int) -> ASTSource:
    """``_write_kv_kernel`` for ``lay`` with K centering, the rotating center on ``rot_pairs``
    pairs per KV head (0: without), as Triton source for ``triton.compile``."""
    fn = W._write_kv_kernel
    const = dict(K_FMT=format_code(lay.k_format), V_FMT=format_code(lay.v_format),
                 K_DATA=lay.k_data_offset, K_SCALE=lay.k_scale_offset,
                 V_DATA=lay.v_data_offset, V_SCALE=lay.v_scale_offset, H=lay.num_kv_heads,
                 D=lay.head_dim, BLOCK=lay.block_size, CENTER=True, CENTER0=False,
                 USE_ROT=rot_pairs > 0, ROT_PAIRS=max(rot_pairs, 1), USE_PLAIN0=False,
                 F32=False)
    sig = {n: "constexpr" if n in const else POINTER_TYPES.get(n, "*fp32")
           if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    return ASTSource(fn=fn, signature=sig,
                     constexprs={(list(sig).index(k),): v for k, v in const.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="*", default=["nvfp4+nvfp4", "fp8+nvfp4"],
                    help="K+V format pairs (fp8 | nvfp4)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--rot-pairs", type=int, default=8, help="rotated RoPE pairs per KV head")
    ap.add_argument("--sass", help="write SASS (and TTGIR) files into this folder")
    args = ap.parse_args()
    for fmt in args.formats:
        kf, _, vf = fmt.partition("+")
        lay = KVPageLayout(args.kv_heads, args.head_dim, args.block_size, kf, vf or kf)
        for pairs in (0, args.rot_pairs):
            k = triton.compile(write_src(lay, pairs), target=TARGET, options={"num_warps": 1})
            sass, regs = cubin_sass(k.asm["cubin"])
            ops = collections.Counter(_OPCODE.findall(sass))
            count = {o: ops[o] for o in ("LDL", "STL", "SHFL", "LDG", "MUFU", "CALL")}
            print(f"triton {triton.__version__} write {fmt:11} D {args.head_dim} block "
                  f"{args.block_size} k_center{f' + k_rot {pairs} pairs' if pairs else ''}: "
                  f"regs {regs}, {sum(ops.values())} instructions, "
                  + ", ".join(f"{o} {c}" for o, c in count.items()), flush=True)
            if args.sass:
                write_sass(args.sass, f"write_d{args.head_dim}_{fmt}_rot{pairs}", sass,
                           k.asm["ttgir"])


if __name__ == "__main__":
    main()
