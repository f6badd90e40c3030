"""Pure-torch paged KV-cache write and paged attention over a :class:`KVPageLayout` cache.

This is what vLLM's CPU path runs end to end, and the reference the Triton kernels are tested
against. Quantization and dequantization call :mod:`vllm_nvfp4.formats` (the bit-exact definition,
``nonfinite="propagate"``); attention is FP32 with an FP32 softmax, cast to ``out.dtype`` at the end.
Inputs are assumed validated (:mod:`vllm_nvfp4.ops` checks them at the API edge).
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm_nvfp4.formats import (
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)
from vllm_nvfp4.layout import KV, KVPageLayout


def quantize_heads(
    x: torch.Tensor, fmt: str, scale: torch.Tensor
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantize ``x [T, H, D]`` with per-head ``scale [H]`` (FP8 scale or NVFP4 global scale).

    Returns ``(data uint8 [T, H, W], block_scales uint8 [T, H, D/16] or None)`` with W = D (fp8) or
    D/2 (nvfp4); bytes exactly as :mod:`vllm_nvfp4.formats` with ``nonfinite="propagate"``.
    """
    if fmt == "fp8":
        q = fp8_quantize(x, scale.view(-1, 1), nonfinite="propagate")
        return q.view(torch.uint8), None
    packed, scales = nvfp4_quantize(x, scale, nonfinite="propagate")
    return packed, scales.view(torch.uint8)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVPageLayout,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Quantize ``key``/``value [T, H, D]`` and store token t at ``slot_mapping[t]`` (< 0: skip)."""
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    slots = slot_mapping[keep].long()
    blocks = slots // layout.block_size
    offsets = slots % layout.block_size
    for which, x, scale in (("k", key[keep], k_scale), ("v", value[keep], v_scale)):
        data, scales = quantize_heads(x, layout.format_of(which), scale)
        # Advanced indices at dims 0 and 2 around a slice: the selection is [T, H, W].
        layout.data_plane(cache, which)[blocks, :, offsets] = data
        if scales is not None:
            layout.scale_plane(cache, which)[blocks, :, :, offsets] = scales


def read_plane(
    cache: torch.Tensor,
    layout: KVPageLayout,
    which: KV,
    block_ids: torch.Tensor,
    scale: torch.Tensor,
    num_tokens: Optional[int] = None,
) -> torch.Tensor:
    """Dequantize K or V of the blocks ``block_ids [n]`` in order: FP32 ``[num_tokens, H, D]``.

    ``num_tokens`` (default ``n * block_size``) keeps the first tokens of the concatenated blocks.
    """
    ids = block_ids.long()
    n, b = ids.numel(), layout.block_size
    h = layout.num_kv_heads
    data = layout.data_plane(cache, which)[ids]  # [n, H, B, W]
    data = data.permute(0, 2, 1, 3).reshape(n * b, h, -1)
    if layout.format_of(which) == "fp8":
        x = fp8_dequantize(data.view(torch.float8_e4m3fn), scale.view(-1, 1))
    else:
        sc = layout.scale_plane(cache, which)[ids]  # [n, H, D/16, B]
        sc = sc.permute(0, 3, 1, 2).reshape(n * b, h, -1).contiguous().view(torch.float8_e4m3fn)
        x = nvfp4_dequantize(data.contiguous(), sc, scale)
    return x if num_tokens is None else x[:num_tokens]


def read_kv_from_cache(
    cache: torch.Tensor,
    layout: KVPageLayout,
    block_ids: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    num_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized ``(K, V)``, each FP32 ``[num_tokens, H, D]``, of one sequence's blocks."""
    return (
        read_plane(cache, layout, "k", block_ids, k_scale, num_tokens),
        read_plane(cache, layout, "v", block_ids, v_scale, num_tokens),
    )


def attend_one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
) -> torch.Tensor:
    """Causal GQA attention of the last ``q_len`` positions of a sequence of length ``L``.

    ``q [q_len, Hq, D]``, ``k``/``v [L, Hkv, D]`` (same float dtype) -> ``[q_len, Hq, D]``.
    Query j sits at position ``L - q_len + j`` and sees keys at positions ``p`` with
    ``p <= pos`` and, with a window ``w``, ``p > pos - w``. Soft-cap: ``cap * tanh(s / cap)``
    applied to the scaled logits.
    """
    q_len, hq, d = q.shape
    seq_len, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    qg = q.view(q_len, hkv, group, d)
    s = torch.einsum("qhgd,khd->hgqk", qg, k) * softmax_scale  # [Hkv, G, q_len, L]
    if logits_soft_cap:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    qpos = torch.arange(seq_len - q_len, seq_len, device=q.device).view(-1, 1)
    kpos = torch.arange(seq_len, device=q.device).view(1, -1)
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed = allowed & (kpos > qpos - sliding_window)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("hgqk,khd->qhgd", p, v)
    return o.reshape(q_len, hq, d)


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
) -> torch.Tensor:
    """Paged causal attention reading K/V from the quantized cache (FP32 math). Writes ``out``.

    Shapes as in :func:`vllm_nvfp4.ops.paged_attention`; one iteration per sequence.
    """
    del max_query_len, max_seq_len  # launch hints for the kernels; the torch path reads the tensors
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    bs = layout.block_size
    for s, seq_len in enumerate(lens):
        start, end = qsl[s], qsl[s + 1]
        if end <= start:
            continue
        nblk = -(-seq_len // bs)
        k, v = read_kv_from_cache(cache, layout, block_table[s, :nblk], k_scale, v_scale, seq_len)
        o = attend_one_sequence(
            query[start:end].float(), k, v, softmax_scale, sliding_window, logits_soft_cap
        )
        out[start:end] = o.to(out.dtype)
    return out
