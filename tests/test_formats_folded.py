"""Bit-exact tests of the scale-folded NVFP4 decoding (one E4M3 value per element) against
hand-computed vectors and an independent nearest-E4M3 search."""

import math

import pytest
import torch

from vllm_nvfp4.formats import (
    E2M1_VALUES,
    NVFP4_FOLD_EXPONENT,
    e4m3_round,
    nvfp4_dequantize,
    nvfp4_dequantize_folded,
)

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
