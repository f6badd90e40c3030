"""Bit-exact tests of the NVFP4 / FP8 reference (and of the scale-folded NVFP4 decoding) against
hand-computed vectors."""

import json
import math

import pytest
import torch

from vllm_nvfp4.formats import (
    E2M1_VALUES,
    NVFP4_FOLD_EXPONENT,
    KVFormat,
    bytes_per_head,
    e2m1_code,
    e4m3_round,
    fp8_dequantize,
    fp8_quantize,
    fp8_scale_from_amax,
    nvfp4_dequantize,
    nvfp4_block_error,
    nvfp4_dequantize_folded,
    nvfp4_global_scale,
    nvfp4_quantize,
    pack_nvfp4_head,
    unpack_nvfp4_head,
)

# g = 1/448 and a block amax >= 6 make the block scale saturate at 448, so se = 448 * g = 1 and
# the element codes are just E2M1(x): the cleanest way to write expected codes by hand.
UNIT_G = 1.0 / 448.0


def _codes(packed: torch.Tensor) -> list[int]:
    return torch.stack([packed & 0xF, packed >> 4], -1).flatten().tolist()


def test_every_e2m1_code_decodes_to_its_value():
    nibbles = torch.arange(16, dtype=torch.uint8)
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    scales = torch.tensor([1.0], dtype=torch.float32).to(torch.float8_e4m3fn)
    out = nvfp4_dequantize(packed, scales, 1.0)
    expected = [*E2M1_VALUES, *(-v for v in E2M1_VALUES)]
    assert out.tolist() == expected
    # and every value quantizes back to its own code
    x = torch.tensor(expected[:8] + [6.0] + [-v for v in E2M1_VALUES[1:]])
    packed2, s2 = nvfp4_quantize(x, UNIT_G)
    assert s2.view(torch.uint8).item() == 0x7E  # 448
    assert _codes(packed2) == list(range(8)) + [7] + list(range(9, 16))


def test_ties_round_to_even_code_and_saturate_at_six():
    # midpoints between neighbours: the tie goes to the even code
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0,
                      -0.25, -0.75, 5.0001, 4.9999, 100.0, 6.0, 0.2500001, 0.0])
    packed, scales = nvfp4_quantize(x, UNIT_G)
    assert scales.float().item() == 448.0
    assert _codes(packed) == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 7, 6, 7, 7, 1, 0]


def test_low_nibble_holds_even_element():
    x = torch.zeros(16)
    x[0], x[1], x[15] = 6.0, 1.0, -0.5
    packed, _ = nvfp4_quantize(x, UNIT_G)
    assert packed[0].item() == (0x2 << 4) | 0x7
    assert packed[7].item() == (0x9 << 4) | 0x0


def test_block_scale_from_global_scale_and_e4m3_rounding():
    g = 0.5
    # amax 3 -> 3 / (0.5 * 6) = 1.0 exactly, and 3, 1.5, -0.5 are exact on se = 0.5: error 0
    x = torch.tensor([3.0, 1.5, -0.5] + [0.0] * 13)
    _, s = nvfp4_quantize(x, g)
    assert s.float().item() == 1.0
    # amax 3.3, candidates (module doc) for x / g = 6.6 and 0.2, errors in units of g:
    #   s6 = e4m3(3.3 / 3 = 1.1) = 1.125: 6.6 -> 6 * 1.125 = 6.75, 0.2 -> 0: 0.15^2 + 15 * 0.2^2 = 0.6225
    #   one step down 1.0: 6.6 -> 6: 0.36 + 0.6;  one step up 1.25: 6.6 -> 7.5: 0.81 + 0.6
    #   e4m3(3.3 / 2.5 = 1.32) = 1.375: 6.6 -> 4 * 1.375 = 5.5: 1.21 + 0.6
    #   e4m3(3.3 / 2 = 1.65) = 1.625: 6.6 -> 4 * 1.625 = 6.5: 0.01 + 0.6 = 0.61, the lowest
    x2 = torch.full((16,), 0.1)
    x2[3] = 3.3
    packed, s2 = nvfp4_quantize(x2, g)
    assert s2.float().item() == 1.625
    # element codes use se = 1.625 * 0.5: 3.3 / 0.8125 = 4.06 -> 4, 0.1 / 0.8125 = 0.123 -> 0
    assert _codes(packed)[3] == 6 and _codes(packed)[0] == 0


def test_block_scale_choice_hand_computed():
    """One block per outcome of the choice (g = 1, errors = squared errors of the block)."""
    g = 1.0
    x = torch.zeros(5, 16)
    # block 0: amax 4. Only e4m3(4 / 4) = 1.0 (0x38) holds 4 and 1 exactly (error 0); s6 =
    # e4m3(4 / 6) = 0.6875 (0x33) decodes them as 4.125 and 1.03125: 0.125^2 + 15 * 0.03125^2
    x[0] = 1.0
    x[0, 0] = 4.0
    # block 1: amax 6. s6 = 1.0 holds 6 and 0.5 exactly (error 0): kept (e4m3(6 / 4) = 1.5 (0x3C)
    # would decode 0.5 as 0.75: 15 * 0.25^2)
    x[1] = 0.5
    x[1, 0] = 6.0
    # block 2: 6, 3, -3 are exact with s6 = 1.0 and with e4m3(6 / 4) = 1.5: equal errors keep s6
    x[2, :3] = torch.tensor([6.0, 3.0, -3.0])
    # block 3: 4 and 2.75. s6 = 0.6875 decodes them as 4.125 and 2.75 (0.015625); 0.625: 3.75,
    # 2.5 (0.125); 0.75: 4.5, 3 (0.3125); e4m3(0.8) = 0.8125: 3.25, 3.25; 1.0: 4, 3 (0.0625) -> s6
    x[3, :2] = torch.tensor([4.0, 2.75])
    # block 4: 6.4 and 15 x 2.25. s6 = e4m3(1.067) = 1.0: 6, 2 (0.16 + 15 * 0.0625 = 1.0975);
    # one step up, 1.125 (0x39): 6.75 and 2.25 exact (0.1225, the lowest); one step down, 0.875:
    # 5.25 (1.3225 alone); e4m3(1.28) = 1.25: 7.5 (1.21 alone); e4m3(1.6) = 1.625: 6.5, 2.4375
    # (0.01 + 15 * 0.03515625 = 0.5373)
    x[4] = 2.25
    x[4, 0] = 6.4
    packed, s = nvfp4_quantize(x, g)
    assert s.view(torch.uint8).flatten().tolist() == [0x38, 0x38, 0x38, 0x33, 0x39]
    assert _codes(packed[0]) == [6] + [2] * 15
    assert _codes(packed[1]) == [7] + [1] * 15
    assert _codes(packed[2]) == [7, 5, 13] + [0] * 13
    assert _codes(packed[3]) == [7, 6] + [0] * 14
    assert _codes(packed[4]) == [7] + [4] * 15
    assert torch.equal(nvfp4_dequantize(packed[:3], s[:3], g), x[:3])
    # the compared errors, exactly (FP64)
    codes6 = torch.tensor([[7] + [3] * 15], dtype=torch.uint8)  # block 0 on 0.6875: 6 and 1.5
    assert nvfp4_block_error(x[0].view(1, 16), codes6, torch.tensor([0.6875])).tolist() == [0.0302734375]
    codes_up = torch.tensor([[7] + [4] * 15], dtype=torch.uint8)  # block 4 on 1.125
    assert nvfp4_block_error(x[4].view(1, 16), codes_up, torch.tensor([1.125])).tolist() == [
        (6.75 - float(torch.tensor(6.4))) ** 2]


def test_subnormal_block_scale():
    g = 1.0
    # amax 0.0234375: s6 = 0.00390625 = 2^-8 = e4m3 subnormal 2 * 2^-9 (byte 0x02); its step up
    # and e4m3(amax / 4) are 0.005859375 = 3 * 2^-9 (byte 0x03), its step down 2^-9
    x = torch.full((16,), 0.01)
    x[0] = 0.0234375
    # 2^-8: 0.0234375 -> 6 (exact), 0.01 -> 2.56 -> 3 (error 0.00171875 each);
    # 3 * 2^-9: 0.0234375 -> 4 (exact), 0.01 -> 1.71 -> 1.5 (error 0.00121 each), the lowest
    # (2^-9 clips 0.0234375 to 6 * 2^-9)
    packed, s = nvfp4_quantize(x, g)
    assert s.view(torch.uint8).item() == 0x03
    assert s.float().item() == 3 * 2.0 ** -9
    assert _codes(packed)[:2] == [6, 3]
    # 0.0234375 and 0.01171875 are exact on 2^-8 (6 and 3) and on 3 * 2^-9 (4 and 2): a tie
    # keeps the 6, subnormal byte 0x02
    x[1:] = 0.01171875
    packed, s = nvfp4_quantize(x, g)
    assert s.view(torch.uint8).item() == 0x02 and _codes(packed)[:2] == [7, 5]
    # an amax whose scale quotient is below 2^-10 flushes the block to scale 0 and codes 0
    tiny = torch.full((16,), 1e-5)
    p0, s0 = nvfp4_quantize(tiny, g)
    assert s0.view(torch.uint8).item() == 0 and int(p0.sum()) == 0
    assert nvfp4_dequantize(p0, s0, g).abs().max().item() == 0.0


def test_zero_block_is_all_zero_bytes_and_other_blocks_unaffected():
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(1)) + 0.5
    x[1, 16:32] = 0.0
    g = nvfp4_global_scale(x.abs().max())
    packed, scales = nvfp4_quantize(x, g)
    assert packed[1, 8:16].tolist() == [0] * 8
    assert scales.view(torch.uint8)[1, 1].item() == 0
    ref_p, ref_s = nvfp4_quantize(x[1:, 32:], g)  # block independence
    assert torch.equal(packed[1:, 16:], ref_p) and torch.equal(scales[1:, 2:], ref_s)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 40.0, 3000.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_bound(magnitude, dtype):
    gen = torch.Generator().manual_seed(int(magnitude * 1000) % 9973)
    x = (torch.randn(33, 8, 128, generator=gen) * magnitude).to(dtype)
    g = nvfp4_global_scale(x.float().abs().max())
    packed, scales = nvfp4_quantize(x, g)
    assert packed.shape == (33, 8, 64) and scales.shape == (33, 8, 8)
    y = nvfp4_dequantize(packed, scales, g)
    xf = x.float().reshape(33, 8, 8, 16)
    err = (y.reshape(33, 8, 8, 16) - xf).abs()
    # E2M1 half-ulp at the block max is 1/6 of the max (step 2 -> 1 between 4 and 6); plus the
    # E4M3 scale rounding (<= 1/16 relative): every error stays below amax16 * (1/6 + 1/16)
    amax16 = xf.abs().amax(-1, keepdim=True)
    assert bool((err <= amax16 * (1 / 6 + 1 / 16) + 1e-30).all())
    rel = (y - x.float()).norm() / x.float().norm()
    assert 0.03 < rel.item() < 0.15  # 4-bit: a real but bounded error


def test_per_row_global_scale_broadcast():
    x = torch.randn(3, 4, 32) * torch.tensor([0.1, 1.0, 10.0]).view(3, 1, 1)
    g = nvfp4_global_scale(x.abs().amax(dim=(1, 2)))  # [3]
    with pytest.raises(ValueError, match="broadcast"):
        nvfp4_quantize(x, g)
    packed, scales = nvfp4_quantize(x, g.view(3, 1))
    for i in range(3):
        p_i, s_i = nvfp4_quantize(x[i], float(g[i]))
        assert torch.equal(packed[i], p_i) and torch.equal(scales[i].view(torch.uint8), s_i.view(torch.uint8))


def test_nonfinite_raises_by_default_and_propagates_within_its_block():
    x = torch.randn(2, 64) + 0.1
    x[0, 20] = float("nan")
    x[1, 63] = float("inf")
    g = 0.01
    with pytest.raises(ValueError, match="NaN/Inf"):
        nvfp4_quantize(x, g)
    packed, scales = nvfp4_quantize(x, g, nonfinite="propagate")
    sb = scales.view(torch.uint8)
    assert sb[0, 1].item() == 0x7F and sb[1, 3].item() == 0x7F
    assert packed[0, 8:16].tolist() == [0] * 8
    y = nvfp4_dequantize(packed, scales, g)
    assert torch.isnan(y[0, 16:32]).all() and torch.isnan(y[1, 48:]).all()
    assert torch.isfinite(y[0, :16]).all() and torch.isfinite(y[0, 32:]).all()
    clean_p, clean_s = nvfp4_quantize(x[:, :16], g)
    assert torch.equal(packed[:, :8], clean_p)


def test_fp8_vllm_convention():
    x = torch.tensor([1.0, -2.5, 1000.0, -1e9, 0.3])
    q = fp8_quantize(x, 2.0)
    assert q.float().tolist() == [0.5, -1.25, 448.0, -448.0, 0.15625]  # 0.15 -> nearest e4m3
    assert fp8_dequantize(q, 2.0).tolist() == [1.0, -2.5, 896.0, -896.0, 0.3125]
    assert fp8_scale_from_amax(896.0).item() == 2.0
    with pytest.raises(ValueError, match="NaN/Inf"):
        fp8_quantize(torch.tensor([float("nan")]), 1.0)
    qn = fp8_quantize(torch.tensor([float("inf"), float("nan")]), 1.0, nonfinite="propagate")
    assert qn.float()[0].item() == 448.0 and torch.isnan(qn.float()[1])


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(torch.randn(4, 24), 1.0)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        nvfp4_quantize(torch.randint(0, 5, (4, 16)), 1.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        nvfp4_quantize(torch.randn(16), 0.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        fp8_quantize(torch.randn(16), float("nan"))
    with pytest.raises(TypeError, match="uint8"):
        nvfp4_dequantize(torch.zeros(8), torch.zeros(1).to(torch.float8_e4m3fn), 1.0)
    with pytest.raises(ValueError, match="do not match"):
        nvfp4_dequantize(torch.zeros(8, dtype=torch.uint8), torch.zeros(2).to(torch.float8_e4m3fn), 1.0)
    with pytest.raises(ValueError, match="unknown KV format"):
        bytes_per_head("int4", 128)
    with pytest.raises(ValueError, match="amax"):
        nvfp4_global_scale(0.0)


def test_kv_format_facts():
    assert KVFormat.parse("fp8") is KVFormat.FP8 and KVFormat.parse("nvfp4") is KVFormat.NVFP4
    assert KVFormat.FP8 == "fp8" and f"{KVFormat.NVFP4}" == "nvfp4" and str(KVFormat.FP8) == "fp8"
    assert json.dumps([KVFormat.NVFP4]) == '["nvfp4"]'
    assert KVFormat.FP8.bytes_per_element == 1.0 and KVFormat.NVFP4.bytes_per_element == 0.5625
    for head_dim in (16, 80, 128, 256):
        for fmt in KVFormat:
            assert fmt.bytes_per_head(head_dim) == head_dim * fmt.bytes_per_element
    assert KVFormat.FP8.default_scale == 1.0 and KVFormat.NVFP4.default_scale == 1.0 / 6.0
    # both defaults represent the same range: the largest code times the largest block scale
    x = torch.tensor([[448.0] + [1.0] * 15])
    assert fp8_dequantize(fp8_quantize(x, KVFormat.FP8.default_scale), 1.0)[0, 0] == 448.0
    g = KVFormat.NVFP4.default_scale
    assert float(nvfp4_dequantize(*nvfp4_quantize(x, g), g)[0, 0]) == pytest.approx(448.0, rel=1e-6)
    assert not KVFormat.FP8.has_block_scales and KVFormat.NVFP4.has_block_scales
    with pytest.raises(ValueError, match="unknown KV format 'fp4'; expected one of fp8, nvfp4"):
        KVFormat.parse("fp4")


def test_bytes_per_head_and_vllm_row_layout():
    assert bytes_per_head("fp8", 128) == 128
    assert bytes_per_head("nvfp4", 128) == 72
    assert bytes_per_head("nvfp4", 64) == 36
    x = torch.randn(5, 2, 128) * 3
    packed, scales = nvfp4_quantize(x, 0.01)
    rows = pack_nvfp4_head(packed, scales)
    assert rows.shape == (5, 2, 72) and rows.dtype == torch.uint8
    assert torch.equal(rows[..., 64:], scales.view(torch.uint8))
    p2, s2 = unpack_nvfp4_head(rows, 128)
    assert torch.equal(p2, packed) and torch.equal(s2.view(torch.uint8), scales.view(torch.uint8))
    with pytest.raises(ValueError, match="72 bytes"):
        unpack_nvfp4_head(rows[..., :70], 128)


def test_e2m1_code_sign_of_tiny_negatives():
    assert e2m1_code(torch.tensor([-0.1, 0.1, -0.0])).tolist() == [8, 0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_agree_bit_for_bit():
    x = torch.randn(64, 8, 128, dtype=torch.bfloat16) * 5
    x[3, 2, 7] = float("nan")
    g = 0.004
    p_cpu, s_cpu = nvfp4_quantize(x, g, nonfinite="propagate")
    p_gpu, s_gpu = nvfp4_quantize(x.cuda(), g, nonfinite="propagate")
    assert torch.equal(p_cpu, p_gpu.cpu())
    assert torch.equal(s_cpu.view(torch.uint8), s_gpu.cpu().view(torch.uint8))
    q_cpu = fp8_quantize(x, 0.02, nonfinite="propagate")
    q_gpu = fp8_quantize(x.cuda(), 0.02, nonfinite="propagate")
    assert torch.equal(q_cpu.view(torch.uint8), q_gpu.cpu().view(torch.uint8))


# ---------------------------------------------------------------------------- scale-folded decoding
S9 = 2.0 ** -9  # the smallest E4M3 subnormal

# (block scale, e2m1 code, folded decoding at g = 1, why): exact decoding is E2M1_VALUES[c] * s.
HAND_CASES = [
    (1.125, 3, 1.75, "1.5 * 1.125 = 1.6875 = 1.1011b: tie, rounds to the even mantissa 1.110b"),
    (1.125, 11, -1.75, "the same, negative"),
    (1.375, 5, 4.0, "3 * 1.375 = 4.125 = 4 * 1.00001b rounds down"),
    (1.375, 6, 5.5, "4 * 1.375 = 5.5: exact"),
    (1.125, 4, 2.25, "2 * 1.125: exact"),
    (448.0, 7, 2560.0, "6 * 448 = 2688: /8 = 336 = 256 * 1.0101b, tie to 1.010b = 320, *8"),
    (416.0, 7, 2560.0, "6 * 416 = 2496: /8 = 312 = 256 * 1.00111b rounds up to 320"),
    (448.0, 1, 224.0, "0.5 * 448: exact"),
    (S9, 1, 0.0, "0.5 * 2^-9 / 8 = 2^-13: below half the subnormal step, flushes to 0"),
    (S9, 6, 0.0, "4 * 2^-9 / 8 = 2^-10: tie between 0 and 2^-9, to 0 (even)"),
    (S9, 7, 2.0 ** -6, "6 * 2^-9 / 8 = 0.75 * 2^-9 rounds up to 2^-9, *8 = 2^-6"),
    (2.0 ** -6, 3, 2.0 ** -5, "1.5 * 2^-6 / 8 = 1.5 * 2^-9: tie, to 2 * 2^-9 (even), *8"),
    (2.0 ** -6, 5, 3 * 2.0 ** -6, "3 * 2^-6 / 8 = 3 * 2^-9: an exact subnormal"),
]


def _one_block_rows(cases: list[tuple[float, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i: one 16-block, scale cases[i][0], code cases[i][1] at element i % 16, zeros elsewhere."""
    codes = torch.zeros(len(cases), 16, dtype=torch.uint8)
    for i, (_, code) in enumerate(cases):
        codes[i, i % 16] = code
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.tensor([[s] for s, _ in cases]).to(torch.float8_e4m3fn)
    return packed, scales


def test_fold_exponent_keeps_the_largest_product_in_e4m3_range():
    assert E2M1_VALUES[-1] * 448.0 / 2 ** NVFP4_FOLD_EXPONENT <= 448.0
    assert E2M1_VALUES[-1] * 448.0 / 2 ** (NVFP4_FOLD_EXPONENT - 1) > 448.0


def test_hand_computed_folded_values():
    packed, scales = _one_block_rows([(s, c) for s, c, _, _ in HAND_CASES])
    folded = nvfp4_dequantize_folded(packed, scales, 1.0)
    exact = nvfp4_dequantize(packed, scales, 1.0)
    for i, (s, code, want, why) in enumerate(HAND_CASES):
        sign = -1.0 if code & 8 else 1.0
        assert exact[i, i % 16].item() == sign * E2M1_VALUES[code & 7] * s, why
        assert folded[i, i % 16].item() == want, why
        others = torch.cat([folded[i, : i % 16], folded[i, i % 16 + 1:]])
        assert not bool(others.any()), "zero codes must stay zero"


def test_global_scale_multiplies_after_the_rounding():
    packed, scales = _one_block_rows([(1.125, 3), (448.0, 7)])
    g = torch.tensor([0.25, 3.0])
    folded = nvfp4_dequantize_folded(packed, scales, g)
    assert folded[0, 0].item() == 1.75 * 0.25
    assert folded[1, 1].item() == 2560.0 * 3.0


def _nearest_e4m3(x: float) -> float:
    """Independent oracle: the nearest finite E4M3 value by search over all 127 positive codes
    (ties to the even code, i.e. the even mantissa), sign restored."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    mag = abs(x)
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - mag), i % 2))
    return math.copysign(grid[best], x)


def test_every_code_and_every_scale_against_an_independent_rounding():
    scale_bytes = torch.arange(0, 0x7F, dtype=torch.uint8)  # every finite non-negative E4M3 scale
    scales = scale_bytes.view(torch.float8_e4m3fn).float().tolist()
    cases = [(s, c) for s in scales for c in range(16)]
    packed, block_scales = _one_block_rows(cases)
    folded = nvfp4_dequantize_folded(packed, block_scales, 1.0)
    exact = nvfp4_dequantize(packed, block_scales, 1.0)
    fold = 2.0 ** NVFP4_FOLD_EXPONENT
    changed = 0
    for i, (s, c) in enumerate(cases):
        x = exact[i, i % 16].item()
        want = _nearest_e4m3(x / fold) * fold
        assert folded[i, i % 16].item() == want, (s, c)
        changed += want != x
    assert 0 < changed < len(cases)  # some products round, most do not


def test_e4m3_round_saturates_and_keeps_nan():
    x = torch.tensor([500.0, -1e9, 448.0, 0.1, float("nan")])
    out = e4m3_round(x).float()
    assert out[:3].tolist() == [448.0, -448.0, 448.0]
    assert out[3].item() == 0.1015625  # 0.1 -> 2^-4 * 1.101b
    assert math.isnan(out[4].item())


def test_nan_block_scale_decodes_to_nan_in_its_block_only():
    packed, scales = _one_block_rows([(1.0, 2), (1.0, 2)])
    scales[0, 0] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    folded = nvfp4_dequantize_folded(packed, scales, 1.0)
    assert bool(folded[0].isnan().all())
    assert folded[1, 1].item() == 1.0


def test_folded_rejects_bad_operands_like_the_exact_decoding():
    packed, scales = _one_block_rows([(1.0, 2)])
    with pytest.raises(TypeError, match="uint8"):
        nvfp4_dequantize_folded(packed.to(torch.int32), scales, 1.0)
    with pytest.raises(ValueError, match="block_scales"):
        nvfp4_dequantize_folded(packed, torch.cat([scales, scales], -1), 1.0)
