"""Triton kernels vs the torch definition: bit-exact cache bytes, attention vs float64.

Without a GPU the kernels run small under ``TRITON_INTERPRET=1`` (set here before the kernels are
imported; fp32 math); with CUDA they run full size in fp16/bf16.
"""

import dataclasses
import itertools
import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from paged_cases import (  # noqa: E402
    check_written_bytes, make_batch, random_sinks, reference_attention, roundtrip, run_attention,
    write_case,
)
from vllm_nvfp4 import ops  # noqa: E402
from vllm_nvfp4.kernels import attention as attn_kernels  # noqa: E402
from vllm_nvfp4.kernels import launch as launch_kernels  # noqa: E402
from vllm_nvfp4.layout import KVPageLayout, allocate_cache  # noqa: E402
from vllm_nvfp4.paged_torch import attend_one_sequence  # noqa: E402

if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

DEV = "cuda" if CUDA else "cpu"
FORMATS = ("fp8", "nvfp4")
FMT_PAIRS = list(itertools.product(FORMATS, FORMATS))
#: context lengths: small in the interpreter, long on the GPU
SCALE = 37 if CUDA else 1
#: how the attention tests fill the cache: the write kernel on the GPU; in the interpreter the
#: torch path (same bytes, tested above; the interpreted write kernel is slow)
WRITE = "triton" if CUDA else "torch"


def fast_reference(batch, softmax_scale, window=None, cap=None, sinks=None, key0_shift=None):
    """Float64 attention on formats-roundtripped K/V (vectorised; checked against the per-token
    loop reference in test_paged_torch); ``key0_shift [H, D]`` subtracted from position 0's key."""
    sinks = None if sinks is None else sinks.cpu().double()
    outs = []
    q = batch.query.cpu().double()
    row = 0
    for (l, q_len), k, v in zip(batch.seqs, batch.keys, batch.values):
        kd = roundtrip(k, batch.layout.k_format, batch.k_scale)
        if key0_shift is not None:
            kd[0] -= key0_shift.cpu().double()
        vd = roundtrip(v, batch.layout.v_format, batch.v_scale)
        outs.append(attend_one_sequence(q[row : row + q_len], kd, vd, softmax_scale, window, cap,
                                        sinks))
        row += q_len
    return torch.cat(outs)


def assert_close_rel(got, want, tol):
    got = got.double().cpu()
    assert torch.isfinite(got).all(), "non-finite output"
    rel = (got - want).norm() / want.norm()
    assert rel < tol, f"relative error {rel:.2e} >= {tol:.0e}"


# ---------------------------------------------------------------- cache write, bit-exact
@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
@pytest.mark.parametrize(
    "h,d,b,dtype",
    [(2, 64, 16, torch.bfloat16), (3, 128, 32, torch.float16), (1, 256, 16, torch.float32)],
)
def test_write_kernel_bit_exact(kf, vf, h, d, b, dtype):
    lay = KVPageLayout(h, d, b, kf, vf)
    key, value, slots, cache, ks, vs = write_case(lay, 13 * SCALE, dtype, seed=d + b, nan=True)
    before = cache.clone()
    dev = [t.to(DEV) for t in (key, value, slots, cache, ks, vs)]
    ops.write_kv_cache(dev[0], dev[1], dev[3], dev[2], lay, dev[4], dev[5], backend="triton")
    check_written_bytes(lay, before, dev[3].cpu(), key, value, slots, ks, vs)


def _e4m3_edge_values() -> torch.Tensor:
    """Every E4M3 value, the midpoints between neighbours (ties), and values just off them,
    saturation, underflow, signed zeros, Inf and NaN."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                      torch.tensor([464.0, 480.0, 1e6, 2.0**-10, 2.0**-11, 1e-30, 1e-45, 0.0])])
    vals = torch.cat([vals, -vals, torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0])])
    pad = (-vals.numel()) % 64
    return torch.cat([vals, torch.full((pad,), 0.75)]).view(-1, 1, 64)


def test_write_kernel_e4m3_rounding_edges():
    """FP8 with scale 1 stores e4m3(x) directly: every tie and boundary of the rounding."""
    lay = KVPageLayout(1, 64, 16, "fp8", "fp8")
    x = _e4m3_edge_values()
    n = x.shape[0]
    cache = allocate_cache(lay, -(-n // 16), DEV)
    before = cache.cpu().clone()
    one = torch.ones(1, device=DEV)
    slots = torch.arange(n, device=DEV)
    ops.write_kv_cache(x.to(DEV), x.to(DEV), cache, slots, lay, one, one, backend="triton")
    check_written_bytes(lay, before, cache.cpu(), x, x, slots.cpu(), one.cpu(), one.cpu())


def test_write_kernel_block_scale_choice_hand_computed():
    """The blocks of test_formats' hand-computed block-scale choice, written by the kernel with
    g = 1: every candidate order and outcome (6 kept, 4, tie, one step up)."""
    lay = KVPageLayout(1, 128, 16, "nvfp4", "nvfp4")
    x = torch.zeros(1, 1, 128)
    blocks = x.view(8, 16)
    blocks[0], blocks[0, 0] = 1.0, 4.0
    blocks[1], blocks[1, 0] = 0.5, 6.0
    blocks[2, :3] = torch.tensor([6.0, 3.0, -3.0])
    blocks[3, :2] = torch.tensor([4.0, 2.75])
    blocks[4], blocks[4, 0] = 2.25, 6.4
    cache = allocate_cache(lay, 1, DEV)
    before = cache.cpu().clone()
    one = torch.ones(1, device=DEV)
    slots = torch.zeros(1, dtype=torch.int64, device=DEV)
    ops.write_kv_cache(x.to(DEV), x.to(DEV), cache, slots, lay, one, one, backend="triton")
    check_written_bytes(lay, before, cache.cpu(), x, x, slots.cpu(), one.cpu(), one.cpu())
    got = lay.scale_plane(cache.cpu(), "k")[0, :, 0].flatten().tolist()
    assert got == [0x38, 0x38, 0x38, 0x33, 0x39, 0, 0, 0]


# ---------------------------------------------------------------- attention vs float64
def _seq_mix(kind: str) -> list:
    s = SCALE
    if kind == "decode":
        return [(37 * s, 1), (5, 1), (70 * s + 3, 1), (1, 1), (19 * s, 1)]
    return [(23 * s, 23 * s), (41 * s, 9), (16, 16), (33 * s, 1), (50 * s + 1, 17)]


ATTN_SHAPES = [(2, 1, 64, 16), (2, 3, 64, 32), (1, 4, 128, 16), (2, 8, 128, 32), (1, 2, 256, 16)]
#: GPU: every shape x every K/V format pair; interpreter: two format pairs per shape, rotating,
#: so each shape, each pair and each (shape, kind) still meets both formats for K and for V
ATTN_CASES = (
    [(kf, vf, *shape) for shape in ATTN_SHAPES for kf, vf in FMT_PAIRS]
    if CUDA
    else [(*FMT_PAIRS[(i + j) % 4], *shape) for i, shape in enumerate(ATTN_SHAPES) for j in (0, 2)]
)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("kf,vf,hkv,group,d,b", ATTN_CASES)
def test_attention_matches_float64(kf, vf, kind, hkv, group, d, b):
    lay = KVPageLayout(hkv, d, b, kf, vf)
    dtype = torch.bfloat16 if CUDA else torch.float32
    batch = make_batch(lay, _seq_mix(kind), hkv * group, q_dtype=dtype, kv_dtype=dtype,
                       device=DEV, seed=d + b + group, write_backend=WRITE)
    got = run_attention(batch, backend="triton")
    want = fast_reference(batch, 1.0 / math.sqrt(d))
    assert_close_rel(got, want, 1e-2 if CUDA else 1e-5)
    if not CUDA:  # the interpreter also meets the per-token float64 loop reference
        torch.testing.assert_close(got.double(), reference_attention(batch, 1.0 / math.sqrt(d)),
                                   atol=2e-5, rtol=1e-4)



def _launch(lay: KVPageLayout, decode: bool, **fixed) -> "attn_kernels.LaunchShape":
    """The default launch shape of ``lay`` with the ``fixed`` fields that are not None replaced."""
    fixed = {k: v for k, v in fixed.items() if v is not None}
    return dataclasses.replace(attn_kernels.launch_defaults(lay, decode), **fixed)


@pytest.mark.parametrize("splits,stages", [(2, None), (1, 1), (8, 3), (3, 5), (6, 2)])
@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
def test_decode_splits_and_stages_agree(splits, stages, kf, vf):
    """Split counts (also not powers of 2) and pipeline stages give the same attention, every K/V
    format pair."""
    lay = KVPageLayout(2, 128, 16, kf, vf)
    batch = make_batch(lay, [(100 * SCALE + 7, 1), (3, 1), (64 * SCALE, 1)], 8,
                       device=DEV, seed=splits, write_backend=WRITE)
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, 1, batch.max_seq_len, 0.1, out,
        launch=_launch(lay, True, num_splits=splits, num_stages=stages))
    assert_close_rel(out, fast_reference(batch, 0.1), 2e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("tile_n,warps", [(16, 1), (32, 1), (64, 2), (32, 4)])
@pytest.mark.parametrize("kf,vf", [("nvfp4", "nvfp4"), ("fp8", "fp8"), ("fp8", "nvfp4")])
def test_decode_launch_shapes_agree(tile_n, warps, kf, vf):
    """Keys per tile and warps per program (the launch defaults differ per format pair) give the
    same attention; odd lengths leave partial tiles in every split."""
    lay = KVPageLayout(2, 128, 16, kf, vf)
    batch = make_batch(lay, [(37 * SCALE + 5, 1), (1, 1), (20 * SCALE + 3, 1)], 8,
                       device=DEV, seed=tile_n + warps, write_backend=WRITE)
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, 1, batch.max_seq_len, 0.1, out,
        launch=_launch(lay, True, num_splits=2, tile_n=tile_n, num_warps=warps))
    assert_close_rel(out, fast_reference(batch, 0.1), 2e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("fold", [dict(), dict(fold_k_scales=True, fold_v_scales=True,
                                                 lazy_rescale=True)],
                         ids=["apart", "fold_kv_lazy"])
@pytest.mark.parametrize("d,parts,tile_n,kind", [(128, 2, 16, "decode"), (512, 4, 32, "decode"),
                                                 (512, 2, 16, "prefill")])
@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
def test_head_dim_parts_match_float64(d, parts, tile_n, kind, fold, kf, vf):
    """The head dim cut into parts over the warps (``dim_parts``: each warp takes its columns of
    K and V, the scores summed across them) against float64, every K/V format pair, with and
    without the block scales folded into the K and V planes (and the lazy rescale); odd lengths,
    split decode."""
    lay = KVPageLayout(1, d, 16, kf, vf)
    decode = kind == "decode"
    seqs = ([(37 * SCALE + 5, 1), (1, 1), (20 * SCALE + 3, 1)] if decode
            else [(9 * SCALE, 9 * SCALE), (21 * SCALE, 5)])
    batch = make_batch(lay, seqs, 8, device=DEV, seed=d + parts, write_backend=WRITE)
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, batch.max_query_len, batch.max_seq_len, 0.1, out,
        launch=attn_kernels.LaunchShape(tile_n, parts, num_splits=2 if decode else None,
                                        dim_parts=parts, **fold))
    assert_close_rel(out, fast_reference(batch, 0.1), 2e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("variant", [dict(hoist_query=True), dict(fold_k_scales=True),
                                     dict(hoist_query=True, fold_k_scales=True),
                                     dict(fold_v_scales=False), dict(fold_v_scales=True)],
                         ids=["hoist_query", "fold_k", "hoist_query_fold_k", "no_fold_v", "fold_v"])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
def test_code_variants_match_float64(variant, kind, kf, vf):
    """The attention core's code variants (hoisted query operands, K or V block scales folded
    into their planes, or V scales on P) against float64, every K/V format pair, odd lengths,
    split decode."""
    lay = KVPageLayout(2, 128, 16, kf, vf)
    seqs = ([(37 * SCALE + 5, 1), (1, 1), (20 * SCALE + 3, 1)] if kind == "decode"
            else [(23 * SCALE, 23 * SCALE), (41 * SCALE, 9), (33 * SCALE, 1)])
    batch = make_batch(lay, seqs, 8, device=DEV, seed=len(variant) + 3 * (kind == "decode"),
                       write_backend=WRITE)
    decode = kind == "decode"
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, batch.max_query_len, batch.max_seq_len, 0.1, out,
        launch=_launch(lay, decode, num_splits=2 if decode else None, **variant))
    assert_close_rel(out, fast_reference(batch, 0.1), 2e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("seqs,ctx,warps", [(1, 100, 1), (16, 4096, 1), (64, 32768, 2),
                                            (512, 32768, 4), (3, 70000, 1), (1, 131072, 1)])
def test_decode_split_count_bounds(seqs, ctx, warps):
    """The split heuristic: a power of 2, at most 64 and at most the tile count; at most ~4096
    keys per split unless capped; more splits when fewer warps per program; at most 8 splits
    to fill the GPU, more only for the 4096-key bound (on the CPU's nominal 4 SMs 8 splits of
    these batches always give at least half the programs the fill wants)."""
    dev = torch.device("cpu")
    tiles = -(-ctx // 32)
    s = attn_kernels.decode_splits(seqs, 8, ctx, 32, dev, warps)
    assert s & (s - 1) == 0 and 1 <= s <= min(64, tiles)
    assert ctx <= 4096 * s or s == min(64, 1 << (min(64, tiles).bit_length() - 1))
    assert s >= attn_kernels.decode_splits(seqs, 8, ctx, 32, dev, 4 * warps)
    assert s <= max(8, 1 << (-(-ctx // 4096) - 1).bit_length())


@pytest.mark.parametrize("seqs,kv_heads,ctx,tile_n,want", [
    (16, 2, 32768, 32, 32),  # few programs: more than 8 splits, 1024 keys each
    (4, 8, 32768, 64, 32),
    (64, 2, 8192, 32, 8),  # 8 splits give half the programs: the cap of 8 stays
    (16, 8, 32768, 64, 8),
    (64, 8, 4096, 64, 4),
    (1, 8, 4096, 64, 32),  # few programs: fill the GPU while a split keeps >= 128 keys
    (16, 2, 4096, 32, 32),
    (16, 2, 8192, 32, 32),
    (16, 4, 4096, 16, 16),
    (1, 1, 1024, 64, 8),  # 8 splits of 128 keys: the tile count bounds it
])
def test_decode_splits_for_few_programs(monkeypatch, seqs, kv_heads, ctx, tile_n, want):
    """On an H200's 132 SMs (1-warp programs, fill target 1056): 8 splits at most while they
    give at least half the target, else as many as keep 1024 keys per split or as fill the
    target with >= 128 keys per split."""
    monkeypatch.setattr(launch_kernels, "_num_sms", lambda device: 132)
    got = attn_kernels.decode_splits(seqs, kv_heads, ctx, tile_n, torch.device("cpu"), 1)
    assert got == want


@pytest.mark.parametrize("seqs,ctx,want_splits", [(16, 4096, 16), (16, 32768, 16), (64, 4096, 4),
                                                   (64, 32768, 8), (16, 96, 4), (132, 4096, 2)])
def test_decode_register_cap_head_dim_512(monkeypatch, seqs, ctx, want_splits):
    """NVFP4 K and V at head_dim 512, 32 q / 4 KV heads on an H200's 132 SMs: the head-dim-parts
    decode doubles its splits where the doubled grid still fits eight programs per SM (16
    sequences: 512 -> 1024 programs, 132: 528 -> 1056; never more splits than tiles), and is capped at 128
    registers where its grid holds more than four programs per SM; a cap the launch shape sets
    wins; head-dim parts off: no cap, no doubling."""
    monkeypatch.setattr(launch_kernels, "_num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    shape = attn_kernels.launch_defaults(KVPageLayout(4, 512, 16, "nvfp4", "nvfp4"), True)
    splits = attn_kernels.decode_splits(seqs, 4, ctx, shape.tile_n, cpu, shape.num_warps,
                                        shape.dim_parts)
    assert splits == want_splits
    one_part_splits = attn_kernels.decode_splits(seqs, 4, ctx, shape.tile_n, cpu, shape.num_warps)
    assert splits == (2 * one_part_splits if seqs * 4 * 2 * one_part_splits <= 8 * 132 and ctx > 96
                      else one_part_splits)
    keys = -(-ctx // splits)
    want = 128 if seqs * 4 * splits > 4 * 132 else None
    assert attn_kernels.decode_register_cap(shape, seqs * 4 * splits, keys, cpu) == want
    fixed = dataclasses.replace(shape, maxnreg=168)
    assert attn_kernels.decode_register_cap(fixed, seqs * 4 * splits, keys, cpu) == 168
    one_part = dataclasses.replace(shape, dim_parts=1)
    assert attn_kernels.decode_register_cap(one_part, 10**6, keys, cpu) is None


@pytest.mark.parametrize("seqs,ctx,want", [(64, 4096, 184), (16, 4096, 184), (64, 8192, None),
                                            (64, 32768, None), (16, 32768, None)])
def test_decode_register_cap_short_splits(monkeypatch, seqs, ctx, want):
    """NVFP4 K and V at head_dim 128, 32 q / 8 KV heads, 132 SMs: 184 registers where each split
    holds at most 1024 keys (4k contexts at 8 splits), uncapped at 8k (4 splits of 2048 keys) and 32k (4096 keys per
    split); FP8 K and V and head_dim 256 never take the short-split cap."""
    monkeypatch.setattr(launch_kernels, "_num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    for kf, vf, d, cap in (("nvfp4", "nvfp4", 128, want), ("fp8", "fp8", 128, None),
                           ("nvfp4", "nvfp4", 256, None)):
        shape = attn_kernels.launch_defaults(KVPageLayout(8, d, 16, kf, vf), True)
        splits = attn_kernels.decode_splits(seqs, 8, ctx, shape.tile_n, cpu, shape.num_warps)
        keys = -(-ctx // splits)
        assert attn_kernels.decode_register_cap(shape, seqs * 8 * splits, keys, cpu) == cap


@pytest.mark.parametrize("seqs,ctx,want", [(64, 4096, 5), (16, 4096, 3), (64, 32768, 5),
                                            (16, 32768, 5), (4, 2048, 3)])
def test_decode_stages_long_splits(monkeypatch, seqs, ctx, want):
    """An NVFP4 K at head_dim 128, 32 q / 8 KV heads, 132 SMs: the tile loop takes 5 pipeline
    stages (a second copy buffer) where each split holds at least 1024 keys (64 x 4k: 4 splits
    of 1024), 3 where it holds fewer (16 x 4k: 8 splits of 512); an FP8 K and head_dim 256
    always 3; a launch shape's ``num_stages`` wins."""
    monkeypatch.setattr(launch_kernels, "_num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    for kf, vf, d, stages in (("nvfp4", "nvfp4", 128, want), ("nvfp4", "fp8", 128, want),
                              ("fp8", "nvfp4", 128, 3), ("fp8", "fp8", 128, 3),
                              ("nvfp4", "nvfp4", 256, 3)):
        shape = attn_kernels.launch_defaults(KVPageLayout(8, d, 16, kf, vf), True)
        splits = attn_kernels.decode_splits(seqs, 8, ctx, shape.tile_n, cpu, shape.num_warps)
        keys = -(-ctx // splits)
        assert attn_kernels.decode_stages(shape, keys) == stages, (kf, vf, d)
        fixed = dataclasses.replace(shape, num_stages=2)
        assert attn_kernels.decode_stages(fixed, keys) == 2


@pytest.mark.parametrize("group,d,b,window,cap", [(3, 64, 32, 40, 2.0), (1, 256, 16, None, None),
                                                 (8, 128, 16, 7, None)])
@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
def test_decode_shapes(group, d, b, window, cap, kf, vf):
    """The decode at other GQA groups, head dims, block sizes, window and soft-cap, against
    float64."""
    lay = KVPageLayout(2, d, b, kf, vf)
    batch = make_batch(lay, _seq_mix("decode"), 2 * group, device=DEV, seed=group + d,
                       write_backend=WRITE)
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, 1, batch.max_seq_len, 0.3, out,
        sliding_window=window, logits_soft_cap=cap)
    assert_close_rel(out, fast_reference(batch, 0.3, window, cap), 2e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("kf,vf", [("nvfp4", "nvfp4"), ("fp8", "nvfp4"), ("fp8", "fp8")])
def test_decode_ignores_stale_slots(kf, vf):
    """Slots past each sequence's end (data AND block scales, NaN bytes here) and the blocks that
    padding block-table entries point to never reach the decode output (the keys kernel loads
    whole scale rows unmasked); a NaN scale inside a context reaches only that sequence."""
    lay = KVPageLayout(2, 64, 16, kf, vf)
    seqs = [(37 * SCALE + 5, 1), (5, 1), (20 * SCALE + 3, 1)]
    batch = make_batch(lay, seqs, 4, device=DEV, seed=11, write_backend=WRITE)
    clean = run_attention(batch, backend="triton")
    nblk = [-(-length // 16) for length, _ in seqs]
    in_use = {int(b) for i, n in enumerate(nblk) for b in batch.block_table[i, :n]}
    spare = [b for b in range(batch.cache.shape[0]) if b not in in_use]
    for i, (length, _) in enumerate(seqs):
        batch.block_table[i, nblk[i]:] = spare[i % len(spare)]
        last = int(batch.block_table[i, nblk[i] - 1])
        for which in ("k", "v"):
            lay.data_plane(batch.cache, which)[last, :, length % 16 or 16:] = 0xFF
            if lay.has_scales(which):
                lay.scale_plane(batch.cache, which)[last, :, length % 16 or 16:] = 0x7F
    for which in ("k", "v"):
        lay.data_plane(batch.cache, which)[spare] = 0xFF
        if lay.has_scales(which):
            lay.scale_plane(batch.cache, which)[spare] = 0x7F
    torch.testing.assert_close(run_attention(batch, backend="triton"), clean, rtol=0, atol=0)
    if lay.has_scales("v") and CUDA:  # the interpreter decodes e4m3 0x7F as 480, not NaN
        lay.scale_plane(batch.cache, "v")[int(batch.block_table[1, 0]), 0, 2, 1] = 0x7F
        got = run_attention(batch, backend="triton")
        assert torch.isnan(got[1]).any() and not torch.isnan(got[[0, 2]]).any()


@pytest.mark.parametrize("rows,tile_n,warps", [(16, None, None), (32, 32, 4), (16, 16, 2)])
@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
def test_prefill_launch_shapes_agree(rows, tile_n, warps, kf, vf):
    """Rows per program and launch shapes, on chunked prefills with cached prefixes, odd lengths
    and a GQA group of 3, against float64."""
    lay = KVPageLayout(2, 64, 16, kf, vf)
    seqs = [(29 * SCALE + 4, 21), (7, 7), (40 * SCALE, 1), (18 * SCALE + 1, 18 * SCALE + 1)]
    batch = make_batch(lay, seqs, 6, device=DEV, seed=rows + len(kf + vf), write_backend=WRITE)
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, batch.max_query_len, batch.max_seq_len, 0.2, out,
        launch=_launch(lay, False, query_rows=rows, tile_n=tile_n, num_warps=warps))
    assert_close_rel(out, fast_reference(batch, 0.2), 2e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("bad,what", [(dict(query_rows=24), "query_rows must be"),
                                      (dict(num_splits=0), "num_splits must be"),
                                      (dict(num_warps=2, dim_parts=4), "dim_parts must be")])
def test_launch_rejects_bad_launch_shapes(bad, what):
    """A row count that is not a power of 2, no splits, more head-dim parts than warps: a
    ValueError that says so."""
    lay = KVPageLayout(1, 64, 16, "nvfp4", "fp8")
    with pytest.raises(ValueError, match=what):
        _launch(lay, False, **bad)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("window,cap", [(7, None), (None, 5.0), (40, 2.0)])
@pytest.mark.parametrize("kf,vf", [("fp8", "fp8"), ("nvfp4", "fp8")])
def test_window_and_soft_cap(kind, window, cap, kf, vf):
    """Sliding window and logits soft-cap in both kernel families (FP8 / FP8 decode: rows;
    everything else: keys)."""
    lay = KVPageLayout(2, 64, 16, kf, vf)
    batch = make_batch(lay, _seq_mix(kind), 4, device=DEV, seed=17, write_backend=WRITE)
    got = run_attention(batch, backend="triton", sliding_window=window, logits_soft_cap=cap,
                        softmax_scale=0.3)
    assert_close_rel(got, fast_reference(batch, 0.3, window, cap), 2e-3 if CUDA else 1e-5)


def _short_mix(kind: str) -> list:
    """A smaller batch than :func:`_seq_mix` (odd lengths, several blocks, a chunked prefill on a
    cached prefix and a decode row in the prefill batch) for the many-case tests."""
    s = SCALE
    if kind == "decode":
        return [(37 * s, 1), (5, 1), (20 * s + 3, 1)]
    return [(19 * s, 19 * s), (30 * s + 1, 5), (9, 1)]


#: (window, soft-cap) per format pair, so each kernel meets sinks alone and with both
SINK_OPTIONS = [(None, None), (9, None), (None, 3.0), (9, 3.0)]


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("i", range(4))
def test_sinks_every_format_pair(kind, i):
    """Attention sinks (gpt-oss: a per-head logit in the softmax denominator) in the decode and
    the prefill kernel, every K/V format pair, alone and with a sliding window and soft-cap,
    GQA 8:1, against float64."""
    (kf, vf), (window, cap) = FMT_PAIRS[i], SINK_OPTIONS[(i + (kind == "prefill")) % 4]
    lay = KVPageLayout(2, 64, 16, kf, vf)
    batch = make_batch(lay, _short_mix(kind), 16, device=DEV, seed=31 + i, write_backend=WRITE)
    sinks = random_sinks(16, seed=i, device=DEV)
    got = run_attention(batch, backend="triton", sliding_window=window, logits_soft_cap=cap,
                        softmax_scale=0.3, sinks=sinks)
    assert_close_rel(got, fast_reference(batch, 0.3, window, cap, sinks), 2e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("splits,window", [(4, None), (8, 21), (5, 21)])
def test_sinks_split_decode(splits, window):
    """With split-KV decode the sink enters the softmax once (the first split's partial), also
    when a window leaves some splits empty; bf16 sinks read as their FP32 values."""
    lay = KVPageLayout(2, 64, 16, "nvfp4", "nvfp4")
    batch = make_batch(lay, _short_mix("decode"), 6, device=DEV, seed=splits, write_backend=WRITE)
    sinks = random_sinks(6, seed=splits, device=DEV).bfloat16()
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, 1, batch.max_seq_len, 0.3, out, window, None,
        sinks, launch=_launch(lay, True, num_splits=splits, tile_n=16))
    want = fast_reference(batch, 0.3, window, None, sinks.float())
    assert_close_rel(out, want, 2e-3 if CUDA else 1e-5)


# (num_kv_heads, query heads per KV head, head_dim) of the hybrid models: Qwen3.5/3.6 16:2 and
# 24:4, gpt-oss 8:1 per KV head, Gemma 4's global layers at head_dim 512, MQA at head_dim 256
HYBRID_SHAPES = [(2, 8, 64), (4, 6, 64), (1, 8, 512), (1, 5, 256)]


#: GPU: every shape x every format pair; interpreter: one pair per shape and kind, rotating
HYBRID_CASES = (
    [(shape, j) for shape in range(len(HYBRID_SHAPES)) for j in range(4)]
    if CUDA else [(shape, shape) for shape in range(len(HYBRID_SHAPES))]
)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("i,j", HYBRID_CASES)
def test_hybrid_model_shapes(kind, i, j):
    """The GQA ratios and head dims of the hybrid / sliding-window models in both kernels (their
    default launch shapes), sinks on every other case, a window on the others."""
    hkv, group, d = HYBRID_SHAPES[i]
    kf, vf = FMT_PAIRS[(j + (kind == "prefill")) % 4]
    with_sinks = (j + (kind == "prefill")) % 2 == 0
    window = None if with_sinks else 13
    lay = KVPageLayout(hkv, d, 16, kf, vf)
    seqs = _short_mix(kind)
    if not CUDA and d > 256:  # the interpreter's head_dim 512 prefill runs a program per token
        seqs = seqs[1:]
    batch = make_batch(lay, seqs, hkv * group, device=DEV, seed=d + group, write_backend=WRITE)
    sinks = random_sinks(hkv * group, seed=d, device=DEV) if with_sinks else None
    scale = 1.0 / math.sqrt(d)
    got = run_attention(batch, backend="triton", sliding_window=window, sinks=sinks)
    assert_close_rel(got, fast_reference(batch, scale, window, None, sinks),
                     2e-3 if CUDA else 1e-5)


#: blocks that are not a power of 2: hybrid models' chosen full-attention blocks (48) and
#: vLLM's Mamba-aligned attention blocks (hundreds of tokens on Qwen3-Next-style models, e.g. 336
#: on the tiny one, 528 before our page was given to the alignment; 80 keeps the interpreter fast
#: and still straddles every tile)
ODD_BLOCKS = [(48, None, False), (80, 13, True), (528, None, True)]


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("b,window,with_sinks", ODD_BLOCKS)
def test_block_size_not_a_power_of_two(kind, b, window, with_sinks):
    """Block sizes that are multiples of 16 but not powers of 2, every K/V format pair across
    the cases, tiles straddling blocks, with a window or sinks."""
    i = ODD_BLOCKS.index((b, window, with_sinks))
    kf, vf = FMT_PAIRS[(i + (kind == "prefill")) % 4]
    lay = KVPageLayout(2, 64, b, kf, vf)
    # prefill: a whole prompt (at b = 528 its last 96 tokens, queries past the first block: the
    # interpreter's time grows with the query rows) and a short chunk after a context
    seqs = ([(b + 37, 1), (3, 1), (2 * b + 5, 1)] if kind == "decode"
            else [(b + 19, min(b + 19, 96)), (b + 40, 9)])
    batch = make_batch(lay, seqs, 8, device=DEV, seed=b, write_backend=WRITE)
    sinks = random_sinks(8, seed=b, device=DEV) if with_sinks else None
    got = run_attention(batch, backend="triton", sliding_window=window, sinks=sinks)
    assert_close_rel(got, fast_reference(batch, 0.125, window, None, sinks), 2e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("fold", [True, False], ids=["fold_k", "apart"])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_block_size_not_a_power_of_two_code_variants(fold, kind):
    """The per-token scale loads of a 48-token block with the K scales folded into the K planes
    and applied apart, NVFP4 K and V, split decode."""
    lay = KVPageLayout(2, 64, 48, "nvfp4", "nvfp4")
    decode = kind == "decode"
    seqs = [(101, 1), (3, 1), (50, 1)] if decode else [(67, 67), (90, 9)]
    batch = make_batch(lay, seqs, 8, device=DEV, seed=48 + fold, write_backend=WRITE)
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, batch.max_query_len, batch.max_seq_len, 0.1, out,
        launch=_launch(lay, decode, num_splits=2 if decode else None, fold_k_scales=fold))
    assert_close_rel(out, fast_reference(batch, 0.1), 2e-3 if CUDA else 1e-5)


@pytest.mark.skipif(not CUDA, reason="half-precision kernel math needs the GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_half_precision_full_size(dtype, kind):
    lay = KVPageLayout(8, 128, 16, "nvfp4", "nvfp4")
    seqs = [(4099, 1)] * 5 + [(1000, 1)] if kind == "decode" else [(2048, 2048), (3000, 300)]
    batch = make_batch(lay, seqs, 32, q_dtype=dtype, kv_dtype=dtype, device=DEV, seed=1,
                       write_backend=WRITE)
    got = run_attention(batch, backend="triton")
    assert got.dtype == dtype
    assert_close_rel(got, fast_reference(batch, 1.0 / math.sqrt(128)), 1e-2)
    torch_path = run_attention(batch, backend="torch")
    assert_close_rel(got, torch_path.double().cpu(), 1e-2)


@pytest.mark.skipif(not CUDA, reason="half-precision kernel math needs the GPU")
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("d,kf,vf", [(256, "nvfp4", "nvfp4"), (512, "nvfp4", "nvfp4"),
                                     (512, "fp8", "fp8"), (512, "nvfp4", "fp8")])
def test_hybrid_full_size_bf16(kind, d, kf, vf):
    """bf16 at full size, head_dim 256/512, GQA 8:1, sinks and a window of 1024 (Gemma 3's),
    against float64 and the torch path; the decode also in a CUDA graph."""
    lay = KVPageLayout(2, d, 16, kf, vf)
    seqs = [(4099, 1)] * 3 + [(700, 1)] if kind == "decode" else [(2048, 2048), (3000, 300)]
    batch = make_batch(lay, seqs, 16, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                       device=DEV, seed=d, write_backend=WRITE)
    sinks = random_sinks(16, seed=d, device=DEV)
    got = run_attention(batch, backend="triton", sliding_window=1024, sinks=sinks)
    assert_close_rel(got, fast_reference(batch, 1.0 / math.sqrt(d), 1024, None, sinks), 1e-2)
    torch_path = run_attention(batch, backend="torch", sliding_window=1024, sinks=sinks)
    assert_close_rel(got, torch_path.double().cpu(), 1e-2)
    if kind == "decode":
        out = torch.empty_like(batch.query)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.paged_attention(batch.query, batch.cache, lay, batch.k_scale, batch.v_scale,
                                batch.block_table, batch.seq_lens, batch.query_start_loc, 1,
                                batch.max_seq_len, 1.0 / math.sqrt(d), out, 1024, None, sinks)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need the GPU")
def test_decode_is_cuda_graph_capturable():
    lay = KVPageLayout(8, 128, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(2000, 1), (517, 1), (1500, 1)], 32, q_dtype=torch.bfloat16,
                       device=DEV, seed=2, write_backend=WRITE)
    out = torch.empty_like(batch.query)
    args = (batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
            batch.seq_lens, batch.query_start_loc, 1, 2048, 0.088, out)
    ops.paged_attention(*args)  # warm-up / compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_attention(*args)
    batch.seq_lens.copy_(torch.tensor([1999, 300, 1500], dtype=torch.int32))  # new contents
    graph.replay()
    torch.cuda.synchronize()
    eager = torch.empty_like(out)
    ops.paged_attention(*args[:-1], eager)
    assert torch.equal(out, eager)


@pytest.mark.skipif(not CUDA, reason="NaN decoding in the interpreter is not IEEE")
def test_nonfinite_kv_stays_local():
    lay = KVPageLayout(1, 64, 16, "nvfp4", "nvfp4")
    batch = make_batch(lay, [(40, 1), (40, 1)], 2, device=DEV, seed=4, write_backend=WRITE)
    bad = torch.randn(1, 1, 64, device=DEV)
    bad[0, 0, 5] = float("nan")
    slot = batch.block_table[0, 1].long() * 16 + 3  # token 19 of sequence 0
    ops.write_kv_cache(bad, bad, batch.cache, slot.view(1), lay, batch.k_scale, batch.v_scale)
    out = run_attention(batch, backend="triton")
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


# ---------------------------------------------------------------- dense dequantization (prefill)
@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
@pytest.mark.parametrize("h,d,b", [(2, 64, 16), (3, 128, 32), (1, 256, 16)])
def test_dequantize_kv_bit_exact(kf, vf, h, d, b):
    """Every sequence's dense K/V equals the torch path's FP32 dequantization bit for bit, rows
    placed at ``cu_seqlens``; rows outside the sequences stay untouched."""
    lay = KVPageLayout(h, d, b, kf, vf)
    batch = make_batch(lay, [(45 * SCALE, 3), (1, 1), (2 * b, 5), (b + 3, 2)], h, device=DEV,
                       seed=d + b, write_backend=WRITE)
    lens = batch.seq_lens.cpu()
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = (lens + 7).cumsum(0)  # gaps of 7 rows between sequences
    rows = int(cu[-1])
    outs = {}
    for backend in ("triton", "torch"):
        k = torch.full((rows, h, d), 1234.5, device=DEV)
        v = torch.full((rows, h, d), 1234.5, device=DEV)
        ops.dequantize_kv(batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
                          batch.seq_lens, cu.to(DEV), int(lens.max()), k, v, backend=backend)
        outs[backend] = (k.cpu(), v.cpu())
    for got, want in zip(outs["triton"], outs["torch"]):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    filled = torch.zeros(rows, dtype=torch.bool)
    for s, n in enumerate(lens.tolist()):
        filled[int(cu[s]) : int(cu[s]) + n] = True
    assert (outs["triton"][0][~filled] == 1234.5).all() and (outs["triton"][0][filled] != 1234.5).all()
    # the last two sequences alone (first_seq=2), packed from row 0: the same rows
    tail = torch.tensor([0, int(lens[2]), int(lens[2] + lens[3])], dtype=torch.int32)
    k = torch.empty(int(tail[-1]), h, d, device=DEV)
    v = torch.empty_like(k)
    ops.dequantize_kv(batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
                      batch.seq_lens, tail.to(DEV), int(lens.max()), k, v, first_seq=2,
                      backend="triton")
    for s, start in ((2, 0), (3, int(lens[2]))):
        n = int(lens[s])
        assert torch.equal(k.cpu()[start:start + n], outs["torch"][0][int(cu[s]):int(cu[s]) + n])
        assert torch.equal(v.cpu()[start:start + n], outs["torch"][1][int(cu[s]):int(cu[s]) + n])
    with pytest.raises(ValueError, match=r"sequences \[3, 5\) are not all in seq_lens"):
        ops.dequantize_kv(batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
                          batch.seq_lens, tail.to(DEV), int(lens.max()), k, v, first_seq=3)


@pytest.mark.parametrize("kf,vf", [("nvfp4", "fp8"), ("fp8", "nvfp4")])
def test_dequantize_kv_from_window_starts(kf, vf):
    """``seq_starts`` (a sliding window's first visible key per sequence): positions from there
    on, packed from each sequence's row, bit for bit the torch path's; nothing else written."""
    lay = KVPageLayout(2, 64, 16, kf, vf)
    batch = make_batch(lay, [(45 * SCALE, 3), (9, 1), (40 * SCALE + 3, 5)], 2, device=DEV,
                       seed=9, write_backend=WRITE)
    lens = batch.seq_lens.cpu()
    starts = torch.tensor([17 * SCALE, 0, 31 * SCALE], dtype=torch.int32)
    keys = lens - starts
    cu = torch.zeros(4, dtype=torch.int32)
    cu[1:] = keys.cumsum(0)
    outs = {}
    for backend in ("triton", "torch"):
        k = torch.full((int(cu[-1]) + 5, 2, 64), 1234.5, device=DEV)
        v = torch.full_like(k, 1234.5)
        ops.dequantize_kv(batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
                          batch.seq_lens, cu.to(DEV), int(keys.max()), k, v,
                          seq_starts=starts.to(DEV), backend=backend)
        outs[backend] = (k.cpu(), v.cpu())
    for got, want in zip(outs["triton"], outs["torch"]):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert (got[int(cu[-1]):] == 1234.5).all()
    k_all = torch.empty(int(lens[2]), 2, 64, device=DEV)  # sequence 2 alone, from position 0
    ops.dequantize_kv(batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
                      batch.seq_lens, torch.tensor([0, int(lens[2])], dtype=torch.int32, device=DEV),
                      int(lens[2]), k_all, torch.empty_like(k_all), first_seq=2, backend="torch")
    assert torch.equal(outs["triton"][0][int(cu[2]):int(cu[3])], k_all.cpu()[int(starts[2]):])


@pytest.mark.skipif(not CUDA, reason="the interpreter truncates FP32 -> bf16 instead of rounding")
def test_dequantize_kv_rounds_once_to_half_precision():
    lay = KVPageLayout(2, 64, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(37, 1), (70, 4)], 2, device=DEV, seed=5, write_backend=WRITE)
    cu = torch.tensor([0, 37, 107], dtype=torch.int32, device=DEV)
    k32, v32 = (torch.empty(107, 2, 64, device=DEV) for _ in range(2))
    ops.dequantize_kv(batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
                      batch.seq_lens, cu, 70, k32, v32, backend="torch")
    kb, vb = (torch.empty(107, 2, 64, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    ops.dequantize_kv(batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
                      batch.seq_lens, cu, 70, kb, vb, backend="triton")
    assert torch.equal(kb, k32.bfloat16()) and torch.equal(vb, v32.bfloat16())


# ---------------------------------------------------------------- the sink key stored uncentered
def _key0_shift(lay: KVPageLayout, seed: int) -> torch.Tensor:
    """A random non-zero ``key0_shift [H, D]`` (the last head 0: stored centered), large enough
    (q . shift ~ 9 logits at softmax scale 0.1) that position 0's weight changes the output of a
    2,000-key sequence by ~40% (an eighth of it: by 0.1%, below the GPU tolerance)."""
    gen = torch.Generator().manual_seed(seed)
    shift = torch.randn(lay.num_kv_heads, lay.head_dim, generator=gen) * 16.0
    if lay.num_kv_heads > 1:
        shift[-1] = 0.0
    return shift.to(DEV)


@pytest.mark.parametrize("kind,window,kf,vf", [
    ("decode", None, "nvfp4", "nvfp4"), ("decode", 40 * SCALE, "fp8", "nvfp4"),
    ("prefill", None, "nvfp4", "fp8"), ("prefill", 30 * SCALE, "fp8", "fp8")])
def test_key0_shift_matches_float64_and_the_torch_path(kind, window, kf, vf):
    """With ``key0_shift`` (the sink key stored uncentered) the kernels give position 0 the logit
    of ``k0 - shift``: against float64 on that key and against the torch path, decode (split,
    a one-token sequence, a window that hides position 0 from the long ones) and prefill (chunks
    from position 0 and later, whole tiles and partial ones); far from the result without it."""
    lay = KVPageLayout(3, 128, 16, kf, vf)
    seqs = ([(37 * SCALE + 5, 1), (1, 1), (20 * SCALE + 3, 1), (64 * SCALE + 1, 1)]
            if kind == "decode" else
            [(23 * SCALE, 23 * SCALE), (41 * SCALE, 9), (70 * SCALE + 3, 70 * SCALE + 3), (2, 2)])
    batch = make_batch(lay, seqs, 6, device=DEV, seed=11 + len(kind), write_backend=WRITE)
    shift = _key0_shift(lay, 5)
    decode = kind == "decode"
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, batch.max_query_len, batch.max_seq_len, 0.1, out,
        window, key0_shift=shift,
        launch=_launch(lay, decode, num_splits=2 if decode else None, tile_n=16))
    want = fast_reference(batch, 0.1, window, key0_shift=shift)
    tol = 2e-3 if CUDA else 1e-5
    assert_close_rel(out, want, tol)
    torch_out = torch.empty_like(batch.query)
    ops.paged_attention(batch.query, batch.cache, lay, batch.k_scale, batch.v_scale,
                        batch.block_table, batch.seq_lens, batch.query_start_loc,
                        batch.max_query_len, batch.max_seq_len, 0.1, torch_out, window,
                        backend="torch", key0_shift=shift)
    assert_close_rel(torch_out, want, 1e-5)
    assert_close_rel(out, torch_out.double().cpu(), tol)
    unshifted = fast_reference(batch, 0.1, window)
    assert (unshifted - want).norm() / want.norm() > 100 * tol


@pytest.mark.parametrize("mode,kind,window,kf,vf,parts", [
    ("in_loop", "decode", None, "nvfp4", "nvfp4", 1),
    ("in_loop", "decode", 30 * SCALE, "fp8", "nvfp4", 1),
    ("in_loop", "prefill", None, "nvfp4", "fp8", 1),
    ("after_loop", "decode", None, "nvfp4", "nvfp4", 1),
    ("after_loop", "decode", 30 * SCALE, "fp8", "nvfp4", 1),
    ("after_loop", "decode", None, "nvfp4", "fp8", 2),
    ("after_loop", "prefill", None, "nvfp4", "fp8", 1),
    ("after_loop", "prefill", 35 * SCALE, "fp8", "nvfp4", 2)])
def test_key0_in_loop_and_after_loop_equal_the_peeled_tile(mode, kind, window, kf, vf, parts):
    """``key0_in_loop`` (the correction inside the pipelined tile loop) gives the peeled first
    tile's result (the same arithmetic, tiles in the same order); ``key0_after_loop`` (the loop
    without it, then position 0's weight moved from one K and one V row) gives it to FP32
    rounding, head-dim parts and windows that hide position 0 from later queries included; both
    give the correction itself."""
    lay = KVPageLayout(2, 128, 16, kf, vf)
    seqs = ([(90 * SCALE + 7, 1), (5, 1), (33 * SCALE, 1)] if kind == "decode" else
            [(40 * SCALE, 40 * SCALE), (50 * SCALE + 3, 11)])
    batch = make_batch(lay, seqs, 4, device=DEV, seed=31, write_backend=WRITE)
    shift = _key0_shift(lay, 8)
    decode = kind == "decode"
    outs = []
    for on in (False, True):
        out = torch.empty_like(batch.query)
        launch = _launch(lay, decode, num_splits=3 if decode else None, num_warps=max(parts, 1),
                         dim_parts=parts, **{f"key0_{mode}": on})
        attn_kernels.paged_attention(
            batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
            batch.seq_lens, batch.query_start_loc, batch.max_query_len, batch.max_seq_len, 0.1,
            out, window, key0_shift=shift, launch=launch)
        outs.append(out)
    if CUDA or mode == "after_loop":  # other FP32 sums (the pipelined loop; one weight moved)
        assert_close_rel(outs[1], outs[0].double().cpu(), 1e-5)
    else:
        assert torch.equal(outs[0], outs[1])
    assert_close_rel(outs[1], fast_reference(batch, 0.1, window, key0_shift=shift),
                     2e-3 if CUDA else 1e-5)


def test_key0_correction_ways_are_exclusive():
    """``key0_in_loop`` and ``key0_after_loop`` are two ways of one correction: a launch shape
    with both is refused."""
    lay = KVPageLayout(2, 128, 16, "nvfp4", "nvfp4")
    with pytest.raises(ValueError, match="set at most one"):
        _launch(lay, True, key0_in_loop=True, key0_after_loop=True)


@pytest.mark.parametrize("kf,vf", [("nvfp4", "nvfp4"), ("nvfp4", "fp8")])
def test_key0_shift_in_the_default_decode_launch(kf, vf):
    """The production launch shape (pipelined stages, folded scales, splits from the heuristic)
    with the correction, against float64."""
    lay = KVPageLayout(2, 128, 16, kf, vf)
    batch = make_batch(lay, [(300 * SCALE + 7, 1), (3, 1), (64 * SCALE, 1)], 8, device=DEV,
                       seed=23, write_backend=WRITE)
    shift = _key0_shift(lay, 6)
    out = torch.empty_like(batch.query)
    attn_kernels.paged_attention(
        batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
        batch.seq_lens, batch.query_start_loc, 1, batch.max_seq_len, 0.1, out, key0_shift=shift)
    assert_close_rel(out, fast_reference(batch, 0.1, key0_shift=shift), 2e-3 if CUDA else 1e-5)


@pytest.mark.parametrize("kf,vf", [("nvfp4", "fp8"), ("fp8", "nvfp4")])
def test_dequantize_kv_key0_shift_bit_exact(kf, vf):
    """Dense K with ``key0_shift``: bit for bit the torch path's, position 0 of each sequence
    shifted (its FP32 decoding minus the shift) and nothing else; a window start past position 0
    shifts nothing; V never."""
    lay = KVPageLayout(2, 64, 16, kf, vf)
    batch = make_batch(lay, [(45 * SCALE, 3), (1, 1), (40 * SCALE + 3, 5)], 2, device=DEV,
                       seed=3, write_backend=WRITE)
    shift = _key0_shift(lay, 7)
    lens = batch.seq_lens.cpu()
    for starts in (None, torch.tensor([0, 0, 17 * SCALE], dtype=torch.int32)):
        keys = lens if starts is None else lens - starts
        cu = torch.zeros(4, dtype=torch.int32)
        cu[1:] = keys.cumsum(0)
        outs = {}
        for backend, key0 in (("triton", shift), ("torch", shift), ("plain", None)):
            k = torch.full((int(cu[-1]), 2, 64), 1234.5, device=DEV)
            v = torch.full_like(k, 1234.5)
            ops.dequantize_kv(batch.cache, lay, batch.k_scale, batch.v_scale, batch.block_table,
                              batch.seq_lens, cu.to(DEV), int(keys.max()), k, v,
                              seq_starts=None if starts is None else starts.to(DEV),
                              backend="torch" if backend == "plain" else backend, key0_shift=key0)
            outs[backend] = (k.cpu(), v.cpu())
        for got, want in zip(outs["triton"], outs["torch"]):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        plain_k = outs["plain"][0]
        first = torch.zeros(int(cu[-1]), dtype=torch.bool)
        for s in range(3):
            if starts is None or int(starts[s]) == 0:
                first[int(cu[s])] = True
        assert torch.equal(outs["torch"][0][first], plain_k[first] - shift.cpu())
        assert torch.equal(outs["torch"][0][~first], plain_k[~first])
        assert torch.equal(outs["torch"][1], outs["plain"][1])


@triton.jit
def _doubled(x):
    return x * 2.0


@triton.jit
def _nested_call_kernel(x_ptr, y_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y_ptr + o, _doubled(tl.load(x_ptr + o)) + tl.zeros([N], tl.float32))


@pytest.mark.skipif(CUDA, reason="the Triton interpreter runs the kernels only without a GPU here")
def test_interpreter_speedup_is_in_force_and_a_launch_restores_the_language():
    """The test suite's interpreter speed-up (``interpreter_speedup``, installed by conftest) took
    on this Triton; a kernel with nested ``@triton.jit`` calls computes what it should, and its
    launch leaves no mark on ``triton.language``."""
    import interpreter_speedup
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "_skips_nested", False), "conftest's install() did not take"
    x = torch.randn(16, generator=torch.Generator().manual_seed(3)) + 0.5
    y = torch.empty_like(x)
    _nested_call_kernel[(1,)](x, y, 16)
    assert torch.equal(y, x * 2)
    assert not hasattr(tl, interpreter_speedup._MARK)
