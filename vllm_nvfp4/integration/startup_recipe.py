"""How much the start-up calibration (:mod:`.startup_calibration`) runs: its :class:`Recipe`
(part of the cache key), the forwards and tokens it costs, and that in words (the start-up log,
``doctor``). No vLLM API is used here (only the fields of its config)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm_nvfp4.calibration.position_range import describe as describe_range
from vllm_nvfp4.calibration.position_range import range_offsets
from vllm_nvfp4.calibration.selection import DEFAULT_BUDGET
from vllm_nvfp4.env_vars import K_ROT_PAIRS_ENV, STARTUP_CALIBRATION_ENV
from vllm_nvfp4.integration.startup_selection import METRIC, candidate_slots, fp8_slot_count
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.policy import default_policy

MAX_WINDOW = 1024  # tokens per calibration sequence (fewer if max_model_len or the batch is smaller)
TARGET_TOKENS = 4096  # calibration tokens in all (fewer if the text is shorter)
#: tokens of the sensitivity forwards (the first windows of the calibration text): two 1024-token
#: windows; on a 2-core CPU SmolLM2-135M's 61 forwards of 2048 tokens take minutes (the one-time
#: cost of a cached result), on an H200 an 8B model's 65 a few seconds
SENSITIVITY_TOKENS = 2048
#: forwards of the sensitivity tokens that choose the sink key (with K centering): the chosen
#: policy with its sink key uncentered and centered (whole-model forwards, each about two of the
#: selection's resumed slot forwards: SmolLM2-135M's 61 forwards become 63, ~6% more time), plus
#: an exact forward where the selection ran none (``scales`` mode, every candidate FP8)
SINK_KEY_FORWARDS = 2
#: bump when the statistics or the policy built from them change (3: NVFP4 block scales by
#: lowest error, so the measured damage and the chosen slots differ; 4: the sink key stored
#: uncentered where it fits, in the policy and in the sensitivity forwards; 5: layers with
#: learned attention sinks no longer K-centered; 6: the sink key uncentered only where the
#: chosen policy measures better with it than centered; 7: for tokenizers that add no BOS, every
#: other window starts with the chat template's first token, as chat requests do; 8: the K/V
#: range also from the windows run at position offsets up to max_model_len; 9: the rotating K
#: center's pairs per KV head, ``k_rot_pairs``, part of the recipe)
RECIPE_VERSION = 9
#: RoPE pairs per KV head of the rotating K center (policy ``k_rot``) where the recipe centers K
#: and the model's RoPE fits it (0: off; else a power of 2 >= 8, the attention kernels' limit,
#: at most ``head_dim / 2``). ``$VLLM_NVFP4_K_ROT_PAIRS`` overrides it (0 switches it off)
ROT_PAIRS = 0
#: the fewest pairs the attention kernels take (:meth:`~vllm_nvfp4.kernels.launch.RotCenter.check`)
MIN_ROT_PAIRS = 8


@dataclass(frozen=True)
class Recipe:
    """How much text is run: ``windows`` sequences of ``window`` tokens, ``per_forward`` of them
    per model forward; K centering unless the model has a logits soft-cap; with ``select``, the
    formats from the sensitivity forwards on the first ``sensitivity_windows`` windows. With
    centering the sink key is flagged uncentered where it fits, and the flags are kept only if
    the chosen policy measures better with them on those windows (``k_sink_uncentered``).
    Every window runs once more from each of ``offsets`` (positions up to ``max_model_len``,
    :mod:`~vllm_nvfp4.calibration.position_range`) for the K/V range. ``k_rot_pairs``: RoPE
    pairs per KV head of the rotating K center (policy ``k_rot``, needs ``k_center``; 0: off),
    which costs a second pass over the same runs for its K range."""

    window: int
    windows: int
    per_forward: int
    k_center: bool
    select: bool = True
    sensitivity_windows: int = 0
    max_model_len: int = 0
    offsets: tuple[int, ...] = ()
    k_rot_pairs: int = 0

    def __post_init__(self) -> None:
        if self.k_rot_pairs and not self.k_center:
            raise ValueError("k_rot_pairs (the rotating K center) needs k_center")

    def describe(self) -> dict[str, Any]:
        out = {"window": self.window, "windows": self.windows, "k_center": self.k_center,
               "k_sink_uncentered": "measured" if self.k_center else False, "per_head": False,
               "k_rot_pairs": self.k_rot_pairs,
               "version": RECIPE_VERSION,
               "position_range": describe_range(self.max_model_len, self.offsets),
               "formats": "sensitivity" if self.select else "default rule"}
        if self.select or self.k_center:
            out.update(sensitivity_windows=self.sensitivity_windows, metric=METRIC)
        if self.select:
            out.update(budget=DEFAULT_BUDGET)
        return out


def recipe_for(vllm_config: Any, text_tokens: int, no_k_center: bool, select: bool = True) -> Recipe:
    """The recipe for an engine: windows no longer than ``MAX_WINDOW``, ``max_model_len``, one
    batch (``max_num_batched_tokens``) or the text, ``TARGET_TOKENS`` tokens in all, the first
    ``SENSITIVITY_TOKENS`` of them (at least one window) for the sensitivity forwards, the
    range offsets of :func:`~vllm_nvfp4.calibration.position_range.range_offsets` for
    ``max_model_len``; K centering unless ``no_k_center``, and with it :func:`rot_pairs` for the
    rotating K center."""
    batch = vllm_config.scheduler_config.max_num_batched_tokens
    max_len = vllm_config.model_config.max_model_len
    window = min(MAX_WINDOW, max_len, batch, text_tokens)
    windows = max(1, min(TARGET_TOKENS // window, text_tokens // window))
    return Recipe(window, windows, max(1, batch // window), k_center=not no_k_center, select=select,
                  sensitivity_windows=max(1, min(windows, SENSITIVITY_TOKENS // window)),
                  max_model_len=max_len, offsets=range_offsets(max_len, window),
                  k_rot_pairs=0 if no_k_center else rot_pairs(vllm_config))


def asked_rot_pairs() -> int:
    """The rotating K center's pairs asked for: ``$VLLM_NVFP4_K_ROT_PAIRS`` when set, else
    :data:`ROT_PAIRS`: 0 or a power of 2 >= :data:`MIN_ROT_PAIRS`; ``ValueError`` naming the
    accepted values for anything else."""
    raw = os.environ.get(K_ROT_PAIRS_ENV, "").strip()
    try:
        pairs = int(raw) if raw else ROT_PAIRS
    except ValueError:
        pairs = -1
    if pairs and (pairs < MIN_ROT_PAIRS or pairs & (pairs - 1)):
        raise ValueError(f"${K_ROT_PAIRS_ENV}={raw or pairs!r} is not understood; use 0 (no "
                         f"rotating K center) or the RoPE pairs per KV head, a power of 2 >= "
                         f"{MIN_ROT_PAIRS} (the attention kernels' limit)")
    return pairs


def rot_pairs(vllm_config: Any) -> int:
    """The recipe's ``k_rot_pairs`` for a model that centers K: :func:`asked_rot_pairs`, at most
    the largest power of 2 <= ``head_dim / 2``; 0 where that is below :data:`MIN_ROT_PAIRS` or
    the config shows a RoPE the rotating center does not fit (M-RoPE, a partial rotary
    dimension). What the config does not show (the rotary embedding's layout, per-layer RoPEs,
    position scaling) the calibration checks on vLLM's module, and logs."""
    pairs = asked_rot_pairs()
    if not pairs:
        return 0
    mc = vllm_config.model_config
    if getattr(mc, "uses_mrope", False):
        return 0
    cfg = mc.hf_text_config
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    head_dim = mc.get_head_size()
    if (params.get("rope_dim") or head_dim) != head_dim or (factor or 1.0) != 1.0:
        return 0
    while pairs > head_dim // 2:
        pairs //= 2
    return pairs if pairs >= MIN_ROT_PAIRS else 0


def selection_size(recipe: Recipe, shape: ModelShape) -> tuple[int, int]:
    """``(candidate slots, FP8 slots)`` the start-up selection measures and keeps (module doc,
    step 4); ``(0, 0)`` when it selects nothing (``scales`` mode, or every candidate FP8)."""
    if not recipe.select:
        return 0, 0
    candidates, fp8_slots = fp8_slot_count(
        default_policy(shape.num_layers, shape.layer_types or None).layer_types)
    slots = len(candidate_slots(candidates))
    return (0, 0) if fp8_slots >= slots else (slots, fp8_slots)


def sensitivity_forwards(recipe: Recipe, shape: ModelShape) -> int:
    """Forwards of the sensitivity windows: one exact and one per candidate slot, then at most
    :data:`SINK_KEY_FORWARDS` for the sink key (with centering; none where no head's first key
    fits, which only the calibration knows)."""
    slots, _ = selection_size(recipe, shape)
    forwards = slots + 1 if slots else 0
    if recipe.k_center:  # the selection's exact forward is reused where it ran
        forwards += SINK_KEY_FORWARDS + (0 if slots else 1)
    return forwards


def tokens_run(recipe: Recipe, shape: ModelShape) -> int:
    """Tokens a start-up calibration runs through the model (at most): the calibration windows
    (once, then once per range offset; all of it twice with the rotating K center), then the
    :func:`sensitivity_forwards` over the sensitivity windows."""
    passes = 2 if recipe.k_rot_pairs else 1
    return (passes * recipe.window * recipe.windows * (1 + len(recipe.offsets))
            + sensitivity_forwards(recipe, shape) * recipe.window * recipe.sensitivity_windows)


def describe_recipe(recipe: Recipe, shape: ModelShape) -> str:
    """What a start-up calibration with ``recipe`` runs, in words (the start-up log, ``doctor``)."""
    what = (f"K/V scales on {recipe.window * recipe.windows} tokens of the built-in text, "
            f"{recipe.windows} windows of {recipe.window}")
    if recipe.offsets:
        what += (f", their K/V range also at {len(recipe.offsets)} position offsets up to "
                 f"max_model_len {recipe.max_model_len} ({len(recipe.offsets)} more forwards "
                 "of each window)")
    if recipe.k_rot_pairs:
        what += (f", K centered on a rotating offset on {recipe.k_rot_pairs} RoPE pairs per KV "
                 f"head (a second pass of {1 + len(recipe.offsets)} forwards of each window for "
                 "its K range)")
    sens = recipe.window * recipe.sensitivity_windows
    sink = (f"; {SINK_KEY_FORWARDS} forwards of {sens} tokens choose whether the sink key is "
            "stored uncentered (by KL)" if recipe.k_center else "")
    if not recipe.select:
        return what + f"; the default rule's formats (${STARTUP_CALIBRATION_ENV}=scales)" + sink
    slots, fp8_slots = selection_size(recipe, shape)
    if not slots:
        return what + "; every candidate slot FP8, nothing to select" + sink
    return what + (f"; then {slots + 1} forwards of {sens} tokens measure the {slots} candidate "
                   f"K/V slots, and the {fp8_slots} most sensitive stay FP8 (as many as the "
                   f"{DEFAULT_BUDGET}x FP8-bytes budget allows, at least as many as the default "
                   "rule has there)") + sink
