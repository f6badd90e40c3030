"""Test batches for the paged KV ops: random K/V in a shuffled paged cache, and a float64 reference.

Shared by ``test_paged_torch.py`` and ``test_kernels*.py`` (CPU, interpreter and CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from vllm_nvfp4 import formats, ops
from vllm_nvfp4.layout import KVPageLayout, allocate_cache
from vllm_nvfp4.paged_torch import quantize_heads


@dataclass
class PagedBatch:
    """One batch: ``seqs[i] = (seq_len, q_len)``; K/V of every position in FP32 ``[L, H, D]``."""

    layout: KVPageLayout
    seqs: list[tuple[int, int]]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query: torch.Tensor

    @property
    def max_query_len(self) -> int:
        return max(q for _, q in self.seqs)

    @property
    def max_seq_len(self) -> int:
        return max(l for l, _ in self.seqs)


def random_kv(n: int, h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Random non-zero FP32 ``[n, h, d]``: per-head magnitudes and a few outlier channels."""
    x = torch.randn(n, h, d, generator=gen)
    x = x * torch.rand(1, h, 1, generator=gen).add(0.5)
    x[..., torch.randint(0, d, (2,), generator=gen)] *= 6.0
    return x


def scales_for(x: torch.Tensor, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """Per-head scales of the calibrated kind, jittered by 0.5x..2x so some values saturate."""
    amax = x.abs().amax(dim=(0, 2))
    jitter = torch.rand(amax.shape, generator=gen) * 1.5 + 0.5
    base = formats.fp8_scale_from_amax(amax) if fmt == "fp8" else formats.nvfp4_global_scale(amax)
    return (base * jitter).float()


def slots_for(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of each position of a sequence whose blocks are ``block_ids``."""
    return block_ids[positions // block_size].long() * block_size + positions % block_size


def make_batch(
    layout: KVPageLayout,
    seqs: Sequence[tuple[int, int]],
    num_q_heads: int,
    q_dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    write_backend: ops.Backend = "auto",
    row_stride_pad: int = 48,
    extra_blocks: int = 3,
) -> PagedBatch:
    """Build a batch: blocks drawn from a shuffled pool, every position written with ``ops``."""
    gen = torch.Generator().manual_seed(seed)
    h, d, bs = layout.num_kv_heads, layout.head_dim, layout.block_size
    seqs = [(int(l), int(q)) for l, q in seqs]
    # K/V as the model would hand them over (kv_dtype), kept in FP32 for the reference
    keys = [random_kv(l, h, d, gen).to(kv_dtype).float() for l, _ in seqs]
    values = [random_kv(l, h, d, gen).to(kv_dtype).float() for l, _ in seqs]
    k_scale = scales_for(torch.cat(keys), layout.k_format, gen).to(device)
    v_scale = scales_for(torch.cat(values), layout.v_format, gen).to(device)
    nblk = [-(-l // bs) for l, _ in seqs]
    total = sum(nblk) + extra_blocks
    pool = torch.randperm(total, generator=gen)
    width = max(nblk) + 1
    block_table = torch.full((len(seqs), width), total - 1, dtype=torch.int32)
    cache = allocate_cache(layout, total, device, row_stride=layout.page_bytes + row_stride_pad)
    cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8))
    used = 0
    for s, ((l, _), n) in enumerate(zip(seqs, nblk)):
        ids = pool[used : used + n]
        used += n
        block_table[s, :n] = ids.int()
        slots = slots_for(ids, torch.arange(l), bs)
        ops.write_kv_cache(
            keys[s].to(device, kv_dtype),
            values[s].to(device, kv_dtype),
            cache,
            slots.to(device),
            layout,
            k_scale,
            v_scale,
            backend=write_backend,
        )
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_q_heads, d, generator=gen).to(q_dtype)
    return PagedBatch(
        layout, seqs, keys, values, k_scale, v_scale, cache,
        block_table.to(device), torch.tensor([l for l, _ in seqs], dtype=torch.int32, device=device),
        qsl.to(device), query.to(device),
    )


def roundtrip(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """What the cache holds for ``x [L, H, D]``, decoded by :mod:`formats`, as float64."""
    scale = scale.cpu()
    if fmt == "fp8":
        q = formats.fp8_quantize(x, scale.view(-1, 1), nonfinite="propagate")
        return formats.fp8_dequantize(q, scale.view(-1, 1)).double()
    packed, bs = formats.nvfp4_quantize(x, scale, nonfinite="propagate")
    return formats.nvfp4_dequantize(packed, bs, scale).double()


def reference_attention(
    batch: PagedBatch,
    softmax_scale: float,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Float64 attention, one query token and head at a time, on formats-roundtripped K/V.

    ``sinks [Hq]``: out = sum_j e^(l_j - m) v_j / (sum_j e^(l_j - m) + e^(sink - m)), m the max
    over the real logits and the sink.
    """
    lay = batch.layout
    q_all = batch.query.cpu().double()
    hq = q_all.shape[1]
    group = hq // lay.num_kv_heads
    out = torch.zeros_like(q_all)
    row = 0
    for (l, q_len), k, v in zip(batch.seqs, batch.keys, batch.values):
        kd = roundtrip(k, lay.k_format, batch.k_scale)
        vd = roundtrip(v, lay.v_format, batch.v_scale)
        for j in range(q_len):
            pos = l - q_len + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for hh in range(hq):
                kv = hh // group
                logits = (kd[lo : pos + 1, kv] @ q_all[row + j, hh]) * softmax_scale
                if logits_soft_cap:
                    logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
                if sinks is None:
                    out[row + j, hh] = torch.softmax(logits, dim=0) @ vd[lo : pos + 1, kv]
                    continue
                sink = sinks[hh].double().cpu()
                m = torch.maximum(logits.max(), sink)
                e = torch.exp(logits - m)
                out[row + j, hh] = (e @ vd[lo : pos + 1, kv]) / (e.sum() + torch.exp(sink - m))
        row += q_len
    return out


def run_attention(
    batch: PagedBatch,
    backend: ops.Backend = "auto",
    out_dtype: Optional[torch.dtype] = None,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    softmax_scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Run :func:`ops.paged_attention` on the batch; returns ``out``."""
    d = batch.layout.head_dim
    out = torch.empty_like(batch.query, dtype=out_dtype or batch.query.dtype)
    return ops.paged_attention(
        batch.query, batch.cache, batch.layout, batch.k_scale, batch.v_scale,
        batch.block_table, batch.seq_lens, batch.query_start_loc,
        batch.max_query_len, batch.max_seq_len,
        softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d),
        out, sliding_window, logits_soft_cap, sinks=sinks, backend=backend,
    )


def random_sinks(num_q_heads: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """FP32 ``[num_q_heads]`` sink logits of the size of the attention logits (some heads far
    above them, so the sink takes most of the weight there, some far below)."""
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(num_q_heads, generator=gen) * 2.0 + 0.5
    sinks[0] = 6.0
    if num_q_heads > 1:
        sinks[-1] = -8.0
    return sinks.to(device)


def write_case(layout, n_tok, dtype, seed, nan=False):
    """Non-contiguous K/V views, shuffled slots with some skipped, a strided cache of noise."""
    gen = torch.Generator().manual_seed(seed)
    h, d = layout.num_kv_heads, layout.head_dim
    big = torch.randn(n_tok, h + 2, d, generator=gen) * 3
    key = big[:, 1 : h + 1].to(dtype)  # view with stride(-1) == 1, non-contiguous
    value = (torch.randn(n_tok, h, d, generator=gen) * 0.01).to(dtype)
    if nan:
        key[1, 0, 3] = float("nan")
        value[2, h - 1, d - 1] = float("inf")
    nblocks = -(-n_tok // layout.block_size) + 2
    slots = torch.randperm(nblocks * layout.block_size, generator=gen)[:n_tok]
    slots[::5] = -1
    cache = allocate_cache(layout, nblocks, row_stride=layout.page_bytes + 32)
    cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8))
    k_scale = torch.rand(h, generator=gen) * 0.02 + 0.001
    v_scale = torch.rand(h, generator=gen) * 0.0002 + 0.00001
    return key, value, slots, cache, k_scale, v_scale


def check_written_bytes(layout, before, after, key, value, slots, k_scale, v_scale):
    """Every kept token's bytes equal formats.py's; every other byte of ``after`` is unchanged."""
    keep = slots >= 0
    blk, off = slots[keep] // layout.block_size, slots[keep] % layout.block_size
    touched = torch.zeros_like(after.cpu())  # uint8 mask in the cache's own layout
    for which, x, scale in (("k", key, k_scale), ("v", value, v_scale)):
        data, scales = quantize_heads(x[keep], layout.format_of(which), scale)
        got = layout.data_plane(after.cpu(), which)[blk, :, off]
        assert torch.equal(got, data), f"{which} data bytes differ"
        layout.data_plane(touched, which)[blk, :, off] = 1
        if scales is not None:
            got_s = layout.scale_plane(after.cpu(), which)[blk, :, off]
            assert torch.equal(got_s, scales), f"{which} scale bytes differ"
            layout.scale_plane(touched, which)[blk, :, off] = 1
    untouched = touched == 0
    assert torch.equal(after.cpu()[untouched], before.cpu()[untouched])
