"""The torch path of the ops: bit-exact cache writes and paged attention vs a float64 reference."""

import itertools
import math

import pytest
import torch

from paged_cases import (
    check_written_bytes, make_batch, random_sinks, reference_attention, run_attention, write_case,
)
from vllm_nvfp4 import formats, ops, paged_torch
from vllm_nvfp4.layout import KVPageLayout, allocate_cache, nvfp4_packed_from_rows
from vllm_nvfp4.paged_torch import attend_one_sequence, dequantize_tokens, read_kv_from_cache

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


@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 3.0)])
def test_prefill_query_chunks_change_nothing(monkeypatch, window, cap):
    """Prefill attends its query rows a chunk at a time (bounded FP32 logits); a chunk of 7 rows,
    smaller than every prompt here and not dividing them, gives the unchunked result and the
    float64 reference (chunked prefill with a cached context included)."""
    lay = KVPageLayout(2, 64, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(45, 45), (30, 12), (9, 1), (23, 23)], 4, seed=5)
    whole = run_attention(batch, sliding_window=window, logits_soft_cap=cap)
    monkeypatch.setattr(paged_torch, "PREFILL_QUERY_CHUNK", 7)
    chunked = run_attention(batch, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-4)  # FP32 summation order
    want = reference_attention(batch, 1.0 / math.sqrt(64), window, cap)
    torch.testing.assert_close(chunked.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window,cap", [(7, None), (None, 5.0), (16, 2.0)])
def test_sliding_window_and_soft_cap(window, cap):
    lay = KVPageLayout(2, 64, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(40, 13), (29, 1), (18, 18)], 4, seed=11)
    got = run_attention(batch, sliding_window=window, logits_soft_cap=cap, softmax_scale=0.3)
    want = reference_attention(batch, 0.3, window, cap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


# (num_kv_heads, query heads per KV head, head_dim): the ratios 16:2 and 24:4 (Qwen3.5/3.6), 8:1
# (gpt-oss's 64:8 per KV head), MQA, and the head dims 256 (Gemma 3) and 512 (Gemma 4 global)
SINK_SHAPES = [(2, 8, 64), (4, 6, 32), (1, 8, 256), (1, 5, 512)]


@pytest.mark.parametrize("kf,vf", FMT_PAIRS)
@pytest.mark.parametrize("window,cap", [(None, None), (11, None), (None, 4.0), (7, 3.0)])
def test_sinks_match_float64(kf, vf, window, cap):
    """Sinks with and without a window / soft-cap, decode + prefill + chunked prefill, GQA 8:1."""
    lay = KVPageLayout(2, 64, 16, kf, vf)
    batch = make_batch(lay, [(29, 29), (41, 6), (17, 1), (3, 1)], 16, seed=21)
    sinks = random_sinks(16, seed=4)
    got = run_attention(batch, sliding_window=window, logits_soft_cap=cap, softmax_scale=0.2,
                        sinks=sinks)
    want = reference_attention(batch, 0.2, window, cap, sinks)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    # the sinks change the result (they take weight off every real key)
    plain = reference_attention(batch, 0.2, window, cap)
    assert (want - plain).abs().max() > 0.1


@pytest.mark.parametrize("hkv,group,d", SINK_SHAPES)
def test_sinks_gqa_ratios_and_head_dims(hkv, group, d):
    lay = KVPageLayout(hkv, d, 16, "nvfp4", "nvfp4")
    batch = make_batch(lay, [(21, 21), (35, 1), (19, 4)], hkv * group, seed=d + group)
    sinks = random_sinks(hkv * group, seed=d)
    got = run_attention(batch, sliding_window=9, sinks=sinks)
    want = reference_attention(batch, 1.0 / math.sqrt(d), 9, None, sinks)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_sinks_are_those_of_gpt_oss():
    """The definition is the model's own: transformers' gpt-oss eager attention (sink logit
    concatenated to the masked logits, softmax, sink column dropped), with a sliding window."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(2)
    hkv, group, n, d, window = 2, 4, 23, 64, 6
    q = torch.randn(n, hkv * group, d, generator=gen, dtype=torch.float64)
    k = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64)
    sinks = random_sinks(hkv * group, seed=3).double()
    pos = torch.arange(n)
    visible = (pos.view(1, -1) <= pos.view(-1, 1)) & (pos.view(1, -1) > pos.view(-1, 1) - window)
    mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=group, training=False)
    want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], mask[None, None], scaling=0.125)
    got = attend_one_sequence(q, k, v, 0.125, window, None, sinks)
    torch.testing.assert_close(got, want[0], atol=1e-12, rtol=1e-12)


def test_sinks_edge_errors_and_dtypes():
    lay = KVPageLayout(2, 64, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(20, 2), (9, 1)], 4, seed=1)
    sinks = random_sinks(4, seed=1)
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        run_attention(batch, sinks=sinks[:2])
    with pytest.raises(TypeError, match="sinks"):
        run_attention(batch, sinks=sinks.double())
    # bf16 sinks (the model's parameter dtype) are read as FP32: same result as their FP32 values
    half = sinks.bfloat16()
    torch.testing.assert_close(run_attention(batch, sinks=half),
                               run_attention(batch, sinks=half.float()), rtol=0, atol=0)


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


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_dequantization_is_bit_identical_to_formats(fmt):
    """Random cache bytes (NaN and zero block scales included) decode exactly as formats.py does."""
    lay = KVPageLayout(3, 64, 16, fmt, fmt)
    gen = torch.Generator().manual_seed(7)
    cache = allocate_cache(lay, 5, row_stride=lay.page_bytes + 16)
    cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8))
    scale = torch.rand(3, generator=gen) + 0.1
    ids = torch.tensor([4, 1, 1])
    got = dequantize_tokens(cache, lay, "k", ids.view(1, -1), scale)[0].transpose(0, 1)  # [48, H, D]
    data = lay.data_plane(cache, "k")[ids].transpose(1, 2).reshape(48, 3, -1)  # [tokens, H, W]
    if fmt == "fp8":
        want = formats.fp8_dequantize(data.view(torch.float8_e4m3fn), scale.view(-1, 1))
    else:
        sc = lay.scale_plane(cache, "k")[ids].transpose(1, 2).reshape(48, 3, -1).view(torch.float8_e4m3fn)
        want = formats.nvfp4_dequantize(nvfp4_packed_from_rows(data), sc, scale)
        assert torch.isnan(want).any() and (want == 0).any()  # the case covers NaN and zero scales
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    cut = dequantize_tokens(cache, lay, "k", ids.view(1, -1), scale, torch.tensor([21]))[0].transpose(0, 1)
    torch.testing.assert_close(cut[:21], want[:21], rtol=0, atol=0, equal_nan=True)
    assert (cut[21:] == 0).all()  # past the length: exact zeros, never the stale NaN


def test_decode_batch_ignores_stale_bytes_and_keeps_nan_in_its_sequence():
    """Bytes past each sequence's end (here NaN everywhere) never reach the result; a NaN inside one
    sequence's context makes only that sequence's output NaN."""
    lay = KVPageLayout(2, 64, 16, "nvfp4", "fp8")
    seqs = [(37, 1), (5, 1), (70, 1)]
    batch = make_batch(lay, seqs, 4, seed=3)
    clean = run_attention(batch)
    poisoned = batch.cache.clone()
    nblk = [-(-l // 16) for l, _ in seqs]
    in_use = {int(b) for s, n in enumerate(nblk) for b in batch.block_table[s, :n]}
    spare = [b for b in range(poisoned.shape[0]) if b not in in_use]
    for s, (l, _) in enumerate(seqs):  # padding entries -> a spare block; stale tail slots -> NaN
        batch.block_table[s, nblk[s]:] = spare[s % len(spare)]
        for which in ("k", "v"):
            lay.data_plane(poisoned, which)[batch.block_table[s, nblk[s] - 1].long(), :, l % 16 or 16:] = 0xFF
    for which in ("k", "v"):
        lay.data_plane(poisoned, which)[spare] = 0xFF
    batch.cache = poisoned
    torch.testing.assert_close(run_attention(batch), clean, rtol=0, atol=0)
    lay.data_plane(batch.cache, "v")[batch.block_table[1, 0].long(), 0, 2] = 0x7F  # NaN in seq 1's context
    got = run_attention(batch)
    assert torch.isnan(got[1]).any() and not torch.isnan(got[[0, 2]]).any()


def test_layer_ops_checks_the_layer_once_and_each_new_step():
    """LayerOps refuses bad fixed arguments when built, with the functions' errors; a step's
    metadata is checked again whenever new tensors come; results and bytes equal the one-shot
    functions'."""
    lay = KVPageLayout(2, 64, 16, "nvfp4", "fp8")
    batch = make_batch(lay, [(20, 2), (9, 1)], 4, seed=3)
    sinks = random_sinks(4, seed=3)
    with pytest.raises(ValueError, match="k_scale"):
        ops.LayerOps(batch.cache, lay, torch.ones(3), batch.v_scale)
    with pytest.raises(ValueError, match="page"):
        ops.LayerOps(batch.cache[:, :-16], lay, batch.k_scale, batch.v_scale)
    with pytest.raises(ValueError, match="sliding_window"):
        ops.LayerOps(batch.cache, lay, batch.k_scale, batch.v_scale, sliding_window=0)
    with pytest.raises(TypeError, match="sinks"):
        ops.LayerOps(batch.cache, lay, batch.k_scale, batch.v_scale, sinks=sinks.double())
    layer = ops.LayerOps(batch.cache, lay, batch.k_scale, batch.v_scale, sliding_window=12,
                         logits_soft_cap=3.0, sinks=sinks)
    step = (batch.block_table, batch.seq_lens, batch.query_start_loc, batch.max_query_len,
            batch.max_seq_len, 0.2)
    got = layer.attend(batch.query, *step, torch.empty_like(batch.query))
    want = ops.paged_attention(batch.query, batch.cache, lay, batch.k_scale, batch.v_scale, *step,
                               torch.empty_like(batch.query), sliding_window=12,
                               logits_soft_cap=3.0, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="block_table"):
        layer.attend(batch.query, batch.block_table.long(), *step[1:], torch.empty_like(batch.query))
    with pytest.raises(ValueError, match="query_start_loc"):
        layer.attend(batch.query, batch.block_table, batch.seq_lens, batch.query_start_loc[:-1],
                     *step[3:], torch.empty_like(batch.query))
    with pytest.raises(ValueError, match=r"sinks must have shape \(8,\)"):
        layer.attend(torch.randn(3, 8, 64), *step, torch.empty(3, 8, 64))
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
    slots = torch.tensor([5, 40, 77])
    with pytest.raises(ValueError, match="slot_mapping"):
        layer.write(k, v, slots.float())
    with pytest.raises(ValueError, match="key"):
        layer.write(k[..., :32], v[..., :32], slots)
    expected = batch.cache.clone()
    ops.write_kv_cache(k, v, expected, slots, lay, batch.k_scale, batch.v_scale)
    layer.write(k, v, slots)
    assert torch.equal(batch.cache, expected)
