"""Prefill attention on CUDA: decode each prefill sequence's context once, then FlashAttention.

A prefill chunk of ``q`` tokens over a context of ``L`` tokens costs ``O(q * L)`` tensor-core work
but only ``O(L)`` cache bytes. The fused Triton prefill kernel re-decodes every NVFP4 key tile for
each 16-row query block, so at long context it spends more time decoding nibbles than doing
attention. Here the layer's
context is dequantized ONCE per step into dense ``[rows, kv_heads, head_dim]`` tensors of the model
dtype (:func:`vllm_nvfp4.ops.dequantize_kv`, FP32 values rounded once) and vLLM's own
FlashAttention varlen kernel (FA3 on Hopper) runs causal attention over them, bottom-right
aligned, so query ``j`` of a chunk sees positions ``<= L - q + j``: the same masking as decode.

Decode requests of the same batch (reordered to the front by vLLM, ``reorder_batch_threshold=1``)
keep the paged decode kernel. Prefill requests are processed in groups whose contexts add up to
at most ``max_rows`` tokens (``max(max_model_len, max_num_batched_tokens)``), so the scratch
tensors are bounded; the profiling run allocates that bound once so vLLM's memory profile
accounts for it.

Sliding window: FlashAttention's ``window_size = (w - 1, 0)`` (keys ``p > pos - w``); with the
window given to :func:`plan_prefill_groups` too, only the keys some query of the chunk can see
(from ``L - q - w + 1`` on) are dequantized, so a long prompt costs a window's worth of scratch
per sequence on a sliding-window layer. Attention sinks: FlashAttention 3's ``s_aux``.

Off (the fused Triton prefill kernel instead): CPU, fp32 models, no vLLM FlashAttention, or
``VLLM_NVFP4_FUSED_PREFILL=1``; per layer (:func:`dense_prefill_supports`): a head size over
:data:`MAX_DENSE_HEAD_DIM` (FlashAttention 2/3) or sinks without FlashAttention 3.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from vllm_nvfp4 import ops
from vllm_nvfp4.env_vars import FUSED_PREFILL_ENV
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.layout import KVPageLayout

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers

DENSE_DTYPES = (torch.bfloat16, torch.float16)
#: largest head size of FlashAttention 2/3 (Gemma 4's 512 takes the fused Triton prefill)
MAX_DENSE_HEAD_DIM = 256
#: FlashAttention version with attention sinks (``s_aux``)
SINKS_FA_VERSION = 3


@dataclass(frozen=True)
class PrefillGroup:
    """Prefill requests ``[req_begin, req_end)`` of a batch, query tokens ``[tok_begin, tok_end)``.

    ``cu_seqlens_q``/``cu_seqlens_k``: int32 device ``[n + 1]``, cumulative query / dequantized
    key counts of the group's ``n`` requests (both from 0); ``total_kv`` = ``cu_seqlens_k[-1]``
    (host). ``kv_starts``: int32 device ``[n]``, each request's first dequantized position (> 0
    only under a sliding window), or None (all from 0); ``max_seq_len`` bounds the keys per
    request."""

    req_begin: int
    req_end: int
    tok_begin: int
    tok_end: int
    max_query_len: int
    max_seq_len: int
    total_kv: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    kv_starts: Optional[torch.Tensor] = None


@functools.lru_cache(maxsize=None)
def flash_varlen() -> Optional[tuple[Callable[..., Any], int]]:
    """vLLM's ``flash_attn_varlen_func`` and FA version for this GPU, or None where unavailable."""
    if not torch.cuda.is_available():
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as e:
        logger.warning("vllm-nvfp4: vLLM FlashAttention unavailable (%s); prefill uses the fused "
                       "Triton kernel", e)
        return None
    version = get_flash_attn_version()
    if version is None:
        return None
    logger.info("vllm-nvfp4: prefill attention = one dequantization per layer and step + vLLM "
                "FlashAttention %d (decode: the paged Triton kernels)", version)
    return flash_attn_varlen_func, version


def dense_prefill_enabled(device: torch.device) -> bool:
    """Whether prefills on ``device`` go through dequantize + FlashAttention (see also
    :func:`dense_prefill_supports` per layer)."""
    if device.type != "cuda" or os.environ.get(FUSED_PREFILL_ENV, "0") in ("1", "true", "True"):
        return False
    return flash_varlen() is not None


def dense_prefill_supports(head_dim: int, has_sinks: bool) -> bool:
    """Whether vLLM's FlashAttention here runs a layer of ``head_dim`` (with sinks or not); such a
    layer's prefill otherwise takes the fused Triton kernel. Call after
    :func:`dense_prefill_enabled`."""
    fa = flash_varlen()
    if fa is None or head_dim > MAX_DENSE_HEAD_DIM:
        return False
    return not has_sinks or fa[1] >= SINKS_FA_VERSION


def plan_prefill_groups(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor,
                        first_prefill: int, max_rows: int, device: torch.device,
                        sliding_window: Optional[int] = None) -> tuple[PrefillGroup, ...]:
    """Group requests ``[first_prefill, num_reqs)`` in order so each group's dequantized keys sum
    to at most ``max_rows`` (a longer single context gets a group of its own).

    ``query_start_loc_cpu``: int ``[num_reqs + 1]``; ``seq_lens_cpu``: int ``[num_reqs]``
    (exact for the prefill rows). With ``sliding_window`` ``w`` a request of ``q`` queries and
    context ``L`` needs the keys from ``max(0, L - q - w + 1)`` on only."""
    qsl = query_start_loc_cpu.tolist()
    lens = seq_lens_cpu.tolist()
    starts = [0] * len(lens)
    if sliding_window is not None:
        starts = [max(0, n - (qsl[r + 1] - qsl[r]) - sliding_window + 1)
                  for r, n in enumerate(lens)]
    keys = [n - s for n, s in zip(lens, starts)]
    groups: list[PrefillGroup] = []
    begin = first_prefill
    while begin < len(lens):
        end, total = begin + 1, keys[begin]
        while end < len(lens) and total + keys[end] <= max_rows:
            total += keys[end]
            end += 1
        q_lens = [qsl[r + 1] - qsl[r] for r in range(begin, end)]
        cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_k = torch.tensor([0] + keys[begin:end], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv_starts = None
        if any(starts[begin:end]):
            kv_starts = torch.tensor(starts[begin:end], dtype=torch.int32).to(device,
                                                                               non_blocking=True)
        groups.append(PrefillGroup(
            begin, end, qsl[begin], qsl[end], max(q_lens), max(keys[begin:end]), total,
            cu_q.to(device, non_blocking=True), cu_k.to(device, non_blocking=True), kv_starts))
        begin = end
    return tuple(groups)


def scratch_rows(vllm_config: Any) -> int:
    """Most context tokens dequantized at once: one group's bound (see the module doc)."""
    return max(vllm_config.model_config.max_model_len,
               vllm_config.scheduler_config.max_num_batched_tokens)


def reserve_scratch(max_rows: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> None:
    """Allocate (and free) the largest dense K/V pair, so vLLM's memory profile counts it."""
    shape = (max_rows, num_kv_heads, head_dim)
    k, v = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
    del k, v


def dense_prefill(query: torch.Tensor, out: torch.Tensor, pages: torch.Tensor,
                  layout: KVPageLayout, k_scale: torch.Tensor, v_scale: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, group: PrefillGroup,
                  softmax_scale: float, logits_soft_cap: Optional[float],
                  attention: Callable[..., Any], sliding_window: Optional[int] = None,
                  sinks: Optional[torch.Tensor] = None, key0_shift: Optional[torch.Tensor] = None,
                  rot_center: Optional[RotCenter] = None, **attention_kwargs: Any) -> None:
    """Causal attention of ``query [tokens, q_heads, D]`` (the whole batch) for one group's
    tokens into ``out`` (same shape), K/V dequantized from ``pages`` into dense scratch.

    ``attention`` is a FlashAttention-style ``flash_attn_varlen_func``; ``sliding_window``
    (keys ``p > pos - w``) becomes its ``window_size``, ``sinks [q_heads]`` (FP32 logits, see
    :func:`vllm_nvfp4.ops.paged_attention`) its ``s_aux``; ``key0_shift`` (the sink key stored
    uncentered, :class:`vllm_nvfp4.ops.LayerOps`) is subtracted from position 0's dense key, and
    ``R(p) b_k`` of ``rot_center`` (the rotating K center, as there) added to every dense key."""
    toks = slice(group.tok_begin, group.tok_end)
    shape = (group.total_kv, layout.num_kv_heads, layout.head_dim)
    k = torch.empty(shape, dtype=query.dtype, device=query.device)
    v = torch.empty(shape, dtype=query.dtype, device=query.device)
    ops.dequantize_kv(pages, layout, k_scale, v_scale, block_table, seq_lens, group.cu_seqlens_k,
                      group.max_seq_len, k, v, first_seq=group.req_begin,
                      seq_starts=group.kv_starts, key0_shift=key0_shift, rot_center=rot_center)
    if sliding_window is not None:
        attention_kwargs["window_size"] = (sliding_window - 1, 0)
    if sinks is not None:  # FA3 takes s_aux in bf16 only (gpt-oss stores its sinks in bf16)
        attention_kwargs["s_aux"] = sinks.to(torch.bfloat16)
    attention(q=query[toks], k=k, v=v, max_seqlen_q=group.max_query_len,
              cu_seqlens_q=group.cu_seqlens_q, max_seqlen_k=group.max_seq_len,
              cu_seqlens_k=group.cu_seqlens_k, softmax_scale=softmax_scale, causal=True,
              softcap=float(logits_soft_cap or 0.0), out=out[toks], **attention_kwargs)
