"""Pure-torch paged KV-cache write and paged attention over a :class:`KVPageLayout` cache.

This is what vLLM's CPU path runs end to end, and the reference the Triton kernels are tested
against. Quantization and dequantization call :mod:`vllm_nvfp4.formats` (the bit-exact definition,
``nonfinite="propagate"``); dequantization is bit-identical to it (FP32). Attention is FP32 with an
FP32 softmax (torch's ``scaled_dot_product_attention``), cast to ``out.dtype`` at the end. Decode
steps dequantize the blocks of all sequences in one batched gather; only the blocks in use are
read. Inputs are assumed validated (:mod:`vllm_nvfp4.ops` checks them at the API edge).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from vllm_nvfp4.formats import NVFP4_BLOCK_SIZE, KVFormat, e2m1_value, fp8_quantize, nvfp4_quantize
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.key_transform import key_centers, rot_offset, stored_keys
from vllm_nvfp4.layout import (KV, KVPageLayout, nvfp4_element_order, nvfp4_rows_from_packed,
                               unpack_e2m1_pair)


def quantize_heads(
    x: torch.Tensor, fmt: KVFormat, scale: torch.Tensor
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantize ``x [T, H, D]`` with per-head ``scale [H]`` (FP8 scale or NVFP4 global scale).

    Returns ``(data uint8 [T, H, W], block_scales uint8 [T, H, D/16] or None)`` with W = D (fp8) or
    D/2 (nvfp4); bytes exactly as :mod:`vllm_nvfp4.formats` with ``nonfinite="propagate"``, NVFP4
    codes in the layout's chunk-planar order (:func:`~vllm_nvfp4.layout.nvfp4_rows_from_packed`).
    """
    if KVFormat.parse(fmt) is KVFormat.FP8:
        q = fp8_quantize(x, scale.view(-1, 1), nonfinite="propagate")
        return q.view(torch.uint8), None
    packed, scales = nvfp4_quantize(x, scale, nonfinite="propagate")
    return nvfp4_rows_from_packed(packed), scales.view(torch.uint8)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVPageLayout,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    rot: Optional[RotCenter] = None,
    positions: Optional[torch.Tensor] = None,
    key0_plain: Optional[torch.Tensor] = None,
    center: Optional[torch.Tensor] = None,
    center0: Optional[torch.Tensor] = None,
    first: Optional[torch.Tensor] = None,
) -> None:
    """Quantize ``key``/``value [T, H, D]`` and store token t at ``slot_mapping[t]`` (< 0: skip).

    ``center`` (FP32 ``[H, D]``): keys are stored minus it (``center0`` where ``first``, bool
    ``[T]``, is set), :func:`~vllm_nvfp4.key_transform.stored_keys`. ``rot`` (with ``positions
    [T]``, each token's index in its sequence): the key minus ``R(p) b_k``
    (:func:`~vllm_nvfp4.key_transform.rot_offset`, FP32) is quantized, except at position 0 of
    the heads where ``key0_plain`` (``[H]``, or None) is nonzero."""
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    if center is not None:
        key = stored_keys(key, key_centers(center, center0, first))
    if rot is not None:
        key = key.float() - rot_offset(rot.idx, rot.b, rot.theta, positions, layout.head_dim,
                                       None if key0_plain is None else key0_plain.bool())
    slots = slot_mapping[keep].long()
    blocks = slots // layout.block_size
    offsets = slots % layout.block_size
    for which, x, scale in (("k", key[keep], k_scale), ("v", value[keep], v_scale)):
        data, scales = quantize_heads(x, layout.format_of(which), scale)
        # Advanced indices at dims 0 and 2 around a slice: the selection is [T, H, W].
        layout.data_plane(cache, which)[blocks, :, offsets] = data
        if scales is not None:
            layout.scale_plane(cache, which)[blocks, :, offsets] = scales


PREFILL_QUERY_CHUNK = 1024  # query rows per attention call of a prefill


@functools.lru_cache(maxsize=None)
def _e2m1_byte_table(device: torch.device) -> torch.Tensor:
    """``[256]`` 8-byte entries: the FP32 E2M1 values of each data-plane byte's two codes (even
    then odd nibble position, :func:`~vllm_nvfp4.layout.unpack_e2m1_pair`, via :func:`e2m1_value`)
    stored side by side, so one gather of scalars decodes a byte."""
    byte = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    pairs = torch.stack([e2m1_value(c) for c in unpack_e2m1_pair(byte)], dim=-1)  # FP32 [256, 2]
    return pairs.contiguous().view(torch.float64).view(256)


@functools.lru_cache(maxsize=None)
def _nibble_position(head_dim: int, device: torch.device) -> torch.Tensor:
    """int64 ``[head_dim]``: nibble position of each element in a data row (inverse order)."""
    return torch.argsort(nvfp4_element_order(head_dim, device))


def dequantize_tokens(
    cache: torch.Tensor,
    layout: KVPageLayout,
    which: KV,
    block_ids: torch.Tensor,
    scale: torch.Tensor,
    seq_lens: Optional[torch.Tensor] = None,
    key0_shift: Optional[torch.Tensor] = None,
    rot: Optional[RotCenter] = None,
) -> torch.Tensor:
    """Dequantize K or V of ``S`` sequences' blocks ``block_ids [S, n]``: FP32 ``[S, H, n * B, D]``.

    Token ``t`` of sequence ``s`` is slot ``t % B`` of block ``block_ids[s, t // B]``. Values are
    bit-identical to :func:`vllm_nvfp4.formats.fp8_dequantize` / :func:`~vllm_nvfp4.formats.nvfp4_dequantize` with the
    per-head ``scale [H]`` (same FP32 products in the same order; NVFP4 nibbles are decoded a byte
    at a time through a table built from :func:`e2m1_value`). With ``seq_lens [S]``, tokens at
    ``t >= seq_lens[s]`` are exactly 0, whatever stale bytes (NaN included) their slots hold.
    ``key0_shift`` (FP32 ``[H, D]``; the blocks must start at the sequences' first block) is
    subtracted from token 0 of every sequence that has one: the sink key stored uncentered
    (:func:`vllm_nvfp4.key_transform.sink_shift`; 0 for heads stored centered). ``rot`` (the
    blocks likewise from the first): then token ``t`` gets ``R(t) b_k`` added
    (:func:`~vllm_nvfp4.key_transform.rot_offset`; not past ``seq_lens``).
    """
    n_seq, n_blk = block_ids.shape
    h, b, d = layout.num_kv_heads, layout.block_size, layout.head_dim
    ids = block_ids.long().flatten()
    length = n_blk * b
    data = layout.data_plane(cache, which)[ids]  # uint8 [S * n, H, B, W]
    data = data.view(n_seq, n_blk, h, b, -1).transpose(1, 2).reshape(n_seq, h, length, -1)
    sc = None
    if layout.has_scales(which):
        sc = layout.scale_plane(cache, which)[ids]  # uint8 [S * n, H, B, D/16]
        sc = sc.view(n_seq, n_blk, h, b, -1).transpose(1, 2).reshape(n_seq, h, length, -1)
    if seq_lens is not None:  # zero bytes decode to exactly 0 in both formats
        stale = torch.arange(length, device=data.device).view(1, 1, -1, 1) >= seq_lens.view(-1, 1, 1, 1)
        data.masked_fill_(stale, 0)
        if sc is not None:
            sc.masked_fill_(stale, 0)
    per_head = scale.view(1, -1, 1, 1)
    if sc is None:
        x = data.view(torch.float8_e4m3fn).float() * per_head
        return _key_offsets(x, key0_shift, seq_lens, rot)
    vals = _e2m1_byte_table(data.device).index_select(0, data.flatten().int()).view(torch.float32)
    vals = vals.view(n_seq, h, length, d)[..., _nibble_position(d, data.device)]  # element order
    se = sc.view(torch.float8_e4m3fn).float() * per_head  # [S, H, n * B, D/16]
    x = vals.view(n_seq, h, length, d // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE) * se.unsqueeze(-1)
    x = x.view(n_seq, h, length, d)
    return _key_offsets(x, key0_shift, seq_lens, rot)


def _key_offsets(k: torch.Tensor, key0_shift: Optional[torch.Tensor],
                 seq_lens: Optional[torch.Tensor], rot: Optional[RotCenter]) -> torch.Tensor:
    """``k [S, H, L, D]`` (FP32, token ``t`` = position ``t``) with ``key0_shift`` subtracted from
    position 0 (:func:`_shift_first_keys`), then ``R(t) b_k`` of ``rot`` added below
    ``seq_lens``; either may be None."""
    if key0_shift is not None:
        k = _shift_first_keys(k, key0_shift, seq_lens)
    if rot is None:
        return k
    length = k.shape[2]
    pos = torch.arange(length, device=k.device)
    off = rot_offset(rot.idx, rot.b, rot.theta, pos, k.shape[3]).transpose(0, 1)  # [H, L, D]
    if seq_lens is None:
        return k + off
    live = (pos.view(1, 1, -1, 1) < seq_lens.view(-1, 1, 1, 1))
    return k + torch.where(live, off, 0.0)


def _shift_first_keys(k: torch.Tensor, key0_shift: torch.Tensor,
                      seq_lens: Optional[torch.Tensor]) -> torch.Tensor:
    """``k [S, H, L, D]`` (FP32, token 0 = position 0) with ``key0_shift [H, D]`` subtracted from
    token 0 of each sequence with at least one token (all without ``seq_lens``)."""
    first = k[:, :, 0, :] - key0_shift
    if seq_lens is not None:
        first = torch.where((seq_lens > 0).view(-1, 1, 1), first, k[:, :, 0, :])
    k[:, :, 0, :] = first
    return k


def read_kv_from_cache(
    cache: torch.Tensor,
    layout: KVPageLayout,
    block_ids: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    num_tokens: Optional[int] = None,
    key0_shift: Optional[torch.Tensor] = None,
    rot: Optional[RotCenter] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized ``(K, V)``, each FP32 ``[num_tokens, H, D]``, of one sequence's blocks ``[n]``
    (from its first block).

    ``num_tokens`` (default ``n * block_size``) keeps the first tokens; ``key0_shift``, ``rot``:
    see :func:`dequantize_tokens`.
    """
    def plane(which: KV, scale: torch.Tensor, shift: Optional[torch.Tensor],
              center: Optional[RotCenter]) -> torch.Tensor:
        x = dequantize_tokens(cache, layout, which, block_ids.view(1, -1), scale,
                              key0_shift=shift, rot=center)[0].transpose(0, 1)
        return x if num_tokens is None else x[:num_tokens]

    return plane("k", k_scale, key0_shift, rot), plane("v", v_scale, None, None)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    softmax_scale: float,
    logits_soft_cap: Optional[float],
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Masked GQA attention: ``q [S, Hq, Q, D]``, ``k``/``v [S, Hkv, L, D]``, ``allowed`` bool
    ``[S, 1, Q, L]`` (every query row allows at least one key) -> ``[S, Hq, Q, D]``.

    Query head ``h`` reads KV head ``h // (Hq / Hkv)``. Without a soft-cap or sinks this is torch's
    ``scaled_dot_product_attention``; otherwise the same math written out: the soft-cap
    (``cap * tanh(s / cap)``) on the scaled logits, then each head's sink logit ``sinks [Hq]``
    (FP32) joins the softmax as one more logit that carries no value (it only adds
    ``exp(sink - max)`` to the denominator; it is neither scaled nor capped).
    """
    if not logits_soft_cap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale,
                                              enable_gqa=True)
    s_, hq, q_len, d = q.shape
    hkv, seq_len = k.shape[1], k.shape[2]
    group = hq // hkv
    logits = torch.matmul(q.reshape(s_, hkv, group * q_len, d), k.transpose(-1, -2)) * softmax_scale
    if logits_soft_cap:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    logits = logits.view(s_, hkv, group, q_len, seq_len).masked_fill(~allowed.unsqueeze(1), float("-inf"))
    if sinks is not None:
        sink = sinks.to(logits.dtype).view(1, hkv, group, 1, 1).expand(s_, hkv, group, q_len, 1)
        p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :seq_len]
    else:
        p = torch.softmax(logits, dim=-1)
    return torch.matmul(p.reshape(s_, hkv, group * q_len, seq_len), v).view(s_, hq, q_len, d)


def _allowed(
    q_pos: torch.Tensor, seq_lens: torch.Tensor, max_len: int, sliding_window: Optional[int]
) -> torch.Tensor:
    """Bool ``[S, 1, Q, max_len]``: key position ``p`` is visible to the query at ``q_pos [S, Q]`` iff
    ``p <= q_pos``, ``p < seq_lens[s]`` and, with a window ``w``, ``p > q_pos - w``."""
    kpos = torch.arange(max_len, device=q_pos.device).view(1, 1, -1)
    qp = q_pos.unsqueeze(-1)
    allowed = (kpos <= qp) & (kpos < seq_lens.view(-1, 1, 1))
    if sliding_window is not None:
        allowed = allowed & (kpos > qp - sliding_window)
    return allowed.unsqueeze(1)


def attend_one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal GQA attention of the last ``q_len`` positions of a sequence of length ``L``.

    ``q [q_len, Hq, D]``, ``k``/``v [L, Hkv, D]`` (same float dtype) -> ``[q_len, Hq, D]``.
    Query j sits at position ``L - q_len + j`` and sees keys at positions ``p`` with
    ``p <= pos`` and, with a window ``w``, ``p > pos - w``. Soft-cap: ``cap * tanh(s / cap)``
    applied to the scaled logits; ``sinks [Hq]``: a per-head logit in the softmax denominator
    (see :func:`_attend`).
    """
    q_len, seq_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).view(1, -1)
    allowed = _allowed(q_pos, torch.tensor([seq_len], device=q.device), seq_len, sliding_window)
    o = _attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0), allowed, softmax_scale, logits_soft_cap, sinks)
    return o[0].transpose(0, 1)


def _attend_paged(
    query: torch.Tensor,
    q_pos: torch.Tensor,
    cache: torch.Tensor,
    layout: KVPageLayout,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    sliding_window: Optional[int],
    logits_soft_cap: Optional[float],
    sinks: Optional[torch.Tensor],
    query_chunk: Optional[int] = None,
    key0_shift: Optional[torch.Tensor] = None,
    rot: Optional[RotCenter] = None,
) -> torch.Tensor:
    """``query [S, Q, Hq, D]`` at positions ``q_pos [S, Q]`` of sequences with blocks ``block_ids
    [S, n]`` (covering ``seq_lens [S]`` tokens) -> FP32 ``[S, Q, Hq, D]``.

    All sequences' blocks are dequantized in one gather, padded to ``n`` blocks; positions at or
    past a sequence's length are exact zeros and masked. With ``query_chunk`` the query rows are
    attended ``query_chunk`` at a time, each chunk against the keys up to its last position
    (``q_pos`` increasing along Q), so the FP32 logits never exceed ``[S, Hq, query_chunk, L]``;
    every row's result is the same. ``key0_shift``, ``rot``: see :func:`dequantize_tokens`.
    """
    k = dequantize_tokens(cache, layout, "k", block_ids, k_scale, seq_lens, key0_shift, rot)
    v = dequantize_tokens(cache, layout, "v", block_ids, v_scale, seq_lens)
    if sliding_window is not None:
        # Blocks wholly below every query's window may be ones vLLM already freed (their table
        # entries point at its null block or at reused pages: any bytes, NaN in FP8), and a
        # masked key still meets its value in p @ v as 0 * NaN: zero what no query sees.
        kpos = torch.arange(k.shape[2], device=k.device)
        seen = (kpos[None, :] > q_pos[:, :1] - sliding_window)[:, None, :, None]  # [S, 1, L, 1]
        k, v = torch.where(seen, k, 0.0), torch.where(seen, v, 0.0)
    q = query.float().transpose(1, 2)  # [S, Hq, Q, D]
    step = query_chunk or q.shape[2]
    parts = []
    for c0 in range(0, q.shape[2], step):
        pos = q_pos[:, c0:c0 + step]
        keys = min(k.shape[2], int(pos.max()) + 1)
        allowed = _allowed(pos, seq_lens, keys, sliding_window)
        parts.append(_attend(q[:, :, c0:c0 + step], k[:, :, :keys], v[:, :, :keys], allowed,
                             softmax_scale, logits_soft_cap, sinks))
    return torch.cat(parts, dim=2).transpose(1, 2)


def paged_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    layout: KVPageLayout,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    softmax_scale: float,
    out: torch.Tensor,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    key0_shift: Optional[torch.Tensor] = None,
    rot_center: Optional[RotCenter] = None,
) -> torch.Tensor:
    """Paged causal attention reading K/V from the quantized cache (FP32 math). Writes ``out``.
    ``rot_center``: the keys were stored minus ``R(p) b_k``, which the dequantization adds back
    (:func:`dequantize_tokens`).

    Shapes as in :func:`vllm_nvfp4.ops.paged_attention`. Sequences with one query token (decode)
    run as one batch; each sequence with several (prefill, chunked prefill) runs on its own, so a
    long prompt never pads the decode batch, in chunks of :data:`PREFILL_QUERY_CHUNK` query rows
    (each against the keys up to its last row: less work and memory than one causal call).
    """
    del max_query_len, max_seq_len  # launch hints for the kernels; the torch path reads the tensors
    n_seq, bs = seq_lens.shape[0], layout.block_size
    q_lens = query_start_loc[1:n_seq + 1] - query_start_loc[:n_seq]
    single = torch.nonzero(q_lens == 1).flatten()
    if single.numel():  # decode: one query token per sequence, all at once
        rows = query_start_loc[single].long()
        lens = seq_lens[single].long()
        n_blk = int((lens.max() + bs - 1) // bs)
        in_use = torch.arange(n_blk, device=lens.device).view(1, -1) < ((lens + bs - 1) // bs).view(-1, 1)
        ids = torch.where(in_use, block_table[single, :n_blk].long(), 0)  # padding -> block 0, zeroed
        o = _attend_paged(query[rows].unsqueeze(1), (lens - 1).view(-1, 1), cache, layout, k_scale,
                          v_scale, ids, lens, softmax_scale, sliding_window, logits_soft_cap, sinks,
                          key0_shift=key0_shift, rot=rot_center)
        out[rows] = o.squeeze(1).to(out.dtype)
    starts, lens_list = query_start_loc.tolist(), seq_lens.tolist()
    for s in torch.nonzero(q_lens > 1).flatten().tolist():  # prefill / chunked prefill: one by one
        start, end, seq_len = starts[s], starts[s + 1], lens_list[s]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device).view(1, -1)
        o = _attend_paged(query[start:end].unsqueeze(0), q_pos, cache, layout, k_scale, v_scale,
                          block_table[s:s + 1, :-(-seq_len // bs)], seq_lens[s:s + 1], softmax_scale,
                          sliding_window, logits_soft_cap, sinks, PREFILL_QUERY_CHUNK, key0_shift,
                          rot_center)
        out[start:end] = o[0].to(out.dtype)
    return out
