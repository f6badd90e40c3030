"""PROTOTYPE, measured by compile only (no GPU has run it yet): the K side of an NVFP4 decode on
FP8 tensor cores, in Gluon (Triton's explicit-layout dialect, ``triton.experimental.gluon``).

Not used by the backend. Two kernels compute the exact decode scores ``S[q, n] = q . k_n`` of one
KV head's GQA group against every key of a paged NVFP4 K cache (:mod:`vllm_nvfp4.layout`), so
that their whole-tile loops can be compiled for sm_90 and their SASS counted against today's
kernel (``benchmarks/compile_gluon_sm90.py``), and checked on a GPU against the float64
reference (``tests/test_gluon_qk.py``):

* :func:`nvfp4_qk_scores_kernel`: ``mma.sync.m16n8k32.e4m3`` (``mma_v2``), 1 warp, keys on M,
  8 query columns on N.
* :func:`nvfp4_qk_scores_wgmma_kernel`: ``wgmma.m64n16k32.e4m3`` (``warpgroup_mma``), 4 warps,
  A (keys) from registers, the query operand in shared memory.

How both map NVFP4 onto an FP8 MMA (k = bytes of the cache row):

* A (keys x 32 bytes = one 64-element group of the chunk-planar row): each 32-bit register holds
  4 bytes of a key; one inline asm turns it by bit placement into two registers of 4 E4M3 bytes,
  the low nibbles and the high nibbles, each exactly ``e2m1 * 2^-6`` (5 integer ops per 8
  elements). In the chunk-planar order byte ``b`` of a group holds element ``32 (b % 2) + b // 2``
  (low nibble, block ``2 (b % 2)``) and ``16 +`` that (high nibble, block ``2 (b % 2) + 1``).
* B: the query gathered in that element order, as E4M3 ``hi + lo`` (``hi = e4m3(q / qs)``,
  ``lo = e4m3(q / qs - hi)``, ``qs = max|q| / 448`` of the group: about 8 significant bits, like
  bf16; two MMAs chained into one accumulator), zeroed on the bytes of the other block: one plane
  and byte parity is exactly one 16-block, so each partial score belongs to one block scale,
  which is never rounded.
* Each partial score is multiplied by its key's block scale (FP32) and summed: exact NVFP4. The
  ``mma.sync`` kernel runs one MMA pair per block; the wgmma kernel puts both parities side by
  side on N (16 columns) and runs one pair per group and plane.

Cache words are loaded straight into registers (no ``cp.async`` or TMA pipeline). Whole tiles of
``TILE_N`` keys run unmasked; the tail is masked.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                            warpgroup_mma_wait)

#: bytes of one chunk-planar group of 64 elements: the k extent of one FP8 MMA
GROUP_BYTES = ttgl.constexpr(32)
#: bit placement of E2M1 nibbles into E4M3 bytes (value e2m1 * 2^-6): $0 low, $1 high nibbles
_E2M1_TO_E4M3 = ttgl.constexpr("""{
.reg .b32 t, u;
shl.b32 t, $2, 4;
shl.b32 u, $2, 2;
and.b32 t, t, 0x80808080;
and.b32 u, u, 0x1C1C1C1C;
or.b32 $0, t, u;
shr.b32 t, $2, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, $2, 0x80808080;
or.b32 $1, u, t;
}""")
#: ``2^6``: the bit-placed E4M3 bytes are ``e2m1 * 2^-6``
E2M1_BIT_PLACEMENT_SCALE = ttgl.constexpr(64.0)


@gluon.jit
def _query_operand(q_cols, col_ok, qs, GROUP: ttgl.constexpr, HI: ttgl.constexpr,
                   PARITY: ttgl.constexpr, LAYOUT: ttgl.constexpr):
    """B operand ``[32 bytes, 8 columns]`` E4M3 (hi, lo) of the query elements behind the bytes of
    group ``GROUP``, plane ``HI`` (0: low nibbles, 1: high), zero off byte parity ``PARITY``."""
    b = ttgl.arange(0, GROUP_BYTES, layout=ttgl.SliceLayout(1, LAYOUT))
    elem = 64 * GROUP + 32 * (b % 2) + b // 2 + 16 * HI
    keep = (b % 2) == PARITY
    ptrs = q_cols[None, :] + elem[:, None]
    q = ttgl.load(ptrs, mask=keep[:, None] & col_ok[None, :], other=0.0).to(ttgl.float32) / qs
    hi = q.to(ttgl.float8e4nv)
    lo = (q - hi.to(ttgl.float32)).to(ttgl.float8e4nv)
    return hi, lo


@gluon.jit
def _load(ptrs, ok, MASKED: ttgl.constexpr):
    """``ptrs``' values; where ``MASKED``, 0 outside ``ok``."""
    if MASKED:
        return ttgl.load(ptrs, mask=ok, other=0)
    else:
        return ttgl.load(ptrs)


@gluon.jit
def _query_scale(q_row_ptr, stride_qh, G: ttgl.constexpr, D: ttgl.constexpr,
                 WARPS: ttgl.constexpr):
    """``max |q| / 448`` over the ``G`` query heads from ``q_row_ptr`` (FP32 scalar, > 0), in a
    program of ``WARPS`` warps."""
    d = ttgl.arange(0, D, layout=ttgl.SliceLayout(0, ttgl.BlockedLayout([1, 1], [1, 32],
                                                                        [1, WARPS], [1, 0])))
    qabs = ttgl.max(ttgl.abs(ttgl.load(q_row_ptr + d)).to(ttgl.float32), axis=0)
    for h in ttgl.static_range(1, G):
        qabs = ttgl.maximum(qabs, ttgl.max(ttgl.abs(ttgl.load(q_row_ptr + h * stride_qh + d))
                                           .to(ttgl.float32), axis=0))
    return ttgl.maximum(qabs, 1e-30) / 448.0


@gluon.jit
def _emit(out_ptr, scores, run_max, seq, kv_head, tile_start, seq_len, stride_os, stride_oh,
          MASKED: ttgl.constexpr, G: ttgl.constexpr, TILE_N: ttgl.constexpr,
          WRITE_SCORES: ttgl.constexpr):
    """Consume the scores ``[TILE_N, 8]`` (any layout) of keys ``tile_start ..``: with
    ``WRITE_SCORES`` write them to ``out[seq, kv_head * G + h, tile_start + n]`` (``h < G``,
    keys below ``seq_len``), else fold them into the running max ``run_max [TILE_N, 8]`` (same
    layout; reduced over keys once, by :func:`_store_max`). Returns the running max."""
    layout: ttgl.constexpr = scores.type.layout
    rows = tile_start + ttgl.arange(0, TILE_N, layout=ttgl.SliceLayout(1, layout))
    cols = ttgl.arange(0, 8, layout=ttgl.SliceLayout(0, layout))
    if WRITE_SCORES:
        ptrs = (out_ptr + seq.to(ttgl.int64) * stride_os
                + (kv_head * G + cols)[None, :] * stride_oh + rows[:, None])
        ok = (cols < G)[None, :]
        if MASKED:
            ok = ok & (rows < seq_len)[:, None]
        ttgl.store(ptrs, scores, mask=ok)
        return run_max
    else:
        if MASKED:
            scores = ttgl.where((rows < seq_len)[:, None], scores, float("-inf"))
        return ttgl.maximum(run_max, scores)


@gluon.jit
def _tile_range(seq_len, TILE_N: ttgl.constexpr, NUM_SPLITS: ttgl.constexpr):
    """``(first, end_of_whole, tail)`` tiles of this program's split (program axis 2): whole
    tiles ``first .. end_of_whole - 1``; ``tail`` whether the masked last tile is also its own."""
    tiles = (seq_len + TILE_N - 1) // TILE_N
    per = (tiles + NUM_SPLITS - 1) // NUM_SPLITS
    first = ttgl.program_id(2) * per
    end = ttgl.minimum(first + per, tiles)
    whole = seq_len // TILE_N
    return first, ttgl.minimum(end, whole), (whole < end) & (whole >= first) & (whole < tiles)


@gluon.jit
def _store_max(out_ptr, run_max, seq, kv_head, stride_os, stride_oh, G: ttgl.constexpr,
               WRITE_SCORES: ttgl.constexpr):
    """Without ``WRITE_SCORES``: ``out[seq, kv_head * G + h, split]`` = the largest
    ``run_max[:, h]`` (``h < G``)."""
    if not WRITE_SCORES:
        col_max = ttgl.max(run_max, axis=0)
        cols = ttgl.arange(0, 8, layout=col_max.type.layout)
        ttgl.store(out_ptr + seq.to(ttgl.int64) * stride_os + (kv_head * G + cols) * stride_oh
                   + ttgl.program_id(2), col_max, mask=cols < G)


@gluon.jit
def _block_scale(scale_words, BLOCK_INDEX: ttgl.constexpr):
    """FP32 block scale ``BLOCK_INDEX`` of each key from its 8 token-major scale bytes."""
    byte = ((scale_words >> (8 * BLOCK_INDEX)) & 0xFF).to(ttgl.uint8)
    return byte.to(ttgl.float8e4nv, bitcast=True).to(ttgl.float32)


@gluon.jit
def _tile_scale_words(cache_ptr, block_table_row, tile_start, seq_len, stride_blk, kv_head,
                      MASKED: ttgl.constexpr, BLOCK: ttgl.constexpr, D: ttgl.constexpr,
                      K_SCALE: ttgl.constexpr, TILE_N: ttgl.constexpr, ROWS: ttgl.constexpr):
    """int64 ``[TILE_N]`` (layout ``ROWS``): the 8 token-major block-scale bytes of each key
    ``tile_start ..`` (0 past ``seq_len`` where ``MASKED``)."""
    rows = tile_start + ttgl.arange(0, TILE_N, layout=ROWS)
    blk = _load(block_table_row + rows // BLOCK, rows < seq_len, MASKED)
    off = blk.to(ttgl.int64) * stride_blk + K_SCALE + (kv_head * BLOCK + rows % BLOCK) * (D // 16)
    return _load((cache_ptr + off).to(ttgl.pointer_type(ttgl.int64), bitcast=True),
                 rows < seq_len, MASKED)


@gluon.jit
def _group_operands(cache_ptr, block_table_row, tile_start, seq_len, stride_blk, kv_head,
                    GROUP: ttgl.constexpr, MASKED: ttgl.constexpr, BLOCK: ttgl.constexpr,
                    D: ttgl.constexpr, K_DATA: ttgl.constexpr, TILE_N: ttgl.constexpr,
                    A_LAYOUT: ttgl.constexpr):
    """``(low, high)`` nibble planes, E4M3 ``[TILE_N, 32]`` in ``A_LAYOUT``, of the 32 bytes of
    group ``GROUP`` of keys ``tile_start ..`` (bit placement: ``e2m1 * 2^-6``)."""
    rows = tile_start + ttgl.arange(0, TILE_N, layout=ttgl.SliceLayout(1, A_LAYOUT))
    blk = _load(block_table_row + rows // BLOCK, rows < seq_len, MASKED)
    row = blk.to(ttgl.int64) * stride_blk + K_DATA + (kv_head * BLOCK + rows % BLOCK) * (D // 2)
    cols = GROUP * GROUP_BYTES + ttgl.arange(0, GROUP_BYTES, layout=ttgl.SliceLayout(0, A_LAYOUT))
    words = _load(cache_ptr + row[:, None] + cols[None, :], (rows < seq_len)[:, None], MASKED)
    return ttgl.inline_asm_elementwise(_E2M1_TO_E4M3, "=r,=r,r", [words],
                                       dtype=(ttgl.float8e4nv, ttgl.float8e4nv), is_pure=True,
                                       pack=4)


@gluon.jit
def _tile_scores(cache_ptr, block_table_row, tile_start, seq_len, stride_blk, kv_head,
                 bq, MASKED: ttgl.constexpr, BLOCK: ttgl.constexpr, D: ttgl.constexpr,
                 K_DATA: ttgl.constexpr, K_SCALE: ttgl.constexpr, TILE_N: ttgl.constexpr,
                 MMA: ttgl.constexpr, A_LAYOUT: ttgl.constexpr):
    """Scores ``[TILE_N, 8]`` (MMA layout, FP32, before the query and 2^6 factors) of the keys
    ``tile_start ..`` against the query operands ``bq[group][plane][parity] = (hi, lo)``."""
    scale_words = _tile_scale_words(cache_ptr, block_table_row, tile_start, seq_len, stride_blk,
                                    kv_head, MASKED, BLOCK, D, K_SCALE, TILE_N,
                                    ttgl.SliceLayout(1, MMA))

    acc = ttgl.zeros([TILE_N, 8], ttgl.float32, layout=MMA)
    for g in ttgl.static_range(D // 64):
        lo, hi = _group_operands(cache_ptr, block_table_row, tile_start, seq_len, stride_blk,
                                 kv_head, g, MASKED, BLOCK, D, K_DATA, TILE_N, A_LAYOUT)
        for plane in ttgl.static_range(2):
            a = hi if plane == 1 else lo
            for parity in ttgl.static_range(2):
                q_hi, q_lo = bq[g][plane][parity]
                part = mma_v2(a, q_hi, ttgl.zeros([TILE_N, 8], ttgl.float32, layout=MMA))
                part = mma_v2(a, q_lo, part)
                s = _block_scale(scale_words, 4 * g + 2 * parity + plane)
                acc += part * s[:, None]
    return acc


@gluon.jit
def _scan_keys(TILE_FN: ttgl.constexpr, out_ptr, cache_ptr, block_table_row, seq, kv_head,
               seq_len, stride_os, stride_oh, stride_blk, bq, k_scale, run_max,
               G: ttgl.constexpr, BLOCK: ttgl.constexpr, D: ttgl.constexpr,
               K_DATA: ttgl.constexpr, K_SCALE: ttgl.constexpr, TILE_N: ttgl.constexpr,
               NUM_SPLITS: ttgl.constexpr, WRITE_SCORES: ttgl.constexpr, MMA: ttgl.constexpr,
               A_LAYOUT: ttgl.constexpr):
    """This program's split of the keys: whole tiles unmasked, then the masked tail tile, each
    scored by ``TILE_FN`` (:func:`_tile_scores` or :func:`_tile_scores_wgmma`), times
    ``k_scale``, and written or folded into ``run_max`` (:func:`_emit`, :func:`_store_max`)."""
    first, end_whole, tail = _tile_range(seq_len, TILE_N, NUM_SPLITS)
    for t in range(first, end_whole):
        acc = TILE_FN(cache_ptr, block_table_row, t * TILE_N, seq_len, stride_blk, kv_head, bq,
                      False, BLOCK, D, K_DATA, K_SCALE, TILE_N, MMA, A_LAYOUT)
        run_max = _emit(out_ptr, acc * k_scale, run_max, seq, kv_head, t * TILE_N, seq_len,
                        stride_os, stride_oh, False, G, TILE_N, WRITE_SCORES)
    if tail:
        start = (seq_len // TILE_N) * TILE_N
        acc = TILE_FN(cache_ptr, block_table_row, start, seq_len, stride_blk, kv_head, bq, True,
                      BLOCK, D, K_DATA, K_SCALE, TILE_N, MMA, A_LAYOUT)
        run_max = _emit(out_ptr, acc * k_scale, run_max, seq, kv_head, start, seq_len,
                        stride_os, stride_oh, True, G, TILE_N, WRITE_SCORES)
    _store_max(out_ptr, run_max, seq, kv_head, stride_os, stride_oh, G, WRITE_SCORES)


@gluon.jit
def nvfp4_qk_scores_kernel(
    query_ptr, out_ptr, cache_ptr, k_scale_ptr, block_table_ptr, seq_lens_ptr,
    stride_qt, stride_qh, stride_os, stride_oh, stride_blk, stride_bt,
    G: ttgl.constexpr, D: ttgl.constexpr, BLOCK: ttgl.constexpr,
    K_DATA: ttgl.constexpr, K_SCALE: ttgl.constexpr, TILE_N: ttgl.constexpr,
    NUM_SPLITS: ttgl.constexpr, WRITE_SCORES: ttgl.constexpr,
):
    """Scores ``query[s, h] . K[s, n]`` (FP32) for each sequence ``s`` (program axis 0), KV head
    (axis 1), query head ``h`` of its group and key ``n < seq_len``, K the exact NVFP4 decoding
    (``e2m1 * block scale * k_scale``); axis 2 splits the keys into ``NUM_SPLITS`` ranges of
    whole tiles. ``WRITE_SCORES``: ``out[s, h, n]`` = the score; else ``out[s, h, split]`` = the
    largest score of the split (``-inf`` if it has no keys): the K side alone, for timing."""
    MMA: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                      instr_shape=[16, 8])
    A_LAYOUT: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B_LAYOUT: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    ttgl.static_assert(D == 128, "the prototype reads a token's 8 block scales as one word")
    seq = ttgl.program_id(0)
    kv_head = ttgl.program_id(1)
    seq_len = ttgl.load(seq_lens_ptr + seq)
    block_table_row = block_table_ptr + seq.to(ttgl.int64) * stride_bt

    col = ttgl.arange(0, 8, layout=ttgl.SliceLayout(0, B_LAYOUT))
    col_ok = col < G
    q_row_ptr = query_ptr + seq.to(ttgl.int64) * stride_qt + (kv_head * G) * stride_qh
    q_cols = q_row_ptr + col * stride_qh
    qs = _query_scale(q_row_ptr, stride_qh, G, D, 1)
    bq = (((_query_operand(q_cols, col_ok, qs, 0, 0, 0, B_LAYOUT),
            _query_operand(q_cols, col_ok, qs, 0, 0, 1, B_LAYOUT)),
           (_query_operand(q_cols, col_ok, qs, 0, 1, 0, B_LAYOUT),
            _query_operand(q_cols, col_ok, qs, 0, 1, 1, B_LAYOUT))),
          ((_query_operand(q_cols, col_ok, qs, 1, 0, 0, B_LAYOUT),
            _query_operand(q_cols, col_ok, qs, 1, 0, 1, B_LAYOUT)),
           (_query_operand(q_cols, col_ok, qs, 1, 1, 0, B_LAYOUT),
            _query_operand(q_cols, col_ok, qs, 1, 1, 1, B_LAYOUT))))  # [group][plane][parity]

    k_scale = ttgl.load(k_scale_ptr + kv_head) * qs * E2M1_BIT_PLACEMENT_SCALE
    run_max = ttgl.full([TILE_N, 8], float("-inf"), ttgl.float32, layout=MMA)
    _scan_keys(_tile_scores, out_ptr, cache_ptr, block_table_row, seq, kv_head, seq_len,
               stride_os, stride_oh, stride_blk, bq, k_scale, run_max, G, BLOCK, D, K_DATA,
               K_SCALE, TILE_N, NUM_SPLITS, WRITE_SCORES, MMA, A_LAYOUT)


# ---------------------------------------------------------------------------- wgmma variant
@gluon.jit
def _query_tile_wgmma(q_row_ptr, stride_qh, qs, G: ttgl.constexpr, GROUP: ttgl.constexpr,
                      HI: ttgl.constexpr, LO_HALF: ttgl.constexpr, LAYOUT: ttgl.constexpr):
    """``[16 columns, 32 bytes]`` E4M3 query operand of group ``GROUP``, plane ``HI``: column
    ``8 parity + h`` holds query head ``h``'s elements behind the bytes of that parity (zero
    elsewhere), as the E4M3 ``hi`` part of ``q / qs`` or, with ``LO_HALF``, the ``lo`` part."""
    n = ttgl.arange(0, 16, layout=ttgl.SliceLayout(1, LAYOUT))
    b = ttgl.arange(0, GROUP_BYTES, layout=ttgl.SliceLayout(0, LAYOUT))
    head = n % 8
    elem = 64 * GROUP + 32 * (b % 2) + b // 2 + 16 * HI
    keep = ((b[None, :] % 2) == (n[:, None] // 8)) & (head < G)[:, None]
    x = ttgl.load(q_row_ptr + head[:, None] * stride_qh + elem[None, :], mask=keep,
                  other=0.0).to(ttgl.float32) / qs
    hi = x.to(ttgl.float8e4nv)
    if LO_HALF:
        return (x - hi.to(ttgl.float32)).to(ttgl.float8e4nv)
    else:
        return hi


@gluon.jit
def _query_smem(q_row_ptr, stride_qh, qs, G: ttgl.constexpr, GROUP: ttgl.constexpr,
                HI: ttgl.constexpr, LAYOUT: ttgl.constexpr, SMEM: ttgl.constexpr):
    """``(hi, lo)`` shared-memory copies of :func:`_query_tile_wgmma`, viewed as ``[32, 16]``."""
    hi = ttgl.allocate_shared_memory(ttgl.float8e4nv, [16, GROUP_BYTES], SMEM,
                                     _query_tile_wgmma(q_row_ptr, stride_qh, qs, G, GROUP, HI,
                                                       False, LAYOUT))
    lo = ttgl.allocate_shared_memory(ttgl.float8e4nv, [16, GROUP_BYTES], SMEM,
                                     _query_tile_wgmma(q_row_ptr, stride_qh, qs, G, GROUP, HI,
                                                       True, LAYOUT))
    return hi.permute((1, 0)), lo.permute((1, 0))


@gluon.jit
def _parity_split(part, TILE_N: ttgl.constexpr):
    """``[TILE_N, 16]`` (columns parity, head) -> its two ``[TILE_N, 8]`` halves (register-local)."""
    return part.reshape([TILE_N, 2, 8]).permute((0, 2, 1)).split()


@gluon.jit
def _add_scaled_wgmma(acc, part, scale_words, BLOCK_EVEN: ttgl.constexpr, TILE_N: ttgl.constexpr):
    """``acc [TILE_N, 8]`` plus the scores of one wgmma result ``part [TILE_N, 16]`` (columns
    parity, head): ``sum over parity of scale(block of that parity) * part``."""
    p0, p1 = _parity_split(part, TILE_N)
    rows: ttgl.constexpr = ttgl.SliceLayout(1, p0.type.layout)
    s0 = ttgl.convert_layout(_block_scale(scale_words, BLOCK_EVEN), rows)
    s1 = ttgl.convert_layout(_block_scale(scale_words, BLOCK_EVEN + 2), rows)
    if acc is None:
        return s0[:, None] * p0 + s1[:, None] * p1
    else:
        return ttgl.fma(s1[:, None], p1, ttgl.fma(s0[:, None], p0, acc))


@gluon.jit
def _tile_scores_wgmma(cache_ptr, block_table_row, tile_start, seq_len, stride_blk, kv_head,
                       bq, MASKED: ttgl.constexpr, BLOCK: ttgl.constexpr, D: ttgl.constexpr,
                       K_DATA: ttgl.constexpr, K_SCALE: ttgl.constexpr, TILE_N: ttgl.constexpr,
                       MMA: ttgl.constexpr, A_LAYOUT: ttgl.constexpr):
    """Scores ``[TILE_N, 8]`` (before the query and 2^6 factors) of keys ``tile_start ..``
    against the shared-memory query operands ``bq[group][plane]`` (:func:`_query_tile_wgmma`)."""
    scale_words = _tile_scale_words(cache_ptr, block_table_row, tile_start, seq_len, stride_blk,
                                    kv_head, MASKED, BLOCK, D, K_SCALE, TILE_N,
                                    ttgl.SliceLayout(1, MMA))

    zero = ttgl.zeros([TILE_N, 16], ttgl.float32, layout=MMA)
    parts = ()  # [group * 2 + plane], in flight until the one wait below
    for g in ttgl.static_range(D // 64):
        lo, hi = _group_operands(cache_ptr, block_table_row, tile_start, seq_len, stride_blk,
                                 kv_head, g, MASKED, BLOCK, D, K_DATA, TILE_N, A_LAYOUT)
        for plane in ttgl.static_range(2):
            a = hi if plane == 1 else lo
            q_hi, q_lo = bq[g][plane]
            part = warpgroup_mma(a, q_hi, zero, use_acc=False, is_async=True)
            parts = parts + (warpgroup_mma(a, q_lo, part, is_async=True), )
    acc = None
    for i in ttgl.static_range(2 * (D // 64)):  # part i is wgmma 2i + 1 of 2 * len(parts)
        part = warpgroup_mma_wait(2 * (2 * (D // 64) - 1 - i), deps=[parts[i]])
        acc = _add_scaled_wgmma(acc, part, scale_words, 4 * (i // 2) + i % 2, TILE_N)
    return acc


@gluon.jit
def nvfp4_qk_scores_wgmma_kernel(
    query_ptr, out_ptr, cache_ptr, k_scale_ptr, block_table_ptr, seq_lens_ptr,
    stride_qt, stride_qh, stride_os, stride_oh, stride_blk, stride_bt,
    G: ttgl.constexpr, D: ttgl.constexpr, BLOCK: ttgl.constexpr,
    K_DATA: ttgl.constexpr, K_SCALE: ttgl.constexpr, TILE_N: ttgl.constexpr,
    NUM_SPLITS: ttgl.constexpr, WRITE_SCORES: ttgl.constexpr,
):
    """:func:`nvfp4_qk_scores_kernel` on FP8 ``wgmma`` (4 warps, 64 keys per tile, m64n16k32,
    issued asynchronously, one wait per tile): the query operands of both byte parities sit side
    by side on N (16 columns), so per group and plane one chained pair (hi, lo) replaces the
    2 x 2 MMAs of the ``mma.sync`` variant."""
    ttgl.static_assert(D == 128, "the prototype reads a token's 8 block scales as one word")
    ttgl.static_assert(TILE_N == 64, "one warpgroup: 64 keys")
    MMA: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 16, 32])
    A_LAYOUT: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    Q_LAYOUT: ttgl.constexpr = ttgl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    SMEM: ttgl.constexpr = ttgl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8)
    seq = ttgl.program_id(0)
    kv_head = ttgl.program_id(1)
    seq_len = ttgl.load(seq_lens_ptr + seq)
    block_table_row = block_table_ptr + seq.to(ttgl.int64) * stride_bt
    q_row_ptr = query_ptr + seq.to(ttgl.int64) * stride_qt + (kv_head * G) * stride_qh
    qs = _query_scale(q_row_ptr, stride_qh, G, D, 4)
    bq = ((_query_smem(q_row_ptr, stride_qh, qs, G, 0, 0, Q_LAYOUT, SMEM),
           _query_smem(q_row_ptr, stride_qh, qs, G, 0, 1, Q_LAYOUT, SMEM)),
          (_query_smem(q_row_ptr, stride_qh, qs, G, 1, 0, Q_LAYOUT, SMEM),
           _query_smem(q_row_ptr, stride_qh, qs, G, 1, 1, Q_LAYOUT, SMEM)))  # [group][plane]
    fence_async_shared()
    k_scale = ttgl.load(k_scale_ptr + kv_head) * qs * E2M1_BIT_PLACEMENT_SCALE
    run_max, _ = _parity_split(ttgl.full([TILE_N, 16], float("-inf"), ttgl.float32, layout=MMA),
                               TILE_N)
    _scan_keys(_tile_scores_wgmma, out_ptr, cache_ptr, block_table_row, seq, kv_head, seq_len,
               stride_os, stride_oh, stride_blk, bq, k_scale, run_max, G, BLOCK, D, K_DATA,
               K_SCALE, TILE_N, NUM_SPLITS, WRITE_SCORES, MMA, A_LAYOUT)


#: prototype name -> (kernel, warps per program)
PROTOTYPES = {"mma_v2": (nvfp4_qk_scores_kernel, 1), "wgmma": (nvfp4_qk_scores_wgmma_kernel, 4)}
