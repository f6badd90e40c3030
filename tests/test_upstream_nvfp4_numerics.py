"""The emulation of FlashInfer's NVFP4 KV write (vLLM's ``--kv-cache-dtype nvfp4``) against vectors
computed by hand from ``nvfp4_append_quantize_block`` / ``nvfp4_append_quantize_e2m1``
(FlashInfer 0.7.4, ``include/flashinfer/page.cuh``): ``sf = e4m3_satfinite(amax / (6 g))``,
codes ``e2m1(x * (1 / (sf g)))``."""

import pytest
import torch

from studies.upstream_nvfp4_numerics import (UpstreamNVFP4, flashinfer_nvfp4_fake_quantize,
                                              flashinfer_nvfp4_quantize, placeholder_policy)
from vllm_nvfp4.calibration.kv_hooks import LayerQuant
from vllm_nvfp4.policy import KVPolicy

Z = [0.0] * 8
# (block of 16, E4M3 byte of sf, the 8 packed bytes: element 2i in the low nibble)
BLOCKS = [
    # sf 1: the ties of the e2m1 thresholds round to the even code (0.25 -> 0, 0.75 -> 1,
    # 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), past 5 -> 6; -0.25 and -0.0 keep the sign
    ([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -2.5, -5, .2499, 5.01, 0.0, -0.0],
     0x38, [0x07, 0x22, 0x44, 0x66, 0xA8, 0xEC, 0x70, 0x80]),
    # sf 2 (amax 12): the same ties at 0.25 / 0.75 / 2.5 / 5 x sf
    ([12, .5, 1.5, 5, 10, -.5, -1.5, -5, -10, 2.5, 3.5, 7, 1, 3, 6, 8],
     0x40, [0x07, 0x42, 0x86, 0xCA, 0x2E, 0x64, 0x31, 0x65]),
    # sf 1.875 (amax 11.25): r = fl(1 / 1.875) = 0.53333336 puts 1.25 / 2.5 / 5 x sf just above
    # the tie (1.2500001 -> 1.5, 2.5000002 -> 3, 5.0000005 -> 6; a division would give 1, 2, 4);
    # 0.25 x sf lands on 0.25 (-> 0), 0.75 / 1.75 / 3.5 x sf above (-> 1, 2, 4 as a division)
    ([11.25, 2.34375, 4.6875, 9.375, .46875, 1.40625, 3.28125, 6.5625] + Z,
     0x3F, [0x37, 0x75, 0x20, 0x64, 0, 0, 0, 0]),
    # amax 0.01: 0.01 / 6 = 0.00167 rounds to the E4M3 subnormal 2^-9 (byte 0x01), r = 512:
    # 5.12 -> 6, 2.048 -> 2, 1.28 -> 1.5, 0.512 -> 0.5, 0.256 -> 0.5, 2^-11 x 512 = 0.25 -> 0,
    # 5 x 2^-10 x 512 = 2.5 -> 2
    ([.01, -.01, .004, .0025, .001, .0005, 2.0 ** -11, 5 * 2.0 ** -10] + Z,
     0x01, [0xF7, 0x34, 0x11, 0x40, 0, 0, 0, 0]),
    # amax 0.005: 0.005 / 6 < 2^-10, sf 0, r 0: codes 0, the negative one -0
    ([.005, -.005] + [0.0] * 14, 0x00, [0x80, 0, 0, 0, 0, 0, 0, 0]),
    # amax 6 x 2^-10: amax / 6 = 2^-10 exactly, halfway between 0 and 2^-9: to even, sf 0
    ([6 * 2.0 ** -10, 2.0 ** -10] + [0.0] * 14, 0x00, [0, 0, 0, 0, 0, 0, 0, 0]),
    # all zero
    ([0.0] * 16, 0x00, [0] * 8),
    # amax 3000: 500 saturates to 448 (0x7E); 3000 / 448 -> 6, 448 -> 1, 224 -> 0.5
    ([3000, -3000, 448, 224] + [0.0] * 12, 0x7E, [0xF7, 0x12, 0, 0, 0, 0, 0, 0]),
]


def test_write_matches_hand_computed_bytes():
    x = torch.tensor([b for b, _, _ in BLOCKS], dtype=torch.float32)  # 8 head vectors, D = 16
    packed, sf = flashinfer_nvfp4_quantize(x)
    got = [(p.tolist(), int(s)) for p, s in zip(packed, sf.view(torch.uint8)[:, 0])]
    assert got == [(p, s) for _, s, p in BLOCKS]


def test_head_vector_of_several_blocks_and_decoding():
    # one bf16 head vector, D = 32 (in bf16, 5.01 is 5.0: a tie, -> 4)
    x = torch.tensor(BLOCKS[3][0] + BLOCKS[0][0], dtype=torch.bfloat16)
    out = flashinfer_nvfp4_fake_quantize(x)
    s = 2.0 ** -9
    expect = [6 * s, -6 * s, 2 * s, 1.5 * s, .5 * s, .5 * s, 0, 2 * s] + Z + \
        [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -2, -4, 0, 4, 0, -0.0]
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == expect
    assert torch.signbit(out[24]) and torch.signbit(out[31])


def test_global_scale_enters_scale_and_reciprocal():
    x = torch.tensor([[3.0, 0.375, -1.5, 2.0] + [0.0] * 12])  # g 0.5: sf = e4m3(3 / 3) = 1, r = 2
    packed, sf = flashinfer_nvfp4_quantize(x, 0.5)
    assert int(sf.view(torch.uint8)[0, 0]) == 0x38
    # x * r = 6, 0.75 (a tie: -> 1), -3, 4
    assert packed[0, :2].tolist() == [0x07 | (0x2 << 4), 0xD | (0x6 << 4)]
    assert flashinfer_nvfp4_fake_quantize(x, 0.5)[0, :4].tolist() == [3.0, 0.5, -1.5, 2.0]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), (1.0, 2.0)])
def test_bad_global_scale_is_refused(bad):
    with pytest.raises(ValueError, match="global scale"):
        flashinfer_nvfp4_quantize(torch.ones(1, 16), bad)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        flashinfer_nvfp4_quantize(torch.ones(1, 24))
    with pytest.raises(ValueError, match="finite"):
        flashinfer_nvfp4_quantize(torch.tensor([float("nan")] + [0.0] * 15))


def test_option_quantizes_all_but_the_skipped_layers():
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32)
    quant = LayerQuant("fp8", "fp8", 1.0, 1.0)
    opt = UpstreamNVFP4(skip_layers=frozenset({0, 3}))
    stale = torch.zeros_like(k)  # what the placeholder policy stored: replaced
    assert torch.equal(opt.stored_key(0, stale, k, k, quant, "propagate", "exact"), k)
    assert torch.equal(opt.stored_value(3, stale, v, quant, "propagate", "exact"), v)
    assert torch.equal(opt.stored_key(1, stale, k, k, quant, "propagate", "exact"),
                       flashinfer_nvfp4_fake_quantize(k))
    assert torch.equal(opt.stored_value(2, stale, v, quant, "propagate", "exact"),
                       flashinfer_nvfp4_fake_quantize(v))
    assert not torch.equal(flashinfer_nvfp4_fake_quantize(k), k)
    assert opt.fraction_of_fp8(range(30)) == pytest.approx((2 * 2 + 28 * 0.5625) / 30)
    assert UpstreamNVFP4().fraction_of_fp8(range(4)) == 0.5625


def test_option_needs_a_policy_without_k_transforms():
    placeholder = placeholder_policy(2, KVPolicy.from_compact("*:fp8", 2).layer_types)
    assert UpstreamNVFP4().bind(placeholder, 1) is not None
    centered = KVPolicy.from_dict({**placeholder.to_dict(), "layers": [
        {**row, "k_center": [[0.0] * 16]} for row in placeholder.to_dict()["layers"]]})
    with pytest.raises(ValueError, match="placeholder_policy"):
        UpstreamNVFP4().bind(centered, 1)
    with pytest.raises(ValueError, match="placeholder_policy"):
        UpstreamNVFP4().bind(None, 1)
