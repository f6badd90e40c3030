"""The torch path of the ops: bit-exact cache writes and paged attention vs a float64 reference."""

import itertools
import math

import pytest
import torch

from paged_cases import check_written_bytes, make_batch, reference_attention, run_attention, write_case
from vllm_nvfp4 import ops
from vllm_nvfp4.layout import KVPageLayout, allocate_cache
from vllm_nvfp4.paged_torch import read_kv_from_cache

FORMATS = ("fp8", "nvfp4")
FMT_PAIRS = list(itertools.product(FORMATS, FORMATS))


@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h,d,b", [(2, 64, 16), (3, 128, 32)])
def test_write_is_bit_exact(kf, vf, dtype, h, d, b):
    lay = KVPageLayout(h, d, b, kf, vf)
    key, value, slots, cache, ks, vs = write_case(lay, 37, dtype, seed=h * d + b)
    before = cache.clone()
    ops.write_kv_cache(key, value, cache, slots, lay, ks, vs)
    check_written_bytes(lay, before, cache, key, value, slots, ks, vs)


@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
def test_write_nonfinite_stays_in_its_block(kf, vf):
    lay = KVPageLayout(2, 64, 16, kf, vf)
    key, value, slots, cache, ks, vs = write_case(lay, 9, torch.float32, seed=3, nan=True)
    slots = torch.tensor([0, 4, 21, 5, -1, 30, 2, 17, -1])  # poisoned tokens 1, 2 -> slots 4, 21
    before = cache.clone()
    ops.write_kv_cache(key, value, cache, slots.to(torch.int32), lay, ks, vs)
    check_written_bytes(lay, before, cache, key, value, slots, ks, vs)
    k, v = read_kv_from_cache(cache, lay, torch.arange(3), ks, vs)
    written = slots[slots >= 0]
    bad_k, bad_v = ~torch.isfinite(k[written]), ~torch.isfinite(v[written])
    if kf == "nvfp4":  # exactly the 16-block holding the NaN
        assert bad_k.sum() == 16 and bad_k[1, 0, :16].all()
    else:
        assert bad_k.sum() == 1 and bad_k[1, 0, 3]
    if vf == "nvfp4":  # Inf: its block decodes to NaN
        assert bad_v.sum() == 16 and bad_v[2, 1, -16:].all()
    else:  # FP8 saturates Inf to 448 * scale
        assert bad_v.sum() == 0 and v[21, 1, -1] == 448 * vs[1]


SEQ_MIXES = [
    [(1, 1)],  # a single token
    [(37, 1), (5, 1), (70, 1)],  # decode, odd lengths
    [(23, 23), (41, 9), (16, 16), (33, 1)],  # prefill, chunked prefill on a prefix, decode
]


@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
@pytest.mark.parametrize("seqs", SEQ_MIXES)
@pytest.mark.parametrize("hkv,group,d,b", [(2, 2, 64, 16), (1, 3, 128, 32), (2, 1, 256, 16)])
def test_attention_matches_float64(kf, vf, seqs, hkv, group, d, b):
    lay = KVPageLayout(hkv, d, b, kf, vf)
    batch = make_batch(lay, seqs, hkv * group, seed=len(seqs) + d)
    got = run_attention(batch)
    want = reference_attention(batch, 1.0 / math.sqrt(d))
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window,cap", [(7, None), (None, 5.0), (16, 2.0)])
def test_sliding_window_and_soft_cap(window, cap):
    lay = KVPageLayout(2, 64, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(40, 13), (29, 1), (18, 18)], 4, seed=11)
    got = run_attention(batch, sliding_window=window, logits_soft_cap=cap, softmax_scale=0.3)
    want = reference_attention(batch, 0.3, window, cap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_query_and_output(dtype):
    lay = KVPageLayout(2, 128, 16, "nvfp4", "nvfp4")
    batch = make_batch(lay, [(50, 3), (17, 1)], 8, q_dtype=dtype, kv_dtype=dtype, seed=5)
    got = run_attention(batch)
    assert got.dtype == dtype
    want = reference_attention(batch, 1.0 / math.sqrt(128))
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)


def test_api_edge_errors():
    lay = KVPageLayout(2, 64, 16, "fp8", "nvfp4")
    batch = make_batch(lay, [(20, 2)], 4)
    k = torch.randn(3, 2, 64)
    slots = torch.arange(3)
    with pytest.raises(TypeError, match="key"):
        ops.write_kv_cache(k.double(), k, batch.cache, slots, lay, batch.k_scale, batch.v_scale)
    with pytest.raises(ValueError, match="key"):
        ops.write_kv_cache(k[..., :32], k[..., :32], batch.cache, slots, lay, batch.k_scale,
                           batch.v_scale)
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.write_kv_cache(k, k, batch.cache, slots.float(), lay, batch.k_scale, batch.v_scale)
    with pytest.raises(ValueError, match="k_scale"):
        ops.write_kv_cache(k, k, batch.cache, slots, lay, torch.ones(3), batch.v_scale)
    with pytest.raises(ValueError, match="page"):
        ops.write_kv_cache(k, k, batch.cache[:, :-16], slots, lay, batch.k_scale, batch.v_scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        out = torch.empty(2, 3, 64)
        ops.paged_attention(torch.randn(2, 3, 64), batch.cache, lay, batch.k_scale, batch.v_scale,
                            batch.block_table, batch.seq_lens, batch.query_start_loc, 2, 20, 1.0,
                            out)
    with pytest.raises(ValueError, match="block_table"):
        run_attention_with(batch, block_table=batch.block_table.long())
    with pytest.raises(ValueError, match="sliding_window"):
        run_attention(batch, sliding_window=0)
    lay48 = KVPageLayout(1, 48, 16, "fp8", "fp8")
    with pytest.raises(ValueError, match="head_dim 48 is not supported by the Triton"):
        ops.write_kv_cache(torch.randn(1, 1, 48), torch.randn(1, 1, 48),
                           allocate_cache(lay48, 1), torch.zeros(1, dtype=torch.int64), lay48,
                           torch.ones(1), torch.ones(1), backend="triton")


def run_attention_with(batch, **override):
    args = dict(block_table=batch.block_table)
    args.update(override)
    out = torch.empty_like(batch.query)
    return ops.paged_attention(batch.query, batch.cache, batch.layout, batch.k_scale,
                               batch.v_scale, args["block_table"], batch.seq_lens,
                               batch.query_start_loc, 2, 20, 1.0, out)
