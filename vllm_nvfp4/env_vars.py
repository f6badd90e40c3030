"""Every environment variable vllm-nvfp4 reads, in one table, and its registration with vLLM.

vLLM warns ``Unknown vLLM environment variable detected: VLLM_...`` for every ``VLLM_*`` variable
missing from ``vllm.envs.environment_variables`` (``Platform.validate_environ``, called from
``EngineArgs.create_engine_config`` after the general plugins are loaded; it raises instead with
``fail_on_environ_validation=True``), which reads as "your setting is ignored".
:func:`register_with_vllm` (the ``env_vars`` hook) adds ours to that table.
"""

from __future__ import annotations

import os
from typing import Any, Callable

PREFIX = "VLLM_NVFP4_"
# the names the package's modules read through these constants (this module imports none of them)
POLICY_ENV = "VLLM_NVFP4_POLICY"
FORCE_TORCH_ENV = "VLLM_NVFP4_FORCE_TORCH"
FUSED_PREFILL_ENV = "VLLM_NVFP4_FUSED_PREFILL"
STARTUP_CALIBRATION_ENV = "VLLM_NVFP4_STARTUP_CALIBRATION"
CACHE_ENV = "VLLM_NVFP4_CACHE"
K_ROT_PAIRS_ENV = "VLLM_NVFP4_K_ROT_PAIRS"

#: name -> what it does (read by the package, its scripts or its lm-eval tasks)
ENV_VARS: dict[str, str] = {
    POLICY_ENV: "the KV policy: a JSON policy file or a compact string (overrides the model "
                "directory's nvfp4_policy.json)",
    FORCE_TORCH_ENV: "1: the torch path instead of the Triton kernels on CUDA",
    FUSED_PREFILL_ENV: "1: the fused Triton prefill instead of dequantize + FlashAttention (CUDA)",
    STARTUP_CALIBRATION_ENV: "without a policy: 1 (default) calibrate scales and pick the FP8 "
                             "slots by measured sensitivity at start-up; scales: the default "
                             "rule's formats with calibrated scales; 0: off",
    K_ROT_PAIRS_ENV: "without a policy: RoPE pairs per KV head of the start-up calibration's "
                     "rotating K center (0: off; default: the recipe's ROT_PAIRS)",
    CACHE_ENV: "cache root: start-up calibrations, tiny test models and tokenizers (default "
               "~/.cache/vllm-nvfp4)",
    "VLLM_NVFP4_ASSETS": "asset directory of scripts/prepare_assets.py (default "
                         "~/.cache/vllm-nvfp4/assets)",
    "VLLM_NVFP4_GSM8K": "GSM8K JSONL file of the gsm8k_nvfp4 lm-eval task",
    "VLLM_NVFP4_DEVICE": "cpu|cuda: scripts/install.sh skips GPU detection",
}


def _getter(name: str) -> Callable[[], Any]:
    """vLLM's table holds zero-argument getters; ours return the raw string (or None)."""
    return lambda: os.environ.get(name)


def register_with_vllm() -> None:
    """Add every variable of :data:`ENV_VARS` to ``vllm.envs.environment_variables`` (idempotent;
    entries vLLM already has are left alone)."""
    from vllm import envs

    for name in ENV_VARS:
        envs.environment_variables.setdefault(name, _getter(name))


def without_ours(factors: dict[str, Any]) -> dict[str, Any]:
    """vLLM's compile-cache environment factors (name -> value) without the variables of
    :data:`ENV_VARS`. None of them changes what torch.compile traces: our attention runs inside
    vLLM's opaque attention op, and the policy only sizes the KV pages, which no compiled graph
    takes as input. Left in, setting one (a policy, start-up calibration off, a cache path)
    would make vLLM recompile the whole model, tens of seconds per start."""
    return {name: value for name, value in factors.items() if name not in ENV_VARS}


def unknown_variables(environ: dict[str, str]) -> list[str]:
    """``VLLM_NVFP4_*`` names set in ``environ`` that vllm-nvfp4 does not read (typos)."""
    return sorted(n for n in environ if n.startswith(PREFIX) and n not in ENV_VARS)
