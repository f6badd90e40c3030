"""The Gluon FP8-tensor-core K-side prototypes against the float64 reference (CUDA with Triton's
Gluon only: the interpreter does not run Gluon kernels; sm_90 compile counts are in
``benchmarks/compile_gluon_sm90.py``)."""

from __future__ import annotations

import pytest
import torch

from paged_cases import make_batch, roundtrip
from vllm_nvfp4.layout import KVPageLayout

from vllm_nvfp4.formats import e2m1_value
from vllm_nvfp4.layout import nvfp4_element_order

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (no interpreter)")
KV_HEADS = 3


def _as_e4m3(byte: torch.Tensor) -> torch.Tensor:
    return byte.to(torch.uint8).view(torch.float8_e4m3fn).float()


def test_bit_placement_gives_e2m1_times_2_to_the_minus_6_for_every_byte():
    x = torch.arange(256, dtype=torch.int32)  # one byte: low nibble, high nibble
    lo = ((x << 4) & 0x80) | ((x << 2) & 0x1C)  # the prototype's inline asm, per byte
    hi = (x & 0x80) | ((x >> 2) & 0x1C)
    assert torch.equal(_as_e4m3(lo) * 64, e2m1_value((x & 0xF).to(torch.uint8)))
    assert torch.equal(_as_e4m3(hi) * 64, e2m1_value((x >> 4).to(torch.uint8)))


def test_byte_of_a_group_holds_the_elements_the_prototype_assumes():
    order = nvfp4_element_order(128).view(2, 32, 2)  # [group, byte, low/high nibble] -> element
    b = torch.arange(32)
    for g in range(2):
        assert torch.equal(order[g, :, 0], 64 * g + 32 * (b % 2) + b // 2)
        assert torch.equal(order[g, :, 1], 64 * g + 16 + 32 * (b % 2) + b // 2)
        for plane in range(2):  # the block whose scale each MMA pair's partial score takes
            assert torch.equal(order[g, :, plane] // 16, 4 * g + 2 * (b % 2) + plane)


def _run(kernel: str, group: int, tile: int, seqs: list[tuple[int, int]], splits: int = 1,
         write_scores: bool = True, seed: int = 7):
    """``(batch, query bf16 [S, HQ, D], out)``: ``out`` fp32 ``[S, HQ, max_len]`` scores (NaN past
    each length) or, without ``write_scores``, ``[S, HQ, splits]`` each split's largest score."""
    from benchmarks import gluon_qk

    fn, warps = gluon_qk.PROTOTYPES[kernel]
    lay = KVPageLayout(KV_HEADS, 128, 16, "nvfp4", "nvfp4")
    batch = make_batch(lay, seqs, num_q_heads=KV_HEADS * group, q_dtype=torch.bfloat16,
                       device="cuda", seed=seed)
    q = batch.query.contiguous()  # one decode query row per sequence
    out = torch.full((len(seqs), KV_HEADS * group, batch.max_seq_len if write_scores else splits),
                     float("nan"), device="cuda")
    fn[(len(seqs), KV_HEADS, splits)](
        q, out, batch.cache, batch.k_scale.float().contiguous(), batch.block_table,
        batch.seq_lens, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        batch.cache.stride(0), batch.block_table.stride(0),
        G=group, D=128, BLOCK=16, K_DATA=lay.k_data_offset,
        K_SCALE=lay.k_scale_offset, TILE_N=tile, NUM_SPLITS=splits, WRITE_SCORES=write_scores,
        num_warps=warps)
    torch.cuda.synchronize()
    return batch, q, out


@needs_gpu
@pytest.mark.parametrize("kernel,group,tile", [("mma_v2", 4, 64), ("mma_v2", 8, 64),
                                               ("mma_v2", 4, 32), ("wgmma", 4, 64),
                                               ("wgmma", 8, 64), ("wgmma", 2, 64)])
def test_scores_match_the_float64_reference(kernel, group, tile):
    _skip_without_wgmma(kernel)
    seqs = [(1, 1), (77, 1), (64, 1), (203, 1), (128, 1)]  # odd lengths, whole tiles, tails
    batch, q, out = _run(kernel, group, tile, seqs, splits=3)
    for i, (length, _) in enumerate(seqs):
        kd = roundtrip(batch.keys[i], "nvfp4", batch.k_scale)  # [L, H, D] float64
        qd = q[i].double().cpu().view(KV_HEADS, group, 128)
        want = torch.einsum("hgd,lhd->hgl", qd, kd).reshape(KV_HEADS * group, length)
        # q as E4M3 hi + lo: relative error <= 2^-8, plus lo's subnormal step 2^-9 of qs / 2
        qs = qd.abs().amax(dim=(1, 2), keepdim=True) / 448  # [H, 1, 1], per KV head's group
        bound = (torch.einsum("hgd,lhd->hgl", 2.0 ** -8 * qd.abs() + 2.0 ** -10 * qs, kd.abs())
                 .reshape(KV_HEADS * group, length))
        got = out[i, :, :length].double().cpu()
        err = (got - want).abs()
        assert bool((err <= 1.01 * bound + 1e-6).all()), float((err / bound).max())
        assert bool(out[i, :, length:].isnan().all()), "no key past seq_len is written"


def _skip_without_wgmma(kernel: str) -> None:
    if kernel == "wgmma" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("wgmma needs sm_90")


@needs_gpu
@pytest.mark.parametrize("kernel", ["mma_v2", "wgmma"])
def test_max_mode_gives_each_splits_largest_score(kernel):
    _skip_without_wgmma(kernel)
    seqs = [(77, 1), (203, 1), (1000, 1)]
    splits, tile = 4, 64
    _, _, scores = _run(kernel, 4, tile, seqs, splits=1)
    _, _, maxima = _run(kernel, 4, tile, seqs, splits=splits, write_scores=False)
    for i, (length, _) in enumerate(seqs):
        tiles = -(-length // tile)
        per = -(-tiles // splits)
        for split in range(splits):
            lo, hi = split * per * tile, min((split + 1) * per * tile, length)
            want = (scores[i, :, lo:hi].amax(dim=-1) if lo < hi
                    else torch.full_like(maxima[i, :, split], float("-inf")))
            torch.testing.assert_close(maxima[i, :, split], want, rtol=0, atol=0)
