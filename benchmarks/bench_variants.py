"""Decode kernel variants, ours only: the kernel module BEFORE a change vs the current one.

Times our decode and prefill for every K/V format pair at Llama-3.1-8B's attention shape (32 q
heads, 8 KV heads, head_dim 128, block 16; decode batch 16/64 x context 4k/32k, prefill 8 x 4k;
other heads with ``--q-heads/--kv-heads/--head-dim``) with ``bench_decode.timer`` (CUDA-graph
replays, do_bench median, L2 flushed): the BEFORE module's default, the current default and the
current module's launch variants (tile, warps, splits - any count, e.g. ``s6`` -, maxnreg, e.g.
``r184``, the tile loop's pipeline stages, e.g. ``st5``, prefill rows), each output checked
against BEFORE's default (relative L2 difference).
Writes JSON and prints a table last.

    git show <commit>:vllm_nvfp4/kernels/attention.py > /tmp/attention_before.py
    python3 benchmarks/bench_variants.py --before /tmp/attention_before.py --out $OUT/v.json
    python3 benchmarks/bench_variants.py --before /tmp/attention_before.py --head-dim 256 \
        --shapes 16x32768 64x8192 --variants no_fold_k s32 --out $OUT/v256.json

``--key0-shift`` adds the rows ``key0``, ``key0_loop`` and ``key0_after``: the current default
with the sink key's logit correction on (a random ``key0_shift [kv_heads, head_dim]``, as a layer
whose policy stores the sink key uncentered passes it), position 0's tile run alone, corrected in
the pipelined loop (``LaunchShape.key0_in_loop``) or after it (``LaunchShape.key0_after_loop``);
their output differs from BEFORE's by the correction.

``--rot-center`` adds the row ``rot``: the current default with the rotating-center correction on
(K stored as ``k - R(p) b``: a random ``b [kv_heads, head_dim]`` and Llama-3.1's RoPE angles), and
``rot_qN`` for each ``--rot-rows N`` (the correction's cos / sin tables of N rows,
``LaunchShape.rot_rows``); the table ends with their time over ``new`` (the same kernel without
it). Their output differs from BEFORE's by the correction. ``--rot-pairs K ..`` adds ``rot_kK``:
the correction on each KV head's ``K`` pairs of largest ``|b_pair|`` only (``RotCenter.top_pairs``;
``K`` >= head_dim / 2 is ``rot``). ``--rot-variants V ..`` adds ``rot_kK_V``: ``rot_kK`` under each
launch variant ``V`` (e.g. ``r232``: the register cap the correction's extra state may want).

    python3 benchmarks/bench_variants.py --before /tmp/attention_before.py --variants \
        --shapes 64x32768 16x32768 64x4096 16x4096 --formats nvfp4 fp8 --rot-center \
        --rot-pairs 8 16 --out $OUT/rot.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
import traceback

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from benchmarks import bench_decode as bd  # noqa: E402
from vllm_nvfp4.kernels import attention as new_mod  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout  # noqa: E402

#: name -> LaunchShape fields replacing the defaults, per launch kind; each runs for every format pair
VARIANTS = {
    "decode": {
        "t32": dict(tile_n=32),
        "t64_w1": dict(tile_n=64, num_warps=1),
        "t64_w2": dict(tile_n=64, num_warps=2),
        "t32_w2": dict(tile_n=32, num_warps=2),
        "t128_w2": dict(tile_n=128, num_warps=2),
        # code variants of the attention core, on or off whatever the default
        "hoist": dict(hoist_query=True),
        "no_hoist": dict(hoist_query=False),
        "fold_k": dict(fold_k_scales=True),
        "no_fold_k": dict(fold_k_scales=False),
        "lazy": dict(lazy_rescale=True),
        # NVFP4 V block scales folded into the V planes: at head_dim 128 (sm_90 compile, Triton
        # 3.6) 21.0 -> 22.9 instructions per token-head and 165 -> 182 registers, but 104 -> 64
        # shared-memory ops per tile (P is no longer scaled per chunk through shared memory)
        "fold_v": dict(fold_v_scales=True),
        # head_dim 512, NVFP4: the head dim cut into parts over the warps (dim_parts), K and V
        # block scales folded; lazy: rescale on a new running max only; rN: register cap N
        # (255: uncapped, the kernel takes 216), else decode_register_cap's; sN: N splits
        "p2_t16_w2_fold": dict(tile_n=16, num_warps=2, dim_parts=2, fold_k_scales=True,
                               fold_v_scales=True, lazy_rescale=False, maxnreg=255),
        "p2_t16_w2_fold_lazy_s16": dict(tile_n=16, num_warps=2, dim_parts=2, fold_k_scales=True,
                                        fold_v_scales=True, lazy_rescale=True, maxnreg=255,
                                        num_splits=16),
        "p4_t32_w4_fold_lazy": dict(tile_n=32, num_warps=4, dim_parts=4, fold_k_scales=True,
                                    fold_v_scales=True, lazy_rescale=True, maxnreg=255),
        "p4_t16_w4_fold_lazy": dict(tile_n=16, num_warps=4, dim_parts=4, fold_k_scales=True,
                                    fold_v_scales=True, lazy_rescale=True, maxnreg=255),
        "p2_r255": dict(tile_n=16, num_warps=2, dim_parts=2, fold_k_scales=True,
                        fold_v_scales=True, lazy_rescale=True, maxnreg=255),
        "p2_r168": dict(tile_n=16, num_warps=2, dim_parts=2, fold_k_scales=True,
                        fold_v_scales=True, lazy_rescale=True, maxnreg=168),
        "p2_r128": dict(tile_n=16, num_warps=2, dim_parts=2, fold_k_scales=True,
                        fold_v_scales=True, lazy_rescale=True, maxnreg=128),
        "p2_r128_s16": dict(tile_n=16, num_warps=2, dim_parts=2, fold_k_scales=True,
                            fold_v_scales=True, lazy_rescale=True, maxnreg=128, num_splits=16),
    },
    "prefill": {
        "fold_k": dict(fold_k_scales=True),
        "w1_q16": dict(num_warps=1, query_rows=16),
        "w2": dict(num_warps=2),
        "w4_q32": dict(num_warps=4, query_rows=32),
        "t32_w2": dict(tile_n=32, num_warps=2),
    },
}
#: launch numbers any variant name may carry instead: sN splits, rN register cap, stN pipeline
#: stages of the tile loop, e.g. ``s6_r184``, ``st5``
NUMERIC_FIELDS = {"s": "num_splits", "r": "maxnreg", "st": "num_stages"}


def variant_config(name: str, kind: str) -> dict | None:
    """LaunchShape fields of variant ``name`` for launch ``kind`` ('decode' / 'prefill'): a
    VARIANTS entry, or ``_``-joined :data:`NUMERIC_FIELDS` tokens (decode only); None where it
    does not apply."""
    if name in VARIANTS[kind]:
        return VARIANTS[kind][name]
    tokens = [re.fullmatch(r"([a-z]+)(\d+)", t) for t in name.split("_")]
    if kind != "decode" or not all(t and t.group(1) in NUMERIC_FIELDS for t in tokens):
        return None
    return {NUMERIC_FIELDS[t.group(1)]: int(t.group(2)) for t in tokens}


FORMATS = {"fp8": ("fp8", "fp8"), "nvfp4": ("nvfp4", "nvfp4"), "k_fp8_v_nvfp4": ("fp8", "nvfp4"),
           "k_nvfp4_v_fp8": ("nvfp4", "fp8")}


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("attention_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def llama3_theta(head_dim: int) -> torch.Tensor:
    """Llama-3.1's RoPE angles per position (base 500000, the "llama3" scaling: factor 8,
    low / high frequency factors 1 / 4, 8192 original positions), FP32 ``[head_dim / 2]``."""
    inv = 500000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * torch.pi / inv
    smooth = ((8192 / wavelen - 1) / (4 - 1)).clamp(0, 1)
    scaled = (1 - smooth) * inv / 8 + smooth * inv
    return torch.where(wavelen > 8192, inv / 8, torch.where(wavelen < 2048, inv, scaled)).float()


def timed(mod, lay, b, cache, out, smoke=False, key0_shift=None, rot_center=None, **cfg) -> float:
    """Time ``mod.paged_attention``; ``cfg`` replaces fields of the current module's default
    launch shape (empty: the module's own default, so a BEFORE module of any API works);
    ``key0_shift``: the sink key's correction, ``rot_center``: ``(b, theta)`` of the rotating
    center (current module only)."""
    ks = torch.full((bd.HKV,), 0.01, device=cache.device)
    vs = torch.full((bd.HKV,), 0.02, device=cache.device)
    launch = {}
    if cfg:
        shape = dataclasses.replace(mod.launch_defaults(lay, b.q_len == 1), **cfg)
        launch = {"launch": shape}

    if bd.SINKS is not None:
        launch["sinks"] = bd.SINKS
    if key0_shift is not None:
        launch["key0_shift"] = key0_shift
    if rot_center is not None:
        launch["rot_center"] = rot_center

    def fn():
        mod.paged_attention(b.query, cache, lay, ks, vs, b.block_table, b.seq_lens, b.qsl,
                            b.q_len, b.ctx, bd.SOFTMAX_SCALE, out, **launch)
    return bd.timer(fn, smoke)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="attention.py of the baseline commit")
    ap.add_argument("--before-label", default="before")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+",
                    default=["64x32768", "16x32768", "64x4096", "16x4096", "8x4096xP"],
                    help="BATCHxCONTEXT decode shapes; BATCHxLENxP = prefill of LEN-token prompts")
    ap.add_argument("--variants", nargs="*",
                    default=sorted({v for kind in VARIANTS.values() for v in kind}),
                    help="names from VARIANTS, or sN / rN / stN / sN_rN (N splits, register cap N, "
                         "N pipeline stages); each "
                         "runs where its launch kind has it")
    ap.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=list(FORMATS),
                    help="K/V format pairs to time (default: all)")
    ap.add_argument("--q-heads", type=int, default=bd.HQ)
    ap.add_argument("--kv-heads", type=int, default=bd.HKV)
    ap.add_argument("--head-dim", type=int, default=bd.D)
    ap.add_argument("--sinks", action="store_true", help="attention sinks in every kernel")
    ap.add_argument("--key0-shift", action="store_true",
                    help="also time the current default with the sink key's logit correction")
    ap.add_argument("--rot-center", action="store_true",
                    help="also time the current default with the rotating-center correction")
    ap.add_argument("--rot-rows", type=int, nargs="*", default=[],
                    help="with --rot-center: also with tables of these row counts (rot_qN)")
    ap.add_argument("--rot-pairs", type=int, nargs="*", default=[],
                    help="with --rot-center: also on only these many pairs per KV head (rot_kK)")
    ap.add_argument("--rot-variants", nargs="*", default=[],
                    help="launch variants (names as --variants) each --rot-pairs row also runs under")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape, no timing")
    args = ap.parse_args()
    unknown = [v for v in args.variants + args.rot_variants
               if all(variant_config(v, k) is None for k in VARIANTS)]
    if unknown:
        ap.error(f"unknown variants {unknown}: use names from VARIANTS or sN / rN / stN / sN_rN")
    if args.rot_variants and not (args.rot_center and any(k < args.head_dim // 2 for k in args.rot_pairs)):
        ap.error("--rot-variants runs the --rot-pairs rows under other launches: give --rot-center "
                 f"and --rot-pairs K (K < head_dim / 2 = {args.head_dim // 2})")
    dev = "cpu" if args.smoke else "cuda"
    bd.set_shape(args.q_heads, args.kv_heads, args.head_dim, args.sinks, dev)
    if args.smoke:
        args.shapes = ["2x64", "2x32xP"]
    old_mod = load_module(args.before)
    gen = torch.Generator().manual_seed(0)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": bd.versions(),
           "before": args.before_label,
           "heads": {"q": bd.HQ, "kv": bd.HKV, "head_dim": bd.D, "block": bd.BS,
                     "sinks": bd.SINKS is not None},
           "timing": "CUDA graph replay timed by triton.testing.do_bench: median, L2 flushed",
           "records": []}
    for shape in args.shapes:
        prefill = shape.endswith("xP")
        batch, ctx = map(int, shape.split("x")[:2])
        b = bd.Batch(batch, ctx, ctx if prefill else 1, dev, gen)
        for name in args.formats:
            kf, vf = FORMATS[name]
            lay = KVPageLayout(bd.HKV, bd.D, bd.BS, kf, vf)
            cache = bd.our_cache(lay, b, dev, gen)
            out = torch.empty_like(b.query)
            nbytes = bd.kv_bytes(b, lay.bytes_per_token // bd.HKV)
            runs = [("before", old_mod, {}), ("new", new_mod, {})]
            if args.key0_shift:
                shift = torch.randn(bd.HKV, bd.D, generator=gen).to(dev)
                runs.append(("key0", new_mod, {"key0_shift": shift}))
                runs.append(("key0_loop", new_mod, {"key0_shift": shift, "key0_in_loop": True}))
                runs.append(("key0_after", new_mod, {"key0_shift": shift, "key0_after_loop": True}))
            if args.rot_center:
                rot = ((torch.randn(bd.HKV, bd.D, generator=gen) * 0.5).to(dev),
                       llama3_theta(bd.D).to(dev))
                # built once (a (b, theta) tuple is turned into one on every call)
                full = new_mod.RotCenter.all_pairs(*rot) if hasattr(new_mod, "RotCenter") else rot
                runs.append(("rot", new_mod, {"rot_center": full}))
                runs += [(f"rot_q{n}", new_mod, {"rot_center": full, "rot_rows": n})
                         for n in args.rot_rows]
                runs += [(f"rot_k{k}", new_mod,
                          {"rot_center": new_mod.RotCenter.top_pairs(*rot, k)})
                         for k in args.rot_pairs if k < bd.D // 2]
                runs += [(f"rot_k{k}_{v}", new_mod,
                          {"rot_center": new_mod.RotCenter.top_pairs(*rot, k),
                           **variant_config(v, "decode")})
                         for k in args.rot_pairs if k < bd.D // 2 for v in args.rot_variants
                         if not prefill and variant_config(v, "decode") is not None]
            kind = "prefill" if prefill else "decode"
            runs += [(v, new_mod, variant_config(v, kind)) for v in args.variants
                     if variant_config(v, kind) is not None]
            ref = None
            for label, mod, cfg in runs:
                rec = {"kv_dtype": name, "batch": batch, "context": ctx, "variant": label,
                       "q_len": b.q_len,
                       "config": {k: v for k, v in cfg.items()
                                  if k not in ("key0_shift", "rot_center")},
                       "kv_bytes": nbytes}
                if "rot_center" in cfg:  # pairs corrected per KV head
                    rc = cfg["rot_center"]
                    rec["rot_pairs"] = rc.pairs if hasattr(rc, "pairs") else bd.D // 2
                try:
                    rec["us"] = timed(mod, lay, b, cache, out, args.smoke, **cfg)
                    rec["tb_s"] = nbytes / rec["us"] / 1e6
                    o = out.float()
                    if ref is None:
                        ref = o.clone()
                    rec["rel_diff_vs_before"] = float((o - ref).norm() / ref.norm())
                    rec["finite"] = bool(torch.isfinite(o).all())
                except Exception:  # noqa: BLE001
                    rec["error"] = traceback.format_exc()[-600:]
                res["records"].append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "error"}),
                      rec.get("error", "")[-300:], flush=True)
            del cache
            if dev == "cuda":
                torch.cuda.empty_cache()
        del b
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:  # after every shape: a timeout keeps what was measured
            json.dump(res, f, indent=1)
    print("\n==== variants (us; rel. diff vs before) ====")
    print(f"{res['versions']}  q/kv heads {bd.HQ}/{bd.HKV}, head_dim {bd.D}")
    print(f"{'kv':<15}{'variant':<22}" + "".join(f"{s:>20}" for s in args.shapes))
    keys = []
    for r in res["records"]:
        if (r["kv_dtype"], r["variant"]) not in keys:
            keys.append((r["kv_dtype"], r["variant"]))
    for kv, var in keys:
        cells = []
        for s in args.shapes:
            batch, ctx = map(int, s.split("x")[:2])
            q_len = ctx if s.endswith("xP") else 1
            r = next((r for r in res["records"] if r["kv_dtype"] == kv and r["variant"] == var
                      and r["batch"] == batch and r["context"] == ctx
                      and r["q_len"] == q_len), None)
            if r is None:  # the variant does not apply to this launch kind
                cells.append(f"{'-':>20}")
            elif "us" not in r:
                cells.append(f"{'ERR':>20}")
            else:
                cells.append(f"{r['us']:>10.1f} ({r['rel_diff_vs_before']:.0e})")
        print(f"{kv:<15}{var:<22}" + "".join(cells))
    if args.rot_center:
        print("\n==== time with the rotating-center correction / without (new) ====")
        for kv, var in keys:
            if not var.startswith("rot"):
                continue
            cells = []
            for s in args.shapes:
                batch, ctx = map(int, s.split("x")[:2])
                q_len = ctx if s.endswith("xP") else 1
                pick = {r["variant"]: r.get("us") for r in res["records"]
                        if r["kv_dtype"] == kv and r["batch"] == batch and r["context"] == ctx
                        and r["q_len"] == q_len}
                ok = pick.get(var) and pick.get("new")
                cells.append(f"{pick[var] / pick['new']:>20.3f}" if ok else f"{'-':>20}")
            print(f"{kv:<15}{var:<22}" + "".join(cells))


if __name__ == "__main__":
    main()
