"""Dense prefill (dequantize the context once, then a FlashAttention-style varlen kernel): the
request grouping and the split of a mixed batch, on CPU with a torch varlen attention standing in
for FlashAttention (the H200 run checks the real FA3 through vLLM)."""

from __future__ import annotations

import pytest
import torch

from paged_cases import make_batch, random_sinks
from vllm_nvfp4 import ops
from vllm_nvfp4.integration.dense_prefill import dense_prefill, plan_prefill_groups
from vllm_nvfp4.layout import KVPageLayout
from vllm_nvfp4.paged_torch import attend_one_sequence


def torch_varlen(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, softmax_scale,
                 causal, softcap, out, window_size=(-1, -1), s_aux=None):
    """``flash_attn_varlen_func``'s contract (causal, bottom-right aligned, ``window_size``
    ``(left, 0)``: keys ``pos - left .. pos``; ``s_aux``: sink logits), in torch."""
    assert causal and window_size[1] in (-1, 0)
    window = window_size[0] + 1 if window_size[0] >= 0 else None
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
    assert max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:]))
    for i in range(len(cq) - 1):
        out[cq[i]:cq[i + 1]] = attend_one_sequence(
            q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], softmax_scale, window,
            softcap or None, s_aux)


def test_plan_groups_bounds_each_groups_context():
    qsl = torch.tensor([0, 1, 2, 10, 20, 23, 30])
    lens = torch.tensor([100, 50, 30, 40, 5, 90])
    groups = plan_prefill_groups(qsl, lens, 2, 72, torch.device("cpu"))
    assert [(g.req_begin, g.req_end, g.tok_begin, g.tok_end) for g in groups] == [
        (2, 4, 2, 20), (4, 5, 20, 23), (5, 6, 23, 30)]  # 70 + 5 > 72; 90 > 72 alone
    first = groups[0]
    assert (first.max_query_len, first.max_seq_len, first.total_kv) == (10, 40, 70)
    assert first.cu_seqlens_q.tolist() == [0, 8, 18] and first.cu_seqlens_k.tolist() == [0, 30, 70]
    assert first.cu_seqlens_q.dtype == first.cu_seqlens_k.dtype == torch.int32
    assert plan_prefill_groups(qsl, lens, 6, 72, torch.device("cpu")) == ()


@pytest.mark.parametrize("kf,vf", [("nvfp4", "nvfp4"), ("fp8", "nvfp4"), ("nvfp4", "fp8")])
@pytest.mark.parametrize("cap", [None, 30.0])
def test_mixed_batch_split_matches_paged_attention(kf, vf, cap):
    """Decodes through the paged kernel + prefill groups through dense K/V give the same output
    as paged attention over the whole batch."""
    lay = KVPageLayout(2, 64, 16, kf, vf)
    seqs = [(40, 1), (33, 1), (57, 9), (20, 20), (70, 3)]  # two decodes first, as vLLM orders
    batch = make_batch(lay, seqs, num_q_heads=6, seed=3)
    scale = 0.125
    want = torch.empty_like(batch.query)
    ops.paged_attention(batch.query, batch.cache, lay, batch.k_scale, batch.v_scale,
                        batch.block_table, batch.seq_lens, batch.query_start_loc,
                        batch.max_query_len, batch.max_seq_len, scale, want, logits_soft_cap=cap)
    got = torch.full_like(batch.query, float("nan"))
    ops.paged_attention(batch.query[:2], batch.cache, lay, batch.k_scale, batch.v_scale,
                        batch.block_table[:2], batch.seq_lens[:2], batch.query_start_loc[:3], 1,
                        batch.max_seq_len, scale, got[:2], logits_soft_cap=cap)
    groups = plan_prefill_groups(batch.query_start_loc, batch.seq_lens, 2, 80, torch.device("cpu"))
    assert len(groups) == 2  # 57 + 20 fit in 80 rows, 70 does not
    for group in groups:
        dense_prefill(batch.query, got, batch.cache, lay, batch.k_scale, batch.v_scale,
                      batch.block_table, batch.seq_lens, group, scale, cap, torch_varlen)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_plan_groups_with_a_window_counts_only_visible_keys():
    """Under a window w a request of q queries over L keys needs keys from L - q - w + 1 on:
    the groups bound (and dequantize) only those."""
    qsl = torch.tensor([0, 1, 11, 13, 43])
    lens = torch.tensor([100, 500, 8, 40])
    groups = plan_prefill_groups(qsl, lens, 1, 40, torch.device("cpu"), sliding_window=16)
    # request 1: 10 queries at 490..499 see keys 475..499 (25); request 2: all 8; request 3: 40
    assert [(g.req_begin, g.req_end, g.total_kv) for g in groups] == [(1, 3, 33), (3, 4, 40)]
    assert groups[0].kv_starts.tolist() == [475, 0] and groups[0].cu_seqlens_k.tolist() == [0, 25, 33]
    assert groups[0].max_seq_len == 25
    assert groups[1].kv_starts is None  # 40 keys, 30 queries: every key is visible to one


def bf16_sinks(sinks: torch.Tensor) -> torch.Tensor:
    """Sink logits that bf16 holds exactly: FlashAttention 3 takes ``s_aux`` in bf16 only (the
    dense prefill converts), the paged kernels read FP32; gpt-oss stores its sinks in bf16."""
    return sinks.to(torch.bfloat16).float()


def split_vs_whole(batch, scale, window, sinks, attention, max_rows, key0_shift=None,
                   **attention_kwargs):
    """``(got, want)``: the first request decoded paged + the rest through dense prefill groups
    (planned with the window), against paged attention over the whole batch; ``key0_shift``: the
    sink key stored uncentered, in every path."""
    lay = batch.layout
    paged = (batch.cache, lay, batch.k_scale, batch.v_scale)
    want = torch.empty_like(batch.query)
    ops.paged_attention(batch.query, *paged, batch.block_table, batch.seq_lens,
                        batch.query_start_loc, batch.max_query_len, batch.max_seq_len, scale, want,
                        sliding_window=window, sinks=sinks, key0_shift=key0_shift)
    got = torch.full_like(batch.query, float("nan"))
    ops.paged_attention(batch.query[:1], *paged, batch.block_table[:1], batch.seq_lens[:1],
                        batch.query_start_loc[:2], 1, batch.max_seq_len, scale, got[:1],
                        sliding_window=window, sinks=sinks, key0_shift=key0_shift)
    groups = plan_prefill_groups(batch.query_start_loc.cpu(), batch.seq_lens.cpu(), 1, max_rows,
                                 batch.query.device, sliding_window=window)
    if window is not None:
        assert any(g.kv_starts is not None for g in groups)
    for group in groups:
        dense_prefill(batch.query, got, *paged, batch.block_table, batch.seq_lens, group, scale,
                      None, attention, sliding_window=window, sinks=sinks, key0_shift=key0_shift,
                      **attention_kwargs)
    return got, want


def random_key0_shift(lay: KVPageLayout, seed: int, device: str = "cpu") -> torch.Tensor:
    """A non-zero ``key0_shift [H, D]`` of the keys' size, the last head 0 (stored centered)."""
    shift = torch.randn(lay.num_kv_heads, lay.head_dim, generator=torch.Generator().manual_seed(seed))
    shift[-1] = 0.0
    return (2.0 * shift).to(device)


@pytest.mark.parametrize("kf,vf", [("nvfp4", "fp8"), ("fp8", "nvfp4")])
@pytest.mark.parametrize("window,sinks", [(11, False), (None, True), (7, True)])
def test_window_and_sinks_match_paged_attention(kf, vf, window, sinks):
    """Sliding window (only the visible keys dequantized) and attention sinks through the dense
    path give the paged attention's output."""
    lay = KVPageLayout(2, 64, 16, kf, vf)
    batch = make_batch(lay, [(40, 1), (57, 9), (20, 20), (70, 3)], num_q_heads=8, seed=7)
    s_aux = bf16_sinks(random_sinks(8, seed=2)) if sinks else None
    got, want = split_vs_whole(batch, 0.2, window, s_aux, torch_varlen, 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kf,vf,window", [("nvfp4", "fp8", None), ("fp8", "nvfp4", 11)])
def test_uncentered_sink_key_matches_paged_attention(kf, vf, window):
    """With ``key0_shift`` the dense prefill (position 0's dense key shifted, not with a window
    start past it) gives the paged attention's output, which the shift changes."""
    lay = KVPageLayout(2, 64, 16, kf, vf)
    batch = make_batch(lay, [(40, 1), (57, 9), (20, 20), (70, 3)], num_q_heads=8, seed=8)
    shift = random_key0_shift(lay, 3)
    got, want = split_vs_whole(batch, 0.2, window, None, torch_varlen, 80, key0_shift=shift)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, plain = split_vs_whole(batch, 0.2, window, None, torch_varlen, 80)
    assert (plain - want).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window,sinks,key0", [(None, False, False), (128, True, False),
                                               (1024, False, False), (None, False, True),
                                               (128, False, True)])
def test_flash_attention_window_and_sinks_on_cuda(window, sinks, key0):
    """The real vLLM FlashAttention (FA3 on Hopper) through the dense path, bf16, against the
    paged kernels: sliding window (visible keys only), sinks (``s_aux``, FA3) and the sink key
    stored uncentered (``key0_shift``)."""
    from vllm_nvfp4.integration.dense_prefill import dense_prefill_supports, flash_varlen

    if flash_varlen() is None or not dense_prefill_supports(64, sinks):
        pytest.skip("no vLLM FlashAttention (with sinks: version 3) here")
    attention, version = flash_varlen()
    lay = KVPageLayout(8, 64, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(3000, 1), (2500, 700), (1500, 1500)], 64, q_dtype=torch.bfloat16,
                       kv_dtype=torch.bfloat16, device="cuda", seed=4, write_backend="triton")
    s_aux = bf16_sinks(random_sinks(64, seed=5, device="cuda")) if sinks else None
    shift = random_key0_shift(lay, 6, "cuda") if key0 else None
    got, want = split_vs_whole(batch, 0.125, window, s_aux, attention, 8192, key0_shift=shift,
                               fa_version=version)
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert torch.isfinite(got).all() and rel < 1e-2, f"relative error {rel:.2e}"
