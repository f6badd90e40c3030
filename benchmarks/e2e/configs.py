"""The configuration matrix: which engines a run compares, and the parsing of its list flags."""

from __future__ import annotations

import importlib.util
import typing
from dataclasses import dataclass
from typing import Optional, Sequence

from vllm_nvfp4.policy import LayerType
from vllm_nvfp4.policy.default_rule import default_rule_text

SMALL_BATCH = 16
#: CUDA-graph capture sizes when trimmed: every batch a stage can use is padded to one of these
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 128, 144, 160,
                 176, 192, 224, 256, 288, 320, 352, 384, 448, 512]


@dataclass(frozen=True)
class BenchConfig:
    """One engine configuration of the matrix.

    ``policy``: a compact KV policy, ``"mixed"`` (:func:`policy_for`, or ``--mixed-policy``), or
    None for vLLM's own dtypes. ``skip_layers``: layer indices (negative: from the end) that
    vLLM's own ``nvfp4`` keeps in the model dtype (``kv_cache_dtype_skip_layers``).
    ``attention_backend``: forced on dense models; on hybrid models
    (sliding windows, sinks) vLLM's default for the model runs, except for ``fp8-triton``
    (:func:`backend_for`). ``weight``: relative share of a time budget (bigger caches take
    longer to fill).
    """

    name: str
    kv_cache_dtype: str
    attention_backend: Optional[str]  # None: vLLM picks (ours for nvfp4_mixed)
    policy: Optional[str]
    weight: float
    needs_module: Optional[str] = None  # a package the backend imports (None: vLLM alone)
    skip_layers: tuple[int, ...] = ()

    def skipped(self, num_layers: int) -> list[str]:
        """``kv_cache_dtype_skip_layers`` of this configuration for a model of ``num_layers``."""
        return [str(i % num_layers) for i in self.skip_layers]


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    BenchConfig("fp8", "fp8", "FLASH_ATTN", None, 1.0),
    BenchConfig("nvfp4-mixed", "nvfp4_mixed", None, "mixed", 1.6),
    BenchConfig("auto", "auto", "FLASH_ATTN", None, 0.8),
    BenchConfig("fp8-triton", "fp8", "TRITON_ATTN", None, 1.0),
    BenchConfig("nvfp4-all", "nvfp4_mixed", None, "*:nvfp4", 1.7),
    # vLLM's own NVFP4 KV cache (on SM80/90/120: FlashInfer's fa2 kernels, software dequantization)
    BenchConfig("nvfp4", "nvfp4", "FLASHINFER", None, 1.7, needs_module="flashinfer"),
    BenchConfig("nvfp4-skip", "nvfp4", "FLASHINFER", None, 1.6, needs_module="flashinfer",
                skip_layers=(0, -1)),
)}
#: its largest batch per context is the common batch of the decode comparison
REFERENCE = "fp8"


def unavailable_reason(cfg: BenchConfig) -> Optional[str]:
    """Why the installed vLLM cannot run ``cfg`` (None: it can): an unknown ``kv_cache_dtype``
    (vLLM's ``CacheDType`` literal; ``nvfp4_mixed`` is added by this plugin when it loads) or a
    missing backend package."""
    if cfg.kv_cache_dtype not in ("auto", "fp8", "nvfp4_mixed"):
        try:
            from vllm.config.cache import CacheDType
        except ImportError as e:
            return f"vLLM is not importable ({e})"
        if cfg.kv_cache_dtype not in typing.get_args(CacheDType):
            return f"this vLLM has no kv_cache_dtype {cfg.kv_cache_dtype!r}"
    if cfg.needs_module and importlib.util.find_spec(cfg.needs_module) is None:
        return f"{cfg.attention_backend} needs the package {cfg.needs_module!r}, which is not installed"
    return None


def mixed_policy(num_layers: int) -> str:
    """The first eighth of the layers (at least one) FP8, the rest NVFP4: 4 of 32 for Llama-8B."""
    k = max(1, round(num_layers / 8))
    return f"0-{k - 1}:fp8,*:nvfp4" if k > 1 else "0:fp8,*:nvfp4"


def policy_for(cfg: BenchConfig, layer_types: Sequence[LayerType],
               override: Optional[str] = None) -> Optional[str]:
    """The compact policy string ``cfg`` runs with (None for vLLM's own dtypes). ``mixed``: on a
    dense model the first eighth of the layers FP8 (:func:`mixed_policy`), on a hybrid model the
    library's default rule (sliding FP8, first / last full-attention FP8, the rest NVFP4)."""
    if cfg.policy is None:
        return None
    if cfg.policy == "mixed":
        if override:
            return override
        if all(t.kind == "full" for t in layer_types):
            return mixed_policy(len(layer_types))
        return default_rule_text(layer_types)[0]
    return cfg.policy


def backend_for(cfg: BenchConfig, hybrid: bool) -> Optional[str]:
    """The attention backend ``cfg`` forces (None: vLLM picks): ``fp8`` / ``auto`` take vLLM's
    default on a hybrid model (the backend vLLM runs its windows and sinks with)."""
    if hybrid and cfg.name in ("fp8", "auto"):
        return None
    return cfg.attention_backend


def capture_sizes_for(max_b: int) -> list[int]:
    """Trimmed capture sizes up to the largest batch a stage can use."""
    return [s for s in CAPTURE_SIZES if s <= max(max_b, 1)] or [1]


def parse_contexts(text: str) -> list[int]:
    """'32k,8192' -> [32768, 8192] (order kept: the first context is measured first)."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            n = int(float(item[:-1]) * 1024) if item.endswith("k") else int(item)
        except ValueError:
            raise ValueError(f"context must be a token count like 8192 or 32k, got {item!r}") from None
        if n <= 0:
            raise ValueError(f"context must be positive, got {item!r}")
        out.append(n)
    if not out:
        raise ValueError("no contexts given")
    return out


def parse_dtypes(text: str) -> list[str]:
    """Comma-separated configuration names ('all': every one, reference first; 'none': [])."""
    text = text.strip()
    if text in ("none", ""):
        return []
    names = list(CONFIGS) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise ValueError(f"unknown configuration(s) {bad}; choose from {list(CONFIGS)}")
    return names
