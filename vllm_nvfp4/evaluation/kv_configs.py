"""The KV-cache configurations compared by ``scripts/eval_accuracy.py``.

==================  ==================  =========================================================
name                ``kv_cache_dtype``  what
==================  ==================  =========================================================
``auto``            ``auto``            the model dtype (BF16): the reference
``fp8``             ``fp8``             vLLM's own FP8 (E4M3) cache, its default scales (1.0)
``ours_fp8``        ``nvfp4_mixed``     our path, every layer FP8: the all-FP8 policy JSON
                                        (``--fp8-policy``) as is, else ``--policy``'s scales
``nvfp4_all``       ``nvfp4_mixed``     every layer NVFP4 (K and V), calibrated scales if given
``mixed_calibrated`` ``nvfp4_mixed``    the selected policy JSON (``--policy``) as is
``mixed_naive``     ``nvfp4_mixed``     first/last-N layers FP8 with as many FP8 slots as the
                                        calibrated policy (or ``--budget``), calibrated scales
``flag_only``       ``nvfp4_mixed``     no policy at all, as a user who only adds the flag gets
                                        it: the default rule with start-up calibration
==================  ==================  =========================================================

A ``nvfp4_mixed`` configuration reaches the engine as a policy JSON file named by
``$VLLM_NVFP4_POLICY``, set in the environment of the process that starts the engine (spawned
vLLM processes inherit it), so the same file works for ``LLM()``, ``vllm serve`` and lm-eval.
``flag_only`` sets ``$VLLM_NVFP4_POLICY`` empty (= unset) and start-up calibration on instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from vllm_nvfp4.calibration.scales import with_formats
from vllm_nvfp4.calibration.selection import count_fp8_slots, fp8_slots_for_budget, naive_formats
from vllm_nvfp4.formats import KVFormat
from vllm_nvfp4.integration.startup_calibration import STARTUP_CALIBRATION_ENV
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.policy import POLICY_ENV, POLICY_FILENAME, KVPolicy, LayerPolicy, default_policy

logger = logging.getLogger(__name__)

CONFIG_NAMES = ("auto", "fp8", "ours_fp8", "nvfp4_all", "mixed_calibrated", "mixed_naive", "flag_only")
DEFAULT_CONFIGS = ("auto", "fp8", "nvfp4_all", "mixed_calibrated", "mixed_naive")
OURS = "nvfp4_mixed"


class ConfigError(ValueError):
    """A configuration that cannot be built from the arguments; the message says what is missing."""


@dataclass(frozen=True)
class KVConfig:
    """One engine configuration: vLLM ``kv_cache_dtype`` plus, for ours, the per-layer policy."""

    name: str
    kv_cache_dtype: str
    description: str
    policy: Optional[KVPolicy] = None  # with ``zero_config``: the formats the engine will use
    zero_config: bool = False  # no policy file: the engine calibrates at start-up

    def expected_bytes_per_token(self, shape: ModelShape) -> int:
        """KV-cache bytes per token by arithmetic (all layers, K and V, scales included)."""
        if self.policy is not None:
            return self.policy.kv_bytes_per_token(shape.total_num_kv_heads, shape.head_dim)
        per_elem = 1 if self.kv_cache_dtype.startswith("fp8") else shape.dtype_bytes
        return 2 * shape.num_layers * shape.total_num_kv_heads * shape.head_dim * per_elem

    def fraction_of_fp8(self, shape: ModelShape) -> float:
        fp8 = 2 * shape.num_layers * shape.total_num_kv_heads * KVFormat.FP8.bytes_per_head(shape.head_dim)
        return self.expected_bytes_per_token(shape) / fp8

    def write_policy(self, directory: Path) -> Optional[Path]:
        """Write the policy JSON (``None`` for vLLM's own dtypes and zero-config); returns its path."""
        if self.policy is None or self.zero_config:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        return self.policy.save(directory / f"{self.name}.json", overwrite=True)

    def env(self, policy_path: Optional[Path]) -> dict[str, str]:
        """Environment the engine process needs for this configuration."""
        if self.zero_config:
            return {POLICY_ENV: "", STARTUP_CALIBRATION_ENV: "1"}
        return {POLICY_ENV: str(Path(policy_path).resolve())} if policy_path is not None else {}

    def summary(self, shape: ModelShape) -> dict[str, Any]:
        return {"name": self.name, "kv_cache_dtype": self.kv_cache_dtype, "description": self.description,
                "policy": self.policy.to_compact() if self.policy else None,
                "expected_kv_bytes_per_token": self.expected_bytes_per_token(shape),
                "fraction_of_fp8": round(self.fraction_of_fp8(shape), 6)}


def with_scales_of(formats: KVPolicy, scales: Optional[KVPolicy], source: str) -> KVPolicy:
    """``formats``' per-layer formats with every scale (and K smoothing) of ``scales`` (no
    scales if ``None``)."""
    if scales is None:
        return KVPolicy(tuple(LayerPolicy(lp.k, lp.v, layer_type=lp.layer_type) for lp in formats.layers),
                        source=source)
    return with_formats(scales, formats, provenance={"scales_from": scales.source}, source=source)


def _load_checked(path: Path, shape: ModelShape) -> KVPolicy:
    policy = KVPolicy.load(path)
    policy.check_model(shape.num_layers, shape.total_num_kv_heads)
    return policy


def build_configs(names: Sequence[str], shape: ModelShape, policy_path: Optional[Path] = None,
                  budget: Optional[float] = None, fp8_policy_path: Optional[Path] = None,
                  ) -> list[KVConfig]:
    """The configurations ``names`` (see the module table), in the order given.

    ``flag_only`` refuses a ``shape.model_dir`` holding ``nvfp4_policy.json`` (the engine would
    serve it).

    ``fp8_policy_path``: a calibrated all-FP8 policy (e.g. ``vllm-nvfp4 calibrate --policy "*:fp8"
    --k-smooth 1``) that ``ours_fp8`` uses as is, scales and K smoothing included.
    """
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if unknown:
        raise ConfigError(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIG_NAMES)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"configuration listed twice in {','.join(names)}")
    calibrated = _load_checked(policy_path, shape) if policy_path is not None else None
    fp8_policy = _load_checked(fp8_policy_path, shape) if fp8_policy_path is not None else None
    if fp8_policy is not None and count_fp8_slots(fp8_policy) != 2 * shape.num_layers:
        raise ConfigError(f"--fp8-policy {fp8_policy_path}: not every layer is FP8 ({fp8_policy.to_compact()}); "
                          "calibrate one with --policy '*:fp8'")
    if calibrated is not None:
        frac = calibrated.fraction_of_fp8()
        if budget is not None and frac > budget + 1e-9:
            logger.warning("policy %s uses %.4fx FP8 bytes, above --budget %.4f", policy_path, frac, budget)
    L = shape.num_layers
    types = shape.layer_types or None  # the model's sliding / full layers (None: all full attention)
    scales_note = "calibrated scales" if calibrated is not None else "default scales (no --policy)"
    out = []
    for name in names:
        if name == "auto":
            out.append(KVConfig(name, "auto", f"model dtype ({shape.dtype}), the reference"))
        elif name == "fp8":
            out.append(KVConfig(name, "fp8", "vLLM FP8 E4M3, vLLM default scales"))
        elif name == "ours_fp8" and fp8_policy is not None:
            out.append(KVConfig(name, OURS, f"nvfp4_mixed, every layer FP8, calibrated policy {fp8_policy_path}",
                                fp8_policy))
        elif name == "ours_fp8":
            pol = with_scales_of(KVPolicy.from_compact("*:fp8", L, layer_types=types), calibrated, "eval: all FP8")
            out.append(KVConfig(name, OURS, f"nvfp4_mixed, every layer FP8, {scales_note}", pol))
        elif name == "nvfp4_all":
            pol = with_scales_of(KVPolicy.from_compact("*:nvfp4", L, layer_types=types), calibrated, "eval: all NVFP4")
            out.append(KVConfig(name, OURS, f"nvfp4_mixed, every layer NVFP4, {scales_note}", pol))
        elif name == "mixed_calibrated":
            if calibrated is None:
                raise ConfigError("mixed_calibrated needs --policy POLICY.json (from `vllm-nvfp4 select`)")
            out.append(KVConfig(name, OURS, f"nvfp4_mixed, selected policy {policy_path}", calibrated))
        elif name == "mixed_naive":
            if calibrated is not None:
                slots = count_fp8_slots(calibrated)
            elif budget is not None:
                slots = fp8_slots_for_budget(L, budget)
            else:
                raise ConfigError("mixed_naive needs --policy (its FP8 slot count) or --budget")
            pol = with_scales_of(naive_formats(L, slots, types), calibrated, f"eval: naive first/last ({slots} FP8 slots)")
            out.append(KVConfig(name, OURS, f"nvfp4_mixed, first/last-N FP8 ({slots} FP8 slots), {scales_note}", pol))
        elif name == "flag_only":
            if shape.model_dir is not None and (Path(shape.model_dir) / POLICY_FILENAME).is_file():
                raise ConfigError(f"flag_only: {shape.model_dir}/{POLICY_FILENAME} exists and an engine "
                                  "would serve it; move it away to measure the zero-config start")
            out.append(KVConfig(name, OURS, "nvfp4_mixed, no policy: start-up calibration and selection",
                                default_policy(L, types), zero_config=True))
    return out
