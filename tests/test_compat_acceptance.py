"""The speculative phases' acceptance bar of scripts/gpu_compat_check.py (``acceptance_holds``)."""
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "gpu_compat_check", Path(__file__).resolve().parent.parent / "scripts" / "gpu_compat_check.py")
compat = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(compat)


def rate(accepted: int, drafted: int) -> dict:
    return {"acceptance": accepted / drafted, "accepted": accepted, "drafted": drafted}


def test_a_higher_rate_than_fp8_passes():
    # EAGLE on vLLM 0.34, H100: 2485 / 4833 against fp8's 2451 / 4968 (2.1 points higher)
    assert compat.acceptance_holds(rate(2485, 4833), rate(2451, 4968))


@pytest.mark.parametrize("accepted, holds", [(2450, True), (2260, True), (2240, False)])
def test_a_lower_rate_passes_only_within_three_standard_errors(accepted, holds):
    # fp8 0.5 of 4800; se of the difference ~ sqrt(2 * 0.25 / 4800) = 0.0102, so the bar is ~0.469 (2251 of 4800)
    ref = rate(2400, 4800)
    assert compat.acceptance_holds(rate(accepted, 4800), ref) is holds
