"""The Gluon FP8-tensor-core K-side prototype against the float64 reference (CUDA with Triton's
Gluon only: the interpreter does not run Gluon kernels; sm_90 compile counts are in
``benchmarks/compile_gluon_sm90.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.paged_cases import make_batch, roundtrip
from vllm_nvfp4.layout import KVPageLayout

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="Gluon kernels run on the GPU only (no interpreter)")


@pytest.mark.parametrize("group,tile", [(4, 64), (8, 64), (4, 32)])
def test_scores_match_the_float64_reference(group, tile):
    from vllm_nvfp4.kernels.gluon_qk import nvfp4_qk_scores_kernel

    lay = KVPageLayout(3, 128, 16, "nvfp4", "nvfp4")
    seqs = [(1, 1), (77, 1), (64, 1), (203, 1)]  # odd lengths, a whole tile, tails
    batch = make_batch(lay, seqs, num_q_heads=3 * group, q_dtype=torch.bfloat16, device="cuda",
                       seed=7)
    q = batch.query.to(torch.bfloat16).contiguous()  # one decode query row per sequence
    out = torch.full((len(seqs), 3 * group, batch.max_seq_len), float("nan"), device="cuda")
    cache = batch.cache
    nvfp4_qk_scores_kernel[(len(seqs), 3)](
        q, out, cache, batch.k_scale.float().contiguous(), batch.block_table, batch.seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0),
        batch.block_table.stride(0),
        HQ=3 * group, G=group, D=128, BLOCK=16, K_DATA=lay.k_data_offset,
        K_SCALE=lay.k_scale_offset, TILE_N=tile, num_warps=1)
    for i, (length, _) in enumerate(seqs):
        kd = roundtrip(batch.keys[i], "nvfp4", batch.k_scale)  # [L, H, D] float64
        qd = q[i].double().cpu().view(3, group, 128)
        want = torch.einsum("hgd,lhd->hgl", qd, kd).reshape(3 * group, length)
        bound = torch.einsum("hgd,lhd->hgl", qd.abs(), kd.abs()).reshape(3 * group, length)
        got = out[i, :, :length].double().cpu()
        err = (got - want).abs()
        assert bool((err <= 2.0 ** -8 * bound + 1e-6).all()), float((err / bound).max())
        assert bool(out[i, :, length:].isnan().all()), "no key past seq_len is written"
