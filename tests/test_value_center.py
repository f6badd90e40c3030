"""Value options of the reference path (studies): centering (NVFP4-V layers store ``V - nu`` and
add ``nu`` back) and the first values stored FP8 or exact; FP8-V layers, and layers without a
mean, are left as the policy stores them."""

from __future__ import annotations

import pytest
import torch

from studies.kv_options import ValueCenter, ValueSink
from vllm_nvfp4.calibration.kv_hooks import LayerQuant, fake_quantize


def _values():
    g = torch.Generator().manual_seed(5)
    value = torch.randn(1, 2, 7, 32, generator=g) * 2 + 1.5  # a constant part per channel
    nu = value[0].mean(dim=1) + 0.1 * torch.randn(2, 32, generator=g)
    gs = torch.tensor([0.003, 0.002])
    return value, nu, gs


def test_centered_store_differs_from_the_plain_store_and_decodes_around_the_mean():
    value, nu, gs = _values()
    lq = LayerQuant("nvfp4", "nvfp4", gs, gs)
    plain = fake_quantize(value, "nvfp4", gs)
    got = ValueCenter({0: nu}).stored_value(0, plain, value, lq, "propagate", "exact")
    want = fake_quantize(value - nu[:, None, :], "nvfp4", gs).float() + nu[:, None, :]
    assert torch.equal(got, want)
    assert not torch.equal(got, plain.float())
    # centering removes the constant part, so the stored error is smaller here
    assert (got - value).pow(2).mean() < (plain - value).pow(2).mean()
    first = ValueCenter({0: nu}, first_uncentered=True).stored_value(0, plain, value, lq,
                                                                     "propagate", "exact")
    assert torch.equal(first[..., :1, :], plain[..., :1, :].float())
    assert torch.equal(first[..., 1:, :], want[..., 1:, :])


def test_fp8_values_and_layers_without_a_mean_are_untouched():
    value, nu, gs = _values()
    fp8 = fake_quantize(value, "fp8", gs)
    assert ValueCenter({0: nu}).stored_value(0, fp8, value, LayerQuant("nvfp4", "fp8", gs, gs),
                                             "propagate", "exact") is fp8
    plain = fake_quantize(value, "nvfp4", gs)
    assert ValueCenter({0: nu}).stored_value(1, plain, value, LayerQuant("nvfp4", "nvfp4", gs, gs),
                                             "propagate", "exact") is plain


def test_value_sink_replaces_only_the_first_values_of_nvfp4_v():
    value, _, gs = _values()
    lq = LayerQuant("nvfp4", "nvfp4", gs, gs)
    plain = fake_quantize(value, "nvfp4", gs)
    fp8 = ValueSink(2, "fp8").stored_value(0, plain, value, lq, "propagate", "exact")
    assert torch.equal(fp8[..., :2, :], fake_quantize(value[..., :2, :], "fp8", gs * 6))
    assert torch.equal(fp8[..., 2:, :], plain[..., 2:, :])
    assert not torch.equal(fp8[..., :2, :], plain[..., :2, :])
    exact = ValueSink(1, "exact").stored_value(0, plain, value, lq, "propagate", "exact")
    assert torch.equal(exact[..., :1, :], value[..., :1, :])
    fp8_v = fake_quantize(value, "fp8", gs)
    assert ValueSink(1).stored_value(0, fp8_v, value, LayerQuant("nvfp4", "fp8", gs, gs),
                                     "propagate", "exact") is fp8_v
    with pytest.raises(ValueError, match="store fp8 or exact"):
        ValueSink(1, "nvfp4")
