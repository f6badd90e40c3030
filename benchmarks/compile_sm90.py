"""Compile the attention kernels for sm_90 WITHOUT a GPU (Triton's bundled ptxas) and report
registers, spills, shared memory and instruction counts of the decode (or prefill) whole-tile
loop (and of the masked tail loop);
optional SASS dump.

    python3 benchmarks/compile_sm90.py [--sass DIR] [--configs FMT:TILE[:KIND[:WARPS[:PARTS]]]]
                                       [--module OLD_attention.py]   # old modules: give --configs

Use the H200's Triton (3.6) - its layouts differ from newer ones (see benchmarks/README.md):
    pip download --no-deps triton==3.6.0 -d /tmp/w && python3 -m zipfile -e /tmp/w/triton-*.whl /tmp/t36
    chmod +x /tmp/t36/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/t36 TRITON_CACHE_DIR=/tmp/tc36 python3 benchmarks/compile_sm90.py ...
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from vllm_nvfp4.kernels import attention as A  # noqa: E402
from vllm_nvfp4.kernels.constants import format_code  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
#: LaunchShape code-variant fields -> the kernels' constexprs
CODE_VARIANTS = {"hoist_query": "HOIST_Q", "fold_k_scales": "FOLD_K", "fold_v_scales": "FOLD_V",
                 "lazy_rescale": "LAZY"}


def default_variants(lay: KVPageLayout, kind: str) -> tuple:
    """The code variants ``launch_defaults`` switches on for ``lay`` (none in an older module)."""
    shape = A.launch_defaults(lay, kind == "decode")
    return tuple(v for v in CODE_VARIANTS if getattr(shape, v, False))


def default_stages(lay: KVPageLayout, kind: str) -> int:
    """The tile loop's stages ``paged_attention`` takes for ``lay`` in a decode split of 4096 keys
    (64 x 32k at 8 splits, the shape the instruction analysis describes); 3 in prefill and in a
    ``--module`` without a stage choice."""
    if kind != "decode" or not hasattr(A, "decode_stages"):
        return 3
    return A.decode_stages(A.launch_defaults(lay, True), 4096)


def kernel_src(lay: KVPageLayout, tile_n: int, splits: int, g: int = 4, kind: str = "decode",
               sinks: bool = False, rows: int = 16, variants: tuple = (), parts: int = 1,
               stages: int = 3, rot_rows: int = 0, rot_pairs: int = 0, key0: str = ""):
    """The decode or the prefill kernel (``kind``; prefill: ``rows`` query rows per program; with
    attention ``sinks`` or without) as Triton source for ``triton.compile``. A ``--module`` of a commit that still had the rows family:
    its keys kernels. ``variants``: names of LaunchShape code variants switched on
    (``hoist_query``, ``fold_k_scales``); ``parts``: the head-dim parts (``dim_parts``);
    ``stages``: the tile loop's pipeline stages (``STAGES``, where the module has it);
    ``rot_rows``: with the rotating-center logit correction (``USE_ROT``), tables of that many
    rows (``ROT_ROWS``); 0: without; ``rot_pairs``: on that many RoPE pairs per KV head
    (``ROT_PAIRS``; 0: all, ``head_dim / 2``); ``key0``: with the uncentered sink key's logit
    correction (``USE_KEY0``) as ``peel`` (position 0's tile alone), ``loop`` (``KEY0_IN_LOOP``)
    or ``after`` (``KEY0_AFTER``); empty: without."""
    prefill = kind == "prefill"
    sig = {n: "*bf16" for n in ("query_ptr", "out_ptr")}
    sig.update(cache_ptr="*u8", k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    for name in ("sinks_ptr", "key0_shift_ptr", "rot_b_ptr", "rot_theta_ptr"):
        if name in fn_of(kind).arg_names:
            sig[name] = "*fp32"
    if "rot_idx_ptr" in fn_of(kind).arg_names:
        sig["rot_idx_ptr"] = "*i32"
    sig.update(block_table_ptr="*i32",
               seq_lens_ptr="*i32", qsl_ptr="*i32")
    if prefill:
        sig.update(num_seqs="i32")
    else:  # unsplit, paged_attention passes ``out`` for the unused partials
        part = "*fp32" if splits > 1 else "*bf16"
        sig.update(part_o_ptr=part, part_ml_ptr=part)
    for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_blk", "stride_bt"):
        sig[n] = "i32"
    sig.update(softmax_scale="fp32", softcap="fp32", window="i32")
    const = dict(
        K_FMT=format_code(lay.k_format), V_FMT=format_code(lay.v_format),
        K_DATA=lay.k_data_offset, K_SCALE=lay.k_scale_offset, V_DATA=lay.v_data_offset,
        V_SCALE=lay.v_scale_offset)
    if prefill:
        const.update(G=g, G_PAD=g, BLOCK_Q=rows // g)
    else:
        const.update(HQ=g * lay.num_kv_heads, G=g, BG=max(8, g))
    const.update(D=lay.head_dim, BLOCK=lay.block_size, TILE_N=tile_n)
    if not prefill:
        const.update(NUM_SPLITS=splits)
    const.update(USE_WINDOW=False, USE_SOFTCAP=False, F32=False)
    fn = fn_of(kind)
    if "USE_SINKS" in fn.arg_names:
        const.update(USE_SINKS=sinks)
    for name, flag in CODE_VARIANTS.items():
        if flag in fn.arg_names:
            const[flag] = name in variants
        elif name in variants:
            raise SystemExit(f"this attention module has no {name} variant")
    if "PARTS" in fn.arg_names:
        const.update(PARTS=parts)
    elif parts > 1:
        raise SystemExit("this attention module has no head-dim parts")
    if "STAGES" in fn.arg_names:
        const.update(STAGES=stages)
    for flag, value in (("USE_KEY0", bool(key0)), ("KEY0_IN_LOOP", key0 == "loop"),
                        ("KEY0_AFTER", key0 == "after"),
                        ("USE_ROT", rot_rows > 0), ("ROT_ROWS", rot_rows or 16),
                        ("ROT_PAIRS", rot_pairs or lay.head_dim // 2)):
        if flag in fn.arg_names:
            const[flag] = value
        elif (flag in ("USE_ROT", "USE_KEY0", "KEY0_IN_LOOP", "KEY0_AFTER") and value) or (
                flag == "ROT_PAIRS" and rot_pairs and rot_rows):
            raise SystemExit(f"this attention module has no {flag}")
    if "PREFETCH" in fn.arg_names:  # an older module (--module) with register prefetch: its own default
        const.update(PREFETCH="nvfp4" in (lay.k_format, lay.v_format))
    for k, v in const.items():
        sig[k] = "constexpr"
    sig = {n: sig[n] for n in fn.arg_names}  # the kernel's argument order (indices below)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if n.endswith("_ptr") or n in ("stride_qt", "stride_blk")}
    return ASTSource(fn=fn, signature=sig, constexprs={(list(sig).index(k),): v
                                                                     for k, v in const.items()},
                     attrs=attrs)


def fn_of(kind: str):
    """The kernel of ``kind`` (``--module`` of a commit that still had the rows family: its keys
    kernels)."""
    if kind == "prefill":
        return getattr(A, "_prefill_keys_kernel", A._prefill_kernel)
    return getattr(A, "_decode_keys_kernel", A._decode_kernel)


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)[^;]*;")


def tile_loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of the tile loops (backward-branch loops of over 100 instructions) in
    program order: the whole-tile loop first, then the masked tail loop (one loop in modules
    without the unmasked whole-tile path)."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(0)) for m in _INSTR.finditer(sass)]
    loops = []
    for addr, op, text in ins:
        target = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            body = collections.Counter(op for a, op, _ in ins if lo <= a <= addr)
            if sum(body.values()) > 100:
                loops.append((lo, body))
    return [body for _, body in sorted(loops, key=lambda lb: lb[0])]


def cubin_sass(cubin: bytes) -> tuple[str, str]:
    """``(SASS, registers per thread)`` of a compiled kernel, by Triton's bundled cuobjdump."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True,
                         text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    return sass, regs.group(1) if regs else "?"


def write_sass(folder: str, name: str, sass: str, ttgir: str) -> None:
    """Write ``name.sass`` and ``name.ttgir`` into ``folder`` (created)."""
    os.makedirs(folder, exist_ok=True)
    for ext, text in (("sass", sass), ("ttgir", ttgir)):
        with open(os.path.join(folder, f"{name}.{ext}"), "w") as out:
            out.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", help="write SASS (and TTGIR) files into this folder")
    ap.add_argument("--module", help="compile this attention.py instead (e.g. an old commit's)")
    ap.add_argument("--stages", type=int,
                    help="pipeline stages of the tile loop (default: the launch default's for a "
                         "split of 4096 keys, 3 in prefill and in modules without stage choice)")
    ap.add_argument("--maxnreg", type=int,
                    help="register cap per thread (default: the launch default's, if any)")
    ap.add_argument("--splits", type=int, default=1, help="NUM_SPLITS (> 1: partial outputs)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16,
                    help="tokens per KV-cache block (vLLM 0.34's default is 64)")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head (a power of 2)")
    ap.add_argument("--rows", type=int, default=16, help="prefill query rows per program")
    ap.add_argument("--sinks", action="store_true", help="with attention sinks (USE_SINKS)")
    ap.add_argument("--rot-center", action="store_true",
                    help="with the rotating-center logit correction (USE_ROT)")
    ap.add_argument("--rot-rows", type=int,
                    help="rows of its cos / sin tables (default: launch.rot_rows's)")
    ap.add_argument("--rot-pairs", type=int, default=0,
                    help="with --rot-center: RoPE pairs corrected per KV head (default: all)")
    ap.add_argument("--key0", choices=["peel", "loop", "after"],
                    help="with the uncentered sink key's logit correction, done this way")
    ap.add_argument("--variant", nargs="*", choices=["none", *CODE_VARIANTS],
                    help="LaunchShape code variants to switch on, the others off (none: all off; "
                         "default: those of launch_defaults for each format pair)")
    ap.add_argument("--configs", nargs="*",
                    help="FMT:TILE[:KIND[:WARPS[:PARTS]]] (FMT fp8|nvfp4|K+V; kind decode|prefill, "
                         "default decode; warps default 1; parts: head-dim parts over the "
                         "warps, default 1; default configs: the decode "
                         "defaults of each format pair)")
    args = ap.parse_args()
    global A
    if args.module:
        spec = importlib.util.spec_from_file_location("attention_module", args.module)
        A = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = A  # dataclasses look their module up
        spec.loader.exec_module(A)
    configs = [(f"{kf}+{vf}", shape.tile_n, "decode", shape.num_warps,
                getattr(shape, "dim_parts", 1), args.maxnreg or getattr(shape, "maxnreg", None))
               for kf, vf in (("fp8", "fp8"), ("nvfp4", "nvfp4"), ("fp8", "nvfp4"), ("nvfp4", "fp8"))
               for shape in [A.launch_defaults(KVPageLayout(8, args.head_dim, args.block_size, kf, vf), True)]]
    if args.configs:
        configs = []
        for c in args.configs:
            parts = c.split(":")
            configs.append((parts[0], int(parts[1]), parts[2] if len(parts) > 2 else "decode",
                            int(parts[3]) if len(parts) > 3 else 1,
                            int(parts[4]) if len(parts) > 4 else 1, args.maxnreg))
    for fmt, tile, kind, warps, dim_parts, maxnreg in configs:
        kf, _, vf = fmt.partition("+")  # "fp8" or K+V, e.g. "fp8+nvfp4"
        lay = KVPageLayout(8, args.head_dim, args.block_size, kf, vf or kf)
        stages = args.stages or default_stages(lay, kind)
        variants = (default_variants(lay, kind) if args.variant is None
                    else tuple(v for v in args.variant if v != "none"))
        rot = (A.rot_rows(A.LaunchShape(tile, warps, rot_rows=args.rot_rows), tile,
                          args.rot_pairs or None) if args.rot_center else 0)
        k = triton.compile(kernel_src(lay, tile, args.splits, args.group, kind, args.sinks,
                                      args.rows, variants, dim_parts, stages, rot,
                                      args.rot_pairs if rot else 0, args.key0 or ""),
                           target=TARGET,
                           options=dict(num_warps=warps, num_stages=stages,
                                        **({"maxnreg": maxnreg} if maxnreg else {})))
        sass, regs = cubin_sass(k.asm["cubin"])
        loops = tile_loops(sass) or [collections.Counter()]
        body = loops[0]
        tail = (f", masked tail loop {sum(loops[1].values()) * warps / tile:.1f}"
                if len(loops) > 1 else "")
        top = ", ".join(f"{o}:{c}" for o, c in body.most_common(12))
        smem_ops = sum(c for o, c in body.items() if o.startswith(("STS", "LDS", "LDSM", "BAR")))
        spills = sum(c for o, c in body.items() if o.startswith(("STL", "LDL")))
        print(f"triton {triton.__version__} D {args.head_dim} {fmt:11} {kind:7} tile {tile:3} "
              f"group {args.group}{' sinks' if args.sinks else ''}"
              f"{f' rot_center {rot} rows' if rot else ''}"
              f"{f' {args.rot_pairs or args.head_dim // 2} pairs' if rot else ''}"
              f"{f' key0 {args.key0}' if args.key0 else ''} "
              f"warps {warps}{f' parts {dim_parts}' if dim_parts > 1 else ''} "
              f"stages {stages}{''.join(' ' + v for v in variants)}: "
              f"regs {regs} smem {k.metadata.shared} "
              f"loop {sum(body.values())} instr/warp "
              f"({sum(body.values()) * warps / tile:.1f} per token-head{tail}; STS/LDS/LDSM/BAR "
              f"{smem_ops}, spill {spills})  {top}")
        if args.sass:
            write_sass(args.sass, f"{kind}_d{args.head_dim}_{fmt}_t{tile}_w{warps}_p{dim_parts}"
                                  f"_s{args.splits}",
                       sass, k.asm["ttgir"])


if __name__ == "__main__":
    main()
