"""The sink key stored uncentered (policy ``k_sink_uncentered``): the policy field, the torch
path against the fake-quantized reference bit for bit, which tokens the write marks as position 0,
and the calibration flag."""

from __future__ import annotations

import pytest
import torch

from vllm_nvfp4 import ops, paged_torch
from vllm_nvfp4.calibration.kv_hooks import KVObserver, fake_quantize, with_uncentered_sink
from vllm_nvfp4.calibration.scales import scaled_policy
from vllm_nvfp4.key_transform import sink_shift, stored_keys
from vllm_nvfp4.layout import KVPageLayout, allocate_cache
from vllm_nvfp4.policy import KVPolicy, LayerPolicy, PolicyError

H, D = 3, 64


def _row(**kw) -> dict:
    return {"index": 0, "k": "nvfp4", "v": "fp8", "k_center": [[0.5] * D] * H, **kw}


def _policy(**kw) -> KVPolicy:
    return KVPolicy.from_dict({"format": "vllm-nvfp4-policy", "version": 1, "num_layers": 1,
                               "layers": [_row(**kw)]})


# ---------------------------------------------------------------------------- the policy field
def test_policy_flag_reads_writes_and_refuses_what_it_cannot_serve():
    assert _policy(k_sink_uncentered=True).layers[0].sink_heads(H) == (True,) * H
    per_head = _policy(k_sink_uncentered=[True, False, True])
    assert per_head.layers[0].sink_heads(H) == (True, False, True)
    again = KVPolicy.from_dict(per_head.to_dict())
    assert again.layers[0].k_sink_uncentered == (True, False, True)
    assert _policy(k_sink_uncentered=False).layers[0].k_sink_uncentered is None
    assert "k_sink_uncentered" not in _policy(k_sink_uncentered=[False] * H).to_dict()["layers"][0]
    with pytest.raises(PolicyError, match="needs k_center"):
        LayerPolicy("nvfp4", "nvfp4", k_sink_uncentered=True)
    with pytest.raises(PolicyError, match="true/false or a non-empty list"):
        _policy(k_sink_uncentered="yes")
    with pytest.raises(PolicyError, match="2 per-head flags, k_center has 3"):
        _policy(k_sink_uncentered=[True, False])


# ---------------------------------------------------------------------------- torch path vs reference
def _transforms(gen: torch.Generator):
    mu = torch.randn(H, D, generator=gen) * 3.0
    lam = torch.rand(H, D, generator=gen) * 2.0 + 0.5
    perm = torch.stack([torch.randperm(D, generator=gen) for _ in range(H)])
    return mu, lam, perm


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_torch_path_decodes_the_uncentered_sink_key_as_the_reference(fmt):
    """Keys written as the integration writes them (position 0 without ``mu``, the rest
    centered; permuted, smoothed) and read back with ``key0_shift`` are bit for bit the
    reference hook's FP32 keys (:func:`with_uncentered_sink`): every position, every head,
    one head stored centered; paged attention then matches attention on those keys."""
    gen = torch.Generator().manual_seed(1)
    mu, lam, perm = _transforms(gen)
    heads = torch.tensor([True, False, True])
    key = (torch.randn(40, H, D, generator=gen) * 4.0 + 2.0).bfloat16()  # [T, H, D] as vLLM has it
    k_scale = torch.full((H,), 0.02 if fmt == "fp8" else 0.004)
    lay = KVPageLayout(H, D, 16, fmt, "fp8")
    cache = allocate_cache(lay, 5, "cpu")
    cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8))
    blocks = torch.tensor([3, 0, 4], dtype=torch.int32)
    slots = blocks[torch.arange(40) // 16].long() * 16 + torch.arange(40) % 16
    first = torch.arange(40) == 0
    k0_center = torch.where(heads[:, None], 0.0, mu)
    center = torch.where(first[:, None, None], k0_center, mu)
    ops.write_kv_cache(stored_keys(key, center, lam, perm), key, cache, slots, lay, k_scale,
                       torch.full((H,), 0.05), backend="torch")
    shift = torch.where(heads[:, None], sink_shift(mu, lam), 0.0)
    got, _ = paged_torch.read_kv_from_cache(cache, lay, blocks, k_scale, torch.full((H,), 0.05), 40,
                                            key0_shift=shift)
    # the reference: transformers' layout [1, H, T, D]
    raw = key.transpose(0, 1).unsqueeze(0)
    centered = stored_keys(raw, mu[:, None, :], lam[:, None, :], perm[:, None, :])
    stored = fake_quantize(centered, fmt, k_scale, dtype=torch.float32)
    want = with_uncentered_sink(stored, raw, fmt, k_scale, mu, lam, perm, heads)
    assert torch.equal(got, want[0].transpose(0, 1))
    plain = fake_quantize(centered, fmt, k_scale, dtype=torch.float32)[0].transpose(0, 1)
    assert not torch.equal(got[0, 0], plain[0, 0]) and torch.equal(got[0, 1], plain[0, 1])
    assert torch.equal(got[1:], plain[1:])
    # paged attention (a decode at position 39) over those keys
    q = torch.randn(1, 2 * H, D, generator=gen)
    out = torch.empty_like(q)
    ops.paged_attention(q, cache, lay, k_scale, torch.full((H,), 0.05), blocks.view(1, -1),
                        torch.tensor([40], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                        1, 40, 0.125, out, backend="torch", key0_shift=shift)
    v = paged_torch.read_kv_from_cache(cache, lay, blocks, k_scale, torch.full((H,), 0.05), 40)[1]
    ref = paged_torch.attend_one_sequence(q, got, v, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_key0_shift_with_a_logits_soft_cap_is_refused():
    lay = KVPageLayout(H, D, 16, "nvfp4", "fp8")
    with pytest.raises(ValueError, match="soft-cap"):
        ops.LayerOps(allocate_cache(lay, 2, "cpu"), lay, torch.ones(H), torch.ones(H),
                     logits_soft_cap=30.0, key0_shift=torch.zeros(H, D))
    with pytest.raises(ValueError, match=r"key0_shift must be contiguous, of shape \(3, 64\)"):
        ops.LayerOps(allocate_cache(lay, 2, "cpu"), lay, torch.ones(H), torch.ones(H),
                     key0_shift=torch.zeros(H, D // 2))


# ---------------------------------------------------------------------------- which tokens are position 0
@pytest.mark.vllm
def test_mark_first_keys_finds_position_0_from_the_metadata_alone():
    """Per token: a fresh prefill's first token, a one-token prompt, nothing of a later chunk, a
    prefix-cache hit, a decode, a speculative verify or an empty (padded) request."""
    from vllm_nvfp4.integration.backend import mark_first_keys

    # requests: decode (ctx 9), fresh prefill of 4, empty padding, 1-token prompt, later chunk,
    # prefix hit (12 cached + 3 new), verify (1 + 2 tokens at ctx 20), fresh prefill of 2
    q_lens = [1, 4, 0, 1, 5, 3, 3, 2]
    seq_lens = [10, 4, 0, 1, 25, 15, 23, 2]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    n = int(qsl[-1])
    counts = torch.full((n + 4,), 7, dtype=torch.int32)
    marks = torch.ones(n + 3, dtype=torch.bool)
    got = mark_first_keys(qsl, torch.tensor(seq_lens, dtype=torch.int32), len(q_lens), counts, marks)
    want = torch.zeros(n + 3, dtype=torch.bool)
    want[[1, 5, 17]] = True  # the fresh prefills' first tokens and the one-token prompt
    assert got is marks and torch.equal(got, want)


@pytest.mark.vllm
def test_mark_first_keys_with_padded_requests_at_a_full_batch():
    """As the builder calls it: ``counts`` one longer than ``marks`` (``N = `` the token budget),
    the batch filling all ``N`` tokens, padded requests (a full CUDA graph's) after it starting
    at ``N``, and stale marks from an earlier step; random batches against the definition."""
    from vllm_nvfp4.integration.backend import mark_first_keys

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        live = int(torch.randint(1, 9, (1,), generator=gen))
        q_lens = torch.randint(0, 5, (live,), generator=gen)
        ctx = torch.randint(0, 3, (live,), generator=gen) * (torch.rand(live, generator=gen) < 0.5)
        pad = int(torch.randint(0, 4, (1,), generator=gen))
        q_all = torch.cat([q_lens, torch.zeros(pad, dtype=q_lens.dtype)])
        qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_all.cumsum(0)]).to(torch.int32)
        seq_lens = torch.cat([ctx + q_lens, torch.zeros(pad, dtype=q_lens.dtype)]).to(torch.int32)
        n = max(int(qsl[-1]), 1) if trial % 2 else int(qsl[-1]) + 3  # even trials: spare rows
        counts = torch.full((n + 1,), 5, dtype=torch.int32)
        marks = torch.ones(n, dtype=torch.bool)
        got = mark_first_keys(qsl, seq_lens, live + pad, counts, marks)
        want = torch.zeros(n, dtype=torch.bool)
        for s in range(live):
            if q_lens[s] > 0 and ctx[s] == 0:
                want[int(qsl[s])] = True
        assert got is marks and torch.equal(got, want), (trial, q_all.tolist(), ctx.tolist())


# ---------------------------------------------------------------------------- calibration
def test_calibration_flags_the_heads_whose_first_key_fits():
    """Per KV head: the first key (uncentered, smoothed) within the K range behind the scales ->
    flagged; one head's first key far outside -> that head alone stays centered; per layer
    scales use the layer's range; without centering the flag is refused."""
    gen = torch.Generator().manual_seed(2)
    obs = KVObserver(1)
    key = torch.randn(2, H, 50, D, generator=gen) + 5.0  # a large shared offset: centering helps
    key[:, :, 0] = torch.randn(2, H, D, generator=gen) * 0.5  # the sink: small uncentered
    key[:, 2, 0, 3] = 40.0  # head 2's sink key exceeds every centered key
    obs.observe(0, key, torch.randn(2, H, 50, D, generator=gen))
    formats = KVPolicy.from_compact("*:nvfp4", 1)
    per_head = scaled_policy(formats, obs, per_head=True, k_center=True, k_sink_uncentered=True)
    assert per_head.layers[0].k_sink_uncentered == (True, True, False)
    smoothed = scaled_policy(formats, obs, per_head=True, k_center=True, k_smooth_alpha=1.0,
                             k_sink_uncentered=True)
    assert smoothed.layers[0].k_sink_uncentered is not None
    assert scaled_policy(formats, obs, k_center=True).layers[0].k_sink_uncentered is None
    with pytest.raises(ValueError, match="needs k_center"):
        scaled_policy(formats, obs, k_sink_uncentered=True)
    key[:, :, 0] = 40.0  # now no head's fits
    obs2 = KVObserver(1)
    obs2.observe(0, key, key)
    assert scaled_policy(formats, obs2, k_center=True, k_sink_uncentered=True).layers[0].k_sink_uncentered is None


def test_layers_with_learned_sinks_are_never_centered():
    """Centering shifts every key's logit by q . mu but not a learned sink logit: a policy row
    with k_center on a sinks layer is refused with what to fix, and calibration with k_center
    centers only the layers without sinks (so none of a sinks layer's keys is flagged)."""
    from vllm_nvfp4.policy import LayerType

    sinks = LayerType("full", sinks=True)
    with pytest.raises(PolicyError, match="learned attention sinks.*drop k_center"):
        LayerPolicy("nvfp4", "nvfp4", k_center=[[0.5] * D] * H, layer_type=sinks)
    gen = torch.Generator().manual_seed(3)
    obs = KVObserver(2)
    for i in range(2):
        key = torch.randn(2, H, 40, D, generator=gen) + 5.0
        key[:, :, 0] = torch.randn(2, H, D, generator=gen) * 0.5
        obs.observe(i, key, torch.randn(2, H, 40, D, generator=gen))
    formats = KVPolicy.from_compact("*:nvfp4", 2, layer_types=[LayerType("full"), sinks])
    got = scaled_policy(formats, obs, k_center=True, k_sink_uncentered=True)
    plain, with_sinks = got.layers
    assert plain.k_center is not None and plain.k_sink_uncentered is not None
    assert with_sinks.k_center is None and with_sinks.k_sink_uncentered is None
    assert with_sinks.k_global_scale == scaled_policy(formats, obs).layers[1].k_global_scale
