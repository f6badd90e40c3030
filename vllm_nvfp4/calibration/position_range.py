"""Position-shifted range calibration: the K/V range of the positions a model is served at.

Calibration windows run from position 0 hold keys of positions ``0 .. L-1`` only; RoPE rotates
keys further at later positions, and the stored key ``K - mu`` outgrows a K amax calibrated on
short windows (SmolLM2-135M: up to 2.88x over an 8176-token prefix). Attention under RoPE
depends only on relative positions, so a window run with its position ids shifted by ``o`` has
the hidden states of the unshifted run and stores (up to rounding) the keys its tokens would
have at positions ``o .. o+L-1``. Such runs widen only the range statistics
(:meth:`~vllm_nvfp4.calibration.kv_hooks.KVObserver.range_only`): the centering offsets, the
channel RMS and the sink key still come from the windows at position 0.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

#: shifted runs of every calibration window (:func:`range_offsets`), each one more forward per
#: window. Measured on SmolLM2-135M (``rope_theta`` 100,000; served length 8192, 3 x 1024
#: built-in-text windows; studies/range_offsets_study.py): the largest centered K of 3 x 8176
#: held-out Brown tokens against the calibrated K amax, worst / median of the 30 layers, is
#: 2.91 / 1.59 without shifted runs and 1.06 / 0.99 with 1, 2, 3, 4 or 7 (7 tile every
#: position): its keys drift away from the mean monotonically, so the last offset alone does it
#: (the 3 windows matter more: 1.14 / 1.02 from the first alone). Where the slowest RoPE
#: channels turn past half a period within the served length, the farthest key from the mean
#: sits mid-range; 4 offsets sample that too at 4 extra forwards per window
DEFAULT_OFFSETS = 4


def range_offsets(max_len: int, window: int, count: int = DEFAULT_OFFSETS) -> tuple[int, ...]:
    """Position offsets for ``count`` shifted runs of a ``window``-token window, evenly spaced
    in ``(0, max_len - window]`` (the last run ends at position ``max_len - 1``); none when
    ``max_len <= window`` (0: no served length given) or ``count`` is 0, fewer than ``count``
    when the interval holds fewer distinct offsets. ``max_len``: the longest sequence served
    (tokens, vLLM's ``max_model_len``)."""
    if window <= 0 or max_len < 0 or count < 0:
        raise ValueError(f"range_offsets needs max_len >= 0, window > 0 and count >= 0, got "
                         f"max_len={max_len}, window={window}, count={count}")
    span = max_len - window
    if span <= 0:
        return ()
    return tuple(sorted({-(-span * i // count) for i in range(1, count + 1)}))


def served_length(requested: Optional[int], max_positions: Optional[int]) -> int:
    """The longest sequence the range is calibrated for, in tokens: ``requested`` (0: none, no
    shifted runs) or, when None, the model's ``max_position_embeddings`` (vLLM's default
    ``max_model_len``; unknown: 0). ``ValueError`` when ``requested`` passes the model's
    positions, which the shifted runs must stay within."""
    if requested is None:
        return max_positions or 0
    if requested < 0:
        raise ValueError(f"the served length must be >= 0 (0: no shifted runs), got {requested}")
    if max_positions is not None and requested > max_positions:
        raise ValueError(f"a served length of {requested} tokens exceeds the model's "
                         f"{max_positions} positions (max_position_embeddings); give at most that")
    return requested


def describe(max_len: int, offsets: Sequence[int]) -> dict[str, Any]:
    """The provenance entry of a range calibration (``position_range``): every calibration
    window is run once more at each offset."""
    return {"max_model_len": max_len, "offsets": list(offsets)}
