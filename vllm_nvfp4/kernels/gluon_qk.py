"""PROTOTYPE, measured by compile only (no GPU has run it yet): the K side of an NVFP4 decode on
FP8 tensor cores, in Gluon (Triton's explicit-layout dialect, ``triton.experimental.gluon``).

Not used by the backend. It computes the exact decode scores ``S[q, n] = q . k_n`` of one KV
head's GQA group against every key of a paged NVFP4 K cache (:mod:`vllm_nvfp4.layout`), so that
its whole-tile loop can be compiled for sm_90 and its SASS counted against today's kernel
(``benchmarks/compile_gluon_sm90.py``), and checked on a GPU against the float64 reference
(``tests/test_gluon_qk.py``).

How it maps NVFP4 onto ``mma.sync.m16n8k32.e4m3`` (keys on M, 8 query columns on N, k = bytes):

* A (keys x 32 bytes = one 64-element group of the chunk-planar row): each 32-bit register holds
  4 bytes of a key; one inline asm turns it by bit placement into two registers of 4 E4M3 bytes,
  the low nibbles and the high nibbles, each exactly ``e2m1 * 2^-6`` (5 integer ops per 8
  elements). In the chunk-planar order byte ``b`` of a group holds element ``32 (b % 2) + b // 2``
  (low nibble, block ``2 (b % 2)``) and ``16 +`` that (high nibble, block ``2 (b % 2) + 1``).
* B (32 bytes x 8 columns): the query gathered in that element order, as E4M3 ``hi + lo``
  (``hi = e4m3(q / qs)``, ``lo = e4m3(q / qs - hi)``, ``qs = max|q| / 448`` of the group: about
  8 significant bits, like bf16), zeroed on the bytes of the other block: one plane and byte
  parity is exactly one 16-block, so each MMA pair (hi, lo) gives that block's partial score
  with no rounding of the block scale.
* The partial score is multiplied by the key's block scale (FP32) and summed: exact NVFP4.

Per 64-byte K row (D = 128): 2 groups x 2 planes x 2 parities x 2 (hi, lo) = 16 MMAs per
16 keys, 8 scale FMAs per accumulator element. Cache words are loaded straight into registers
(no ``cp.async`` pipeline yet). Whole tiles of ``TILE_N`` keys run unmasked; the tail is masked.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

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
def _block_scale(scale_words, BLOCK_INDEX: ttgl.constexpr):
    """FP32 block scale ``BLOCK_INDEX`` of each key from its 8 token-major scale bytes."""
    byte = ((scale_words >> (8 * BLOCK_INDEX)) & 0xFF).to(ttgl.uint8)
    return byte.to(ttgl.float8e4nv, bitcast=True).to(ttgl.float32)


@gluon.jit
def _tile_scores(cache_ptr, block_table_row, tile_start, seq_len, stride_blk, kv_head,
                 bq, MASKED: ttgl.constexpr, NUM_KV_HEADS: ttgl.constexpr,
                 BLOCK: ttgl.constexpr, D: ttgl.constexpr, K_DATA: ttgl.constexpr,
                 K_SCALE: ttgl.constexpr, TILE_N: ttgl.constexpr, MMA: ttgl.constexpr,
                 A_LAYOUT: ttgl.constexpr):
    """Scores ``[TILE_N, 8]`` (MMA layout, FP32, before the query and 2^6 factors) of the keys
    ``tile_start ..`` against the query operands ``bq[group][plane][parity] = (hi, lo)``."""
    W: ttgl.constexpr = D // 2
    rows_a = tile_start + ttgl.arange(0, TILE_N, layout=ttgl.SliceLayout(1, A_LAYOUT))
    blk_a = _load(block_table_row + rows_a // BLOCK, rows_a < seq_len, MASKED)
    row_base = (blk_a.to(ttgl.int64) * stride_blk + K_DATA
                + (kv_head * BLOCK + rows_a % BLOCK) * W)
    cols = ttgl.arange(0, GROUP_BYTES, layout=ttgl.SliceLayout(0, A_LAYOUT))

    rows_c = tile_start + ttgl.arange(0, TILE_N, layout=ttgl.SliceLayout(1, MMA))
    blk_c = _load(block_table_row + rows_c // BLOCK, rows_c < seq_len, MASKED)
    scale_off = (blk_c.to(ttgl.int64) * stride_blk + K_SCALE
                 + (kv_head * BLOCK + rows_c % BLOCK) * (D // 16))
    words_ptr = (cache_ptr + scale_off).to(ttgl.pointer_type(ttgl.int64), bitcast=True)
    scale_words = _load(words_ptr, rows_c < seq_len, MASKED)

    acc = ttgl.zeros([TILE_N, 8], ttgl.float32, layout=MMA)
    for g in ttgl.static_range(D // 64):
        ptrs = cache_ptr + row_base[:, None] + (g * GROUP_BYTES + cols)[None, :]
        words = _load(ptrs, (rows_a < seq_len)[:, None], MASKED)
        lo, hi = ttgl.inline_asm_elementwise(
            _E2M1_TO_E4M3, "=r,=r,r", [words], dtype=(ttgl.float8e4nv, ttgl.float8e4nv),
            is_pure=True, pack=4)
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
def nvfp4_qk_scores_kernel(
    query_ptr, out_ptr, cache_ptr, k_scale_ptr, block_table_ptr, seq_lens_ptr,
    stride_qt, stride_qh, stride_os, stride_oh, stride_blk, stride_bt,
    HQ: ttgl.constexpr, G: ttgl.constexpr, D: ttgl.constexpr, BLOCK: ttgl.constexpr,
    K_DATA: ttgl.constexpr, K_SCALE: ttgl.constexpr, TILE_N: ttgl.constexpr,
):
    """``out[s, h, n] = query[s, h] . K[s, n]`` in FP32 for each sequence ``s`` (program axis 0),
    KV head (axis 1), query head ``h`` of its group and key ``n < seq_len``; K is the exact
    NVFP4 decoding (``e2m1 * block scale * k_scale``)."""
    MMA: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                      instr_shape=[16, 8])
    A_LAYOUT: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B_LAYOUT: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    ttgl.static_assert(D == 128, "the prototype reads a token's 8 block scales as one word")
    NUM_KV_HEADS: ttgl.constexpr = HQ // G
    seq = ttgl.program_id(0)
    kv_head = ttgl.program_id(1)
    seq_len = ttgl.load(seq_lens_ptr + seq)
    block_table_row = block_table_ptr + seq.to(ttgl.int64) * stride_bt

    col = ttgl.arange(0, 8, layout=ttgl.SliceLayout(0, B_LAYOUT))
    col_ok = col < G
    q_row_ptr = query_ptr + seq.to(ttgl.int64) * stride_qt + (kv_head * G) * stride_qh
    q_cols = q_row_ptr + col * stride_qh
    d = ttgl.arange(0, D, layout=ttgl.SliceLayout(0, ttgl.BlockedLayout([1, 1], [1, 32], [1, 1],
                                                                        [1, 0])))
    qabs = ttgl.max(ttgl.abs(ttgl.load(q_row_ptr + d)).to(ttgl.float32), axis=0)
    for h in ttgl.static_range(1, G):
        qabs = ttgl.maximum(qabs, ttgl.max(ttgl.abs(ttgl.load(q_row_ptr + h * stride_qh + d))
                                           .to(ttgl.float32), axis=0))
    qs = ttgl.maximum(qabs, 1e-30) / 448.0
    bq = (((_query_operand(q_cols, col_ok, qs, 0, 0, 0, B_LAYOUT),
            _query_operand(q_cols, col_ok, qs, 0, 0, 1, B_LAYOUT)),
           (_query_operand(q_cols, col_ok, qs, 0, 1, 0, B_LAYOUT),
            _query_operand(q_cols, col_ok, qs, 0, 1, 1, B_LAYOUT))),
          ((_query_operand(q_cols, col_ok, qs, 1, 0, 0, B_LAYOUT),
            _query_operand(q_cols, col_ok, qs, 1, 0, 1, B_LAYOUT)),
           (_query_operand(q_cols, col_ok, qs, 1, 1, 0, B_LAYOUT),
            _query_operand(q_cols, col_ok, qs, 1, 1, 1, B_LAYOUT))))  # [group][plane][parity]

    k_scale = ttgl.load(k_scale_ptr + kv_head) * qs * E2M1_BIT_PLACEMENT_SCALE
    rows = ttgl.arange(0, TILE_N, layout=ttgl.SliceLayout(1, MMA))
    out_cols = ttgl.arange(0, 8, layout=ttgl.SliceLayout(0, MMA))
    out_base = (out_ptr + seq.to(ttgl.int64) * stride_os
                + (kv_head * G + out_cols)[None, :] * stride_oh)
    whole = seq_len // TILE_N
    for t in range(whole):
        acc = _tile_scores(cache_ptr, block_table_row, t * TILE_N, seq_len, stride_blk, kv_head,
                           bq, False, NUM_KV_HEADS, BLOCK, D, K_DATA, K_SCALE, TILE_N, MMA,
                           A_LAYOUT)
        ttgl.store(out_base + (t * TILE_N + rows)[:, None], acc * k_scale,
                   mask=(out_cols < G)[None, :])
    if whole * TILE_N < seq_len:
        start = whole * TILE_N
        acc = _tile_scores(cache_ptr, block_table_row, start, seq_len, stride_blk, kv_head,
                           bq, True, NUM_KV_HEADS, BLOCK, D, K_DATA, K_SCALE, TILE_N, MMA,
                           A_LAYOUT)
        ttgl.store(out_base + (start + rows)[:, None], acc * k_scale,
                   mask=((start + rows) < seq_len)[:, None] & (out_cols < G)[None, :])
