"""kv_hooks: the hooked transformers forward quantizes K/V exactly as the cache stores them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_nvfp4.calibration.kv_hooks import (
    KVObserver,
    attention_modules,
    fake_quantize,
    kv_cache_quantization,
)
from vllm_nvfp4.testing.models import build_tiny_llama
from vllm_nvfp4.formats import (fp8_dequantize, fp8_quantize, nvfp4_dequantize,
                                nvfp4_dequantize_folded, nvfp4_quantize)
from vllm_nvfp4.policy import (
    DEFAULT_FP8_SCALE,
    DEFAULT_NVFP4_GLOBAL_SCALE,
    KVPolicy,
    LayerPolicy,
    PolicyError,
)


def tiny_model(arch: str = "llama", num_layers: int = 3, dtype: torch.dtype = torch.float32):
    """The shared tiny random model (4 heads, 2 KV heads, head_dim 32) in eval mode."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_llama(num_layers=num_layers, arch=arch)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _ids(n: int = 48, vocab: int = 4096, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


def _manual_forward(model, ids, kv_transform) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Llama forward written out by hand; ``kv_transform(layer, k, v)`` edits post-RoPE K/V.

    Returns (logits [1, T, vocab] fp32, post-RoPE keys per layer [1, kv_heads, T, D]).
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner = model.model
    h = inner.embed_tokens(ids)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    cos, sin = inner.rotary_emb(h, position_ids=pos)
    keys = []
    for i, layer in enumerate(inner.layers):
        att = layer.self_attn
        x = layer.input_layernorm(h)
        b, t, _ = x.shape
        q = att.q_proj(x).view(b, t, -1, att.head_dim).transpose(1, 2)
        k = att.k_proj(x).view(b, t, -1, att.head_dim).transpose(1, 2)
        v = att.v_proj(x).view(b, t, -1, att.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.append(k.detach().clone())
        k, v = kv_transform(i, k, v)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=att.scaling)
        h = h + att.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(h)).float(), keys


def _logits(model, ids, policy=None) -> torch.Tensor:
    with torch.no_grad():
        if policy is None:
            return model(ids, use_cache=False).logits.float()
        with kv_cache_quantization(model, policy) as state:
            out = model(ids, use_cache=False).logits.float()
        assert state.calls == len(attention_modules(model))
        return out


def _kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    lp, lq = ref.log_softmax(-1), other.log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _calibrated(model, ids, fmt: str) -> KVPolicy:
    obs = KVObserver(len(attention_modules(model)))
    with torch.no_grad(), kv_cache_quantization(model, observer=obs):
        model(ids, use_cache=False)
    layers = [
        LayerPolicy(fmt, fmt, k_scale=float(k.max()) / 448, v_scale=float(v.max()) / 448,
                    k_global_scale=float(k.max()) / 2688, v_global_scale=float(v.max()) / 2688)
        for k, v in zip(obs.k_amax, obs.v_amax)
    ]
    return KVPolicy(tuple(layers))


def test_fp8_policy_matches_manual_forward():
    model = tiny_model(num_layers=3)
    ids = _ids()
    s = 0.004  # FP8 scale: amax ~1 -> codes up to ~250, a realistic but not calibrated scale

    def fp8(i, k, v):
        return (fp8_dequantize(fp8_quantize(k, s), s, k.dtype), fp8_dequantize(fp8_quantize(v, s), s, v.dtype))

    with torch.no_grad():
        manual, _ = _manual_forward(model, ids, fp8)
        plain, _ = _manual_forward(model, ids, lambda i, k, v: (k, v))
    hooked = _logits(model, ids, KVPolicy.from_compact("*:fp8", 3).with_layer(0, k_scale=s, v_scale=s)
                     .with_layer(1, k_scale=s, v_scale=s).with_layer(2, k_scale=s, v_scale=s))
    torch.testing.assert_close(hooked, manual, atol=2e-5, rtol=2e-5)
    assert (hooked - plain).abs().max() > 1e-4  # the quantization really happened


def test_observer_records_post_rope_amax_per_head():
    model = tiny_model(num_layers=2)
    ids = _ids()
    obs = KVObserver(2)
    with torch.no_grad(), kv_cache_quantization(model, observer=obs):
        model(ids, use_cache=False)
        _, keys = _manual_forward(model, ids, lambda i, k, v: (k, v))
    for i in range(2):
        torch.testing.assert_close(obs.k_amax[i], keys[i].abs().amax(dim=(0, 2, 3)))
        assert obs.v_amax[i].shape == (2,)
        assert obs.tokens[i] == ids.shape[1]
    assert obs.missing_layers() == []


def test_per_head_scales_quantize_each_head_with_its_own_scale():
    x = torch.randn(1, 3, 10, 32, dtype=torch.bfloat16)
    scales = [0.01, 0.002, 0.0005]
    out = fake_quantize(x, "fp8", scales)
    out_nv = fake_quantize(x, "nvfp4", scales)
    for h, s in enumerate(scales):
        xh = x[:, h]
        torch.testing.assert_close(out[:, h], fp8_dequantize(fp8_quantize(xh, s), s, xh.dtype), atol=0, rtol=0)
        ref = nvfp4_dequantize(*nvfp4_quantize(xh, s), s, dtype=xh.dtype)
        torch.testing.assert_close(out_nv[:, h], ref, atol=0, rtol=0)
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="3 KV heads"):
        fake_quantize(x, "fp8", [0.1, 0.2])


def test_k_smoothing_is_q_times_lam_and_k_over_lam_before_quantization():
    """The hook smooths exactly like the integration: the cache holds quantize(K / lam), the
    query is multiplied by lam; unquantized (FP8 at a tiny scale is near-lossless) the logits
    do not move, and the observer's channel amax feeds the factors."""
    from vllm_nvfp4.calibration.kv_hooks import transform_qk
    from vllm_nvfp4.calibration.scales import smoothing_factors

    q = torch.randn(1, 4, 6, 32)
    k = torch.randn(1, 2, 6, 32)
    lam = torch.rand(2, 32) * 3 + 1
    qs, ks = transform_qk(q, k, lam)
    torch.testing.assert_close(qs[:, 2:] / lam[1, None, :], q[:, 2:])  # heads 2, 3 use KV head 1
    torch.testing.assert_close(qs @ ks.repeat_interleave(2, 1).transpose(-1, -2),
                               q @ k.repeat_interleave(2, 1).transpose(-1, -2), rtol=1e-5, atol=1e-5)
    amax = torch.tensor([[1.0, 1.0, 1.0, 5.0], [2.0, 2.0, 2.0, 2.0]])
    torch.testing.assert_close(smoothing_factors(amax, 1.0),
                               torch.tensor([[1.0, 1.0, 1.0, 2.5], [1.0, 1.0, 1.0, 1.0]]))
    torch.testing.assert_close(smoothing_factors(amax, 0.5)[0, 3], torch.tensor(2.5 ** 0.5))

    model = tiny_model(num_layers=2)
    ids = _ids()
    obs = KVObserver(2)
    with torch.no_grad(), kv_cache_quantization(model, observer=obs):
        model(ids, use_cache=False)
    assert obs.k_channel_amax[0].shape == (2, model.config.head_dim)
    torch.testing.assert_close(obs.k_channel_amax[0].amax(dim=1), obs.k_amax[0])
    lam = smoothing_factors(obs.k_channel_amax[0], 1.0) * 4.0  # x4: far from the identity
    scaled = [(float(obs.k_amax[i].max()) / 448, float(obs.v_amax[i].max()) / 448) for i in range(2)]
    base = KVPolicy.from_compact("*:fp8", 2)
    for i, (ks, vs) in enumerate(scaled):
        base = base.with_layer(i, k_scale=ks, v_scale=vs)
    smoothed = base.with_layer(0, k_scale=scaled[0][0] / 4.0, k_smooth=lam.tolist())
    ref = _logits(model, ids)
    kl_base, kl_smooth = _kl(ref, _logits(model, ids, base)), _kl(ref, _logits(model, ids, smoothed))
    assert kl_smooth < 2 * kl_base + 1e-5, (kl_smooth, kl_base)  # the factors cancel


def test_missing_scales_use_policy_defaults():
    model = tiny_model(num_layers=2)
    ids = _ids()
    bare = KVPolicy.from_compact("0:fp8,1:nvfp4", 2)
    explicit = bare.with_layer(0, k_scale=DEFAULT_FP8_SCALE, v_scale=DEFAULT_FP8_SCALE).with_layer(
        1, k_global_scale=DEFAULT_NVFP4_GLOBAL_SCALE, v_global_scale=DEFAULT_NVFP4_GLOBAL_SCALE
    )
    torch.testing.assert_close(_logits(model, ids, bare), _logits(model, ids, explicit), atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_damage_is_bounded_and_nvfp4_hurts_more_than_fp8(arch):
    model = tiny_model(arch=arch, num_layers=3, dtype=torch.bfloat16)
    ids = _ids(64)
    ref = _logits(model, ids)
    fp8 = _logits(model, ids, _calibrated(model, ids, "fp8"))
    nv = _logits(model, ids, _calibrated(model, ids, "nvfp4"))
    kl_fp8, kl_nv = _kl(ref, fp8), _kl(ref, nv)
    # measured on this model: KL fp8 ~0.05, nvfp4 ~0.5-0.6 (peaky random attention, random tokens)
    assert 0 < kl_fp8 < 0.15
    assert kl_nv > 3 * kl_fp8
    assert (fp8 - ref).abs().max() < 0.25 * ref.abs().max()


def test_cached_generation_quantizes_each_token_once():
    """Decoding with a DynamicCache gives the logits of one full quantized forward."""
    model = tiny_model(num_layers=2)
    ids = _ids(40)
    policy = _calibrated(model, ids, "nvfp4")
    full = _logits(model, ids, policy)
    with torch.no_grad(), kv_cache_quantization(model, policy):
        out = model(ids[:, :30], use_cache=True)
        cache = out.past_key_values
        steps = []
        for t in range(30, 40):
            o = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            steps.append(o.logits[:, -1].float())
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 30:], atol=1e-4, rtol=1e-4)


def test_folded_nvfp4_decoding_matches_manual_forward():
    model = tiny_model(num_layers=2)
    ids = _ids()
    g = 0.002  # amax ~1: block scales ~80-110, products that often need more than 3 mantissa bits

    def folded(i, k, v):
        return tuple(nvfp4_dequantize_folded(*nvfp4_quantize(x, g), g, x.dtype) for x in (k, v))

    policy = KVPolicy.from_compact("*:nvfp4", 2)
    for i in range(2):
        policy = policy.with_layer(i, k_global_scale=g, v_global_scale=g)
    with torch.no_grad():
        manual, _ = _manual_forward(model, ids, folded)
        with kv_cache_quantization(model, policy, nvfp4_decoding="folded"):
            hooked = model(ids, use_cache=False).logits.float()
    torch.testing.assert_close(hooked, manual, atol=2e-5, rtol=2e-5)
    assert (hooked - _logits(model, ids, policy)).abs().max() > 1e-5  # differs from exact
    with pytest.raises(ValueError, match="nvfp4_decoding must be one of exact, folded"):
        with kv_cache_quantization(model, policy, nvfp4_decoding="fold"):
            pass


def test_implementation_restored_and_bad_policy_rejected():
    model = tiny_model(num_layers=2)
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with kv_cache_quantization(model, KVPolicy.from_compact("*:fp8", 2)):
            assert model.config._attn_implementation.startswith("vllm_nvfp4_kv|")
            raise RuntimeError("boom")
    assert model.config._attn_implementation == before
    with pytest.raises(PolicyError, match="3 attention layers"):
        with kv_cache_quantization(model, KVPolicy.from_compact("*:fp8", 3)):
            pass
    with pytest.raises(PolicyError, match="KV heads"):
        with kv_cache_quantization(model, KVPolicy.from_compact("*:fp8", 2).with_layer(0, k_scale=(1.0,) * 3)):
            pass
    # outside the block the model is untouched
    ids = _ids()
    with torch.no_grad():
        a = model(ids, use_cache=False).logits
        b, _ = _manual_forward(model, ids, lambda i, k, v: (k, v))
    torch.testing.assert_close(a.float(), b, atol=2e-5, rtol=2e-5)


def test_k_centering_keeps_softmax_and_the_observer_finds_the_mean():
    """K - mu moves every logit of a query by q . mu: softmax unchanged (float64); the observer's
    channel mean and centered amax match torch on the same keys; calibrated on keys that carry a
    large constant part (Qwen2's K bias), centering gives a far finer K scale and far less
    attention error at FP8 and NVFP4."""
    from vllm_nvfp4.calibration.kv_hooks import transform_qk
    from vllm_nvfp4.calibration.scales import scaled_policy

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 9, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 9, 16, generator=gen, dtype=torch.float64)
    mu = torch.randn(2, 16, generator=gen) * 50
    _, kc = transform_qk(q, k, None, mu)
    rep = lambda t: t.repeat_interleave(2, 1)  # noqa: E731
    torch.testing.assert_close(torch.softmax(q @ rep(kc).transpose(-1, -2), -1),  # FP32 subtraction
                               torch.softmax(q @ rep(k).transpose(-1, -2), -1), rtol=1e-4, atol=1e-5)

    model = tiny_model(num_layers=2)
    obs = KVObserver(2)
    ids = _ids()
    keys = []
    original = obs.observe
    obs.observe = lambda layer, key, value: (keys.append(key) if layer == 0 else None,
                                            original(layer, key, value))
    with torch.no_grad(), kv_cache_quantization(model, observer=obs):
        model(ids, use_cache=False)
    k0 = keys[0].float()
    torch.testing.assert_close(obs.k_channel_mean(0), k0.mean(dim=(0, 2)))
    torch.testing.assert_close(obs.k_centered_channel_amax(0),
                               (k0 - k0.mean(dim=(0, 2))[None, :, None, :]).abs().amax(dim=(0, 2)))
    every = KVPolicy.from_compact("*:fp8", 2)
    plain, centered = scaled_policy(every, obs), scaled_policy(every, obs, k_center=True)
    assert centered.layers[0].k_center is not None and plain.layers[0].k_center is None
    centered_amax = (k0 - k0.mean(dim=(0, 2))[None, :, None, :]).abs().amax().item()
    assert centered.layers[0].k_scale == pytest.approx(centered_amax / 448, rel=1e-6)
    assert plain.layers[0].k_scale == pytest.approx(k0.abs().amax().item() / 448, rel=1e-6)


def test_k_permutation_is_exact_and_the_observer_finds_the_rms():
    """Permuting K's channels per KV head and the queries of its group alike leaves every logit
    exact but for the transform's FP32 rounding, with centering and smoothing given in permuted order; the observer's channel
    RMS (plain and centered) matches torch; calibration orders each head's channels by falling
    RMS and writes the offsets in that order, the K scale unchanged."""
    from vllm_nvfp4.calibration.kv_hooks import transform_qk
    from vllm_nvfp4.calibration.scales import channel_permutation, scaled_policy

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 9, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 9, 16, generator=gen, dtype=torch.float64)
    perm = torch.stack([torch.randperm(16, generator=gen) for _ in range(2)])
    lam = torch.rand(2, 16, generator=gen, dtype=torch.float64) + 0.5
    qp, kp = transform_qk(q, k, lam, None, perm)
    torch.testing.assert_close(kp[0, 1, :, 0], k[0, 1, :, perm[1, 0]] / lam[1, 0])
    torch.testing.assert_close(qp[0, 3, :, 5], q[0, 3, :, perm[1, 5]] * lam[1, 5])  # q head 3: KV head 1
    rep = lambda t: t.repeat_interleave(2, 1)  # noqa: E731
    torch.testing.assert_close(qp @ rep(kp).transpose(-1, -2), q @ rep(k).transpose(-1, -2),
                               rtol=1e-5, atol=1e-6)  # the transform's FP32 products

    assert channel_permutation(torch.tensor([[1.0, 3.0, 2.0, 3.0]])).tolist() == [[1, 3, 2, 0]]
    model = tiny_model(num_layers=2)
    obs = KVObserver(2)
    keys = []
    original = obs.observe
    obs.observe = lambda layer, key, value: (keys.append(key) if layer == 0 else None,
                                            original(layer, key, value))
    with torch.no_grad(), kv_cache_quantization(model, observer=obs):
        model(_ids(), use_cache=False)
    k0 = keys[0].double()
    mean = k0.mean(dim=(0, 2))
    torch.testing.assert_close(obs.k_channel_rms(0, False), k0.square().mean(dim=(0, 2)).sqrt().float())
    torch.testing.assert_close(obs.k_channel_rms(0, True),
                               (k0 - mean[None, :, None, :]).square().mean(dim=(0, 2)).sqrt().float())
    every = KVPolicy.from_compact("*:nvfp4", 2)
    centered = scaled_policy(every, obs, k_center=True)
    permuted = scaled_policy(every, obs, k_center=True, k_permute=True)
    order = torch.tensor(permuted.layers[0].k_perm)
    rms = (k0 - mean[None, :, None, :]).square().mean(dim=(0, 2)).sqrt()
    assert (rms.gather(1, order).diff(dim=1) <= 1e-6).all()  # falling RMS per head
    torch.testing.assert_close(torch.tensor(permuted.layers[0].k_center),
                               torch.tensor(centered.layers[0].k_center).gather(1, order))
    assert permuted.layers[0].k_global_scale == centered.layers[0].k_global_scale
    assert centered.layers[0].k_perm is None


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_k_centering_repairs_keys_with_a_constant_part(fmt):
    """Keys = a large per-channel constant (a K bias) + small token-dependent parts: quantizing
    them as they are loses the small parts; centered (mu from the same keys, scales from the
    centered amax) the attention output is an order of magnitude closer to float64."""
    from vllm_nvfp4.calibration.kv_hooks import fake_quantize, transform_qk

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 64, 32, generator=gen)
    bias = torch.randn(1, 1, 1, 32, generator=gen) * 40
    k = (bias + torch.randn(1, 1, 64, 32, generator=gen)).to(torch.bfloat16)
    exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8, -1)
    mu = k.float().mean(dim=(0, 2))
    errs = []
    for center in (None, mu):
        _, ks = transform_qk(q, k, None, center)
        amax = ks.float().abs().amax().item()
        kq = fake_quantize(ks, fmt, amax / (448 if fmt == "fp8" else 2688)).double()
        if center is not None:
            kq = kq + center.double()[:, None, :]
        got = torch.softmax(q.double() @ kq.transpose(-1, -2) / 8, -1)
        errs.append(((got - exact).norm() / exact.norm()).item())
    assert errs[1] < 0.1 * errs[0], errs
