"""Decode (and prefill) attention benchmark: our FP8/NVFP4 kernels against vLLM 0.32's peers.

Shapes: 32 query heads, 8 KV heads, head_dim 128, block 16, batch 16 and 64, context
4096 and 32768 per sequence, random data, shuffled block tables. Peers: vLLM's Triton
``unified_attention`` (bf16 and fp8 KV) and FlashAttention-3 via ``vllm.vllm_flash_attn`` (bf16,
and fp8 KV with an fp8 query as vLLM runs it). Timing: each call captured in a CUDA graph, its
replays timed by ``triton.testing.do_bench`` (median, L2 flushed between runs, after warm-up).
Writes one JSON file (records + copy bandwidth + versions) and prints a table. Other shapes
(hybrid models): ``--q-heads/--kv-heads/--head-dim``, ``--sinks`` (random per-head sink logits
for every kernel, vLLM's ``sinks`` / FA3's ``s_aux``), ``--block-size`` (vLLM 0.34's default is 64).
``--flashinfer`` adds FlashInfer's decode on NVFP4 and FP8 pages, as vLLM's own ``nvfp4`` runs it
(:mod:`benchmarks.flashinfer_decode`).

    python3 benchmarks/bench_decode.py --out results/DATE-decode-kernels-GPU/decode_h200.json
    python3 benchmarks/bench_decode.py --block-size 64 --flashinfer --no-prefill --out X.json
    python3 benchmarks/bench_decode.py --q-heads 16 --kv-heads 2 --head-dim 256 --sinks --out X.json
    python3 benchmarks/bench_decode.py --smoke     # CPU + TRITON_INTERPRET, tiny shapes, no timing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback
from typing import Callable

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.flashinfer_decode import flashinfer_peers  # noqa: E402
from vllm_nvfp4.kernels import attention as kattn  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout, allocate_cache  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
SOFTMAX_SCALE = 1.0 / math.sqrt(D)
SINKS: "torch.Tensor | None" = None  # fp32 [HQ] on the device with --sinks


def set_shape(q_heads: int, kv_heads: int, head_dim: int, sinks: bool, device: str,
              block_size: int = BS) -> None:
    """Set the benchmark's head shape and block size (module constants, read by every kernel
    call here)."""
    global HQ, HKV, D, SOFTMAX_SCALE, SINKS, BS
    if q_heads % kv_heads or head_dim % 64:
        raise SystemExit(f"--q-heads {q_heads} must be a multiple of --kv-heads {kv_heads} and "
                         f"--head-dim {head_dim} a multiple of 64")
    if block_size < 1 or block_size & (block_size - 1):
        raise SystemExit(f"--block-size {block_size} must be a power of two")
    HQ, HKV, D, BS = q_heads, kv_heads, head_dim, block_size
    SOFTMAX_SCALE = 1.0 / math.sqrt(D)
    gen = torch.Generator().manual_seed(1)
    SINKS = (torch.randn(HQ, generator=gen) * 2).to(device) if sinks else None


def timer(fn: Callable[[], object], smoke: bool) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph (L2 flushed between runs by
    do_bench). The graph takes the host's launch overhead out, as vLLM's graphed decode does:
    timed eagerly, a short decode measures the Python launch path, not the kernel. Eager timing
    (with a printed note) only where capture fails."""
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    fn()  # compile and allocate outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as e:  # noqa: BLE001
        print(f"  timed eagerly (CUDA graph capture failed: {e!r})"[:300], flush=True)
        torch.cuda.synchronize()
        run = fn
    us = triton.testing.do_bench(run, warmup=30, rep=200, return_mode="median") * 1e3
    del graph
    return us


def copy_bandwidth(smoke: bool) -> float:
    """Device-to-device copy, TB/s counting bytes read + written."""
    if smoke:
        return float("nan")
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    # eager: captured in a CUDA graph the copy becomes a memcpy node run by the copy engine,
    # slower than the copy kernel
    us = triton.testing.do_bench(lambda: b.copy_(a), warmup=30, rep=200,
                                 return_mode="median") * 1e3
    del a, b
    return 2 * n / us / 1e6


class Batch:
    """Block table / lengths / query for ``batch`` sequences of ``ctx`` tokens (+ q_len queries)."""

    def __init__(self, batch: int, ctx: int, q_len: int, device: str, gen: torch.Generator):
        self.batch, self.ctx, self.q_len = batch, ctx, q_len
        nblk = -(-ctx // BS)
        self.num_blocks = batch * nblk + 1
        perm = torch.randperm(self.num_blocks - 1, generator=gen)
        self.block_table = perm.view(batch, nblk).to(torch.int32).to(device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.qsl = (torch.arange(batch + 1, dtype=torch.int32) * q_len).to(device)
        self.query = (torch.randn(batch * q_len, HQ, D, generator=gen)).to(torch.bfloat16).to(device)


def our_cache(lay: KVPageLayout, b: Batch, device: str, gen: torch.Generator) -> torch.Tensor:
    """Random valid cache bytes (no NaN encodings): fp8 |x| < 2, NVFP4 scales in [2^-6, 2)."""
    cache = allocate_cache(lay, b.num_blocks, device)
    cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8).to(device)
                if device == "cpu" else torch.randint(0, 256, cache.shape, dtype=torch.uint8,
                                                      device=device))
    for which in ("k", "v"):
        if not lay.has_scales(which):  # FP8
            lay.data_plane(cache, which).bitwise_and_(0xBF)
        else:
            sp = lay.scale_plane(cache, which)
            sp.bitwise_and_(0x3F).bitwise_or_(0x08)
    return cache


def kv_bytes(b: Batch, per_token_head: int) -> int:
    return b.batch * b.ctx * HKV * per_token_head


def run_ours(lay, b, cache, out, smoke, launch: "kattn.LaunchShape | None" = None) -> float:
    ks = torch.full((HKV,), 0.01, device=cache.device)
    vs = torch.full((HKV,), 0.02, device=cache.device)

    def fn():
        kattn.paged_attention(b.query, cache, lay, ks, vs, b.block_table, b.seq_lens, b.qsl,
                              b.q_len, b.ctx, SOFTMAX_SCALE, out, sinks=SINKS, launch=launch)
    return timer(fn, smoke)


def vllm_peers(b: Batch, smoke: bool) -> list[dict]:
    """vLLM Triton unified_attention and FA3, bf16 and fp8 KV; errors are recorded, not raised."""
    recs = []
    if smoke:
        return recs
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as e:  # noqa: BLE001
        return [{"kernel": "vllm_triton", "error": repr(e)}]
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        flash_attn_varlen_func = None
        recs.append({"kernel": "fa3", "error": repr(e)})
    fp8 = torch.float8_e4m3fn
    shape = (b.num_blocks, BS, HKV, D)
    for kv_dtype in ("bf16", "fp8"):
        k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        if kv_dtype == "fp8":
            k, v = k.to(fp8), v.to(fp8)
        per = D * 2 * k.element_size()
        desc = torch.ones(b.batch, HKV, dtype=torch.float32, device="cuda")
        out = torch.empty_like(b.query)
        segs = 16  # vLLM's NUM_PAR_SOFTMAX_SEGMENTS; its 3D (split) kernel is decode-only
        seg_o = seg_m = seg_s = None
        if b.q_len == 1:
            seg_o = torch.empty(b.batch, HQ, segs, D, dtype=torch.float32, device="cuda")
            seg_m = torch.empty(b.batch, HQ, segs, dtype=torch.float32, device="cuda")
            seg_s = torch.empty_like(seg_m)

        def tri():
            unified_attention(
                q=b.query, k=k, v=v, out=out, cu_seqlens_q=b.qsl, max_seqlen_q=b.q_len,
                seqused_k=b.seq_lens, max_seqlen_k=b.ctx, softmax_scale=SOFTMAX_SCALE,
                causal=True, window_size=(-1, -1), block_table=b.block_table, softcap=0,
                q_descale=None, k_descale=desc if kv_dtype == "fp8" else None,
                v_descale=desc if kv_dtype == "fp8" else None,
                seq_threshold_3D=128 // HKV, num_par_softmax_segments=segs,
                softmax_segm_output=seg_o, softmax_segm_max=seg_m, softmax_segm_expsum=seg_s,
                sinks=SINKS)
        try:
            recs.append({"kernel": "vllm_triton", "kv_dtype": kv_dtype, "us": timer(tri, False),
                         "kv_bytes": kv_bytes(b, per)})
        except Exception as e:  # noqa: BLE001
            recs.append({"kernel": "vllm_triton", "kv_dtype": kv_dtype, "error": repr(e)[:500]})
        if flash_attn_varlen_func is not None:
            q = b.query.to(fp8) if kv_dtype == "fp8" else b.query

            def fa3():
                flash_attn_varlen_func(
                    q, k, v, max_seqlen_q=b.q_len, cu_seqlens_q=b.qsl, max_seqlen_k=b.ctx,
                    seqused_k=b.seq_lens, softmax_scale=SOFTMAX_SCALE, causal=True,
                    block_table=b.block_table, out=out, fa_version=3,
                    q_descale=desc if kv_dtype == "fp8" else None,
                    k_descale=desc if kv_dtype == "fp8" else None,
                    v_descale=desc if kv_dtype == "fp8" else None,
                    s_aux=None if SINKS is None else SINKS.to(torch.bfloat16))  # FA3 takes bf16 only
            try:
                recs.append({"kernel": "fa3", "kv_dtype": kv_dtype, "us": timer(fa3, False),
                             "kv_bytes": kv_bytes(b, per)})
            except Exception as e:  # noqa: BLE001
                recs.append({"kernel": "fa3", "kv_dtype": kv_dtype, "error": repr(e)[:500]})
        del k, v
        torch.cuda.empty_cache()
    return recs


OUR_FORMATS = {"fp8": ("fp8", "fp8"), "nvfp4": ("nvfp4", "nvfp4"), "k_fp8_v_nvfp4": ("fp8", "nvfp4")}


def bench_shape(batch: int, ctx: int, q_len: int, args, gen) -> list[dict]:
    dev = "cpu" if args.smoke else "cuda"
    b = Batch(batch, ctx, q_len, dev, gen)
    recs = []
    for name, (kf, vf) in OUR_FORMATS.items():
        if q_len > 1 and name == "k_fp8_v_nvfp4":
            continue
        lay = KVPageLayout(HKV, D, BS, kf, vf)
        cache = our_cache(lay, b, dev, gen)
        out = torch.empty_like(b.query)
        per = lay.bytes_per_token // HKV
        default = run_ours(lay, b, cache, out, args.smoke)
        recs.append({"kernel": "ours", "kv_dtype": name, "config": "default", "us": default,
                     "kv_bytes": kv_bytes(b, per)})
        ref_out = out.float().clone()  # sweep configs must reproduce the default's output
        if q_len == 1 and args.sweep:
            best = None
            configs = [(sp, t, w) for sp in args.splits for t in args.tiles for w in args.warps]
            for splits, tile, warps in configs if name in args.sweep_formats else []:
                cfg = f"splits={splits},tile={tile},warps={warps}"
                try:
                    shape = dataclasses.replace(kattn.launch_defaults(lay, True), tile_n=tile,
                                                num_warps=warps, num_splits=splits)
                    us = run_ours(lay, b, cache, out, args.smoke, shape)
                except Exception as e:  # noqa: BLE001
                    print(f"  config {cfg} failed: {e!r}"[:300])
                    continue
                rel = float((out.float() - ref_out).norm() / ref_out.norm())
                print(f"  {name} {batch}x{ctx} {cfg}: {us:.1f} us (rel {rel:.1e})", flush=True)
                recs.append({"kernel": "ours_sweep", "kv_dtype": name, "config": cfg, "us": us,
                             "kv_bytes": kv_bytes(b, per), "rel_err_vs_default": rel})
                if not rel < 1e-2:
                    print(f"  config {cfg}: output differs from default (rel {rel:.2e})")
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            if best:
                recs.append({"kernel": "ours_best", "kv_dtype": name, "config": best[1],
                             "us": best[0], "kv_bytes": kv_bytes(b, per)})
        del cache
    if not args.no_peers:
        recs += vllm_peers(b, args.smoke)
    if args.flashinfer and q_len == 1 and not args.smoke:
        recs += flashinfer_peers(b.block_table, ctx, b.query, HKV, BS, SOFTMAX_SCALE,
                                 lambda fn: timer(fn, False), {"nvfp4": D * 9 / 8, "fp8": 2 * D})
    for r in recs:
        r.update(batch=batch, context=ctx, q_len=q_len)
        if "us" in r:
            r["tb_s"] = r["kv_bytes"] / r["us"] / 1e6
    del b
    if dev == "cuda":
        torch.cuda.empty_cache()
    return recs


def model_mix(recs: list[dict], n_fp8: int = 4, n_layers: int = 32) -> list[dict]:
    """Whole-model attention time for ``n_fp8`` FP8 + the rest NVFP4 layers vs all FP8."""
    mixes = []
    for (batch, ctx) in sorted({(r["batch"], r["context"]) for r in recs if r.get("q_len") == 1}):
        def t(fmt):
            cand = [r["us"] for r in recs if r["kernel"] in ("ours", "ours_best")
                    and r.get("kv_dtype") == fmt and r["batch"] == batch and r["context"] == ctx
                    and "us" in r]
            return min(cand) if cand else None
        t8, t4 = t("fp8"), t("nvfp4")
        if t8 and t4:
            mix = n_fp8 * t8 + (n_layers - n_fp8) * t4
            mixes.append({"kernel": "ours_model_mix", "kv_dtype": f"{n_fp8}fp8+{n_layers - n_fp8}nvfp4",
                          "batch": batch, "context": ctx, "us": mix, "all_fp8_us": n_layers * t8,
                          "ratio_vs_all_fp8": mix / (n_layers * t8)})
    return mixes


def table(recs: list[dict]) -> str:
    lines = [f"{'kernel':<16}{'kv':<15}{'q':>5}{'batch':>6}{'ctx':>8}{'us':>10}{'TB/s':>7}  config"]
    for r in recs:
        if r["kernel"] == "ours_sweep":
            continue
        us = f"{r['us']:.1f}" if "us" in r else "ERR"
        tbs = f"{r['tb_s']:.2f}" if "tb_s" in r else ""
        extra = r.get("config", "") or r.get("error", "")[:60]
        if "ratio_vs_all_fp8" in r:
            extra = f"ratio vs all-fp8 {r['ratio_vs_all_fp8']:.3f}"
        lines.append(f"{r['kernel']:<16}{r.get('kv_dtype', ''):<15}{r.get('q_len', 1):>5}"
                     f"{r.get('batch', ''):>6}{r.get('context', ''):>8}{us:>10}{tbs:>7}  {extra}")
    return "\n".join(lines)


def versions() -> dict:
    v = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    try:
        import vllm
        v["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001
        v["vllm"] = f"unavailable: {e!r}"[:200]
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="decode_h200.json")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--prefill", type=int, nargs=2, default=[8, 4096], metavar=("BATCH", "LEN"))
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time decode split/tile/warp variants")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tiles", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--sweep-formats", nargs="+", default=["fp8", "nvfp4"])
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--q-heads", type=int, default=HQ)
    ap.add_argument("--kv-heads", type=int, default=HKV)
    ap.add_argument("--head-dim", type=int, default=D)
    ap.add_argument("--sinks", action="store_true", help="attention sinks in every kernel")
    ap.add_argument("--block-size", type=int, default=BS, help="tokens per KV block (page)")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also FlashInfer's decode on NVFP4 / FP8 pages (vLLM's own nvfp4 kernel)")
    args = ap.parse_args()
    set_shape(args.q_heads, args.kv_heads, args.head_dim, args.sinks,
              "cpu" if args.smoke else "cuda", args.block_size)
    if args.smoke:
        args.batches, args.contexts, args.prefill = [2], [64], [2, 32]
        args.splits, args.tiles = [1, 2], [16, 32]
    gen = torch.Generator().manual_seed(0)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": versions(),
              "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": BS,
                        "sinks": SINKS is not None},
              "timing": "CUDA graph replay timed by triton.testing.do_bench: median, L2 flushed, "
                        "warmup 30 ms, rep 200 ms",
              "copy_tb_s": copy_bandwidth(args.smoke), "records": []}
    print(f"copy bandwidth {result['copy_tb_s']:.2f} TB/s (read + write)", flush=True)
    # untimed warm-up (seconds): the first kernel of a process runs slower (compilation, clocks)
    if not args.smoke:
        bench_shape(args.batches[0], args.contexts[0], 1,
                    argparse.Namespace(**{**vars(args), "sweep": False, "no_peers": True}), gen)
    for batch in args.batches:
        for ctx in args.contexts:
            try:
                recs = bench_shape(batch, ctx, 1, args, gen)
            except Exception:  # noqa: BLE001
                recs = [{"kernel": "ours", "batch": batch, "context": ctx,
                         "error": traceback.format_exc()[-800:]}]
            result["records"] += recs
            print(table(recs), flush=True)
    if not args.no_prefill:
        pb, pl = args.prefill
        recs = bench_shape(pb, pl, pl, args, gen)
        result["records"] += recs
        print(table(recs), flush=True)
    result["records"] += model_mix(result["records"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n==== summary ====")
    print(f"copy {result['copy_tb_s']:.2f} TB/s; {result['versions']}")
    print(table([r for r in result["records"] if r["kernel"] != "ours_sweep"]))


if __name__ == "__main__":
    main()
