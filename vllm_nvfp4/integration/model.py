"""The model being served, seen through the policy: which layer gets which formats and scales.

Every vLLM process (front end, engine core, workers) resolves the policy the same way,
:func:`vllm_nvfp4.policy.resolve_policy` (``$VLLM_NVFP4_POLICY``, then ``nvfp4_policy.json`` in the
model directory, then the default rule); the environment and the model directory are the same in
all of them. :func:`check_engine_config` runs in the front-end process when the engine config is
built, so a bad policy or an unsupported model fails before any worker starts, with a message
naming the problem.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import Any, Optional

from vllm_nvfp4.formats import NVFP4_BLOCK_SIZE, KVFormat
from vllm_nvfp4.layout import PAGE_ALIGN, KVPageLayout
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.policy import POLICY_ENV, KVPolicy, LayerPolicy, PolicyError, resolve_policy

from vllm_nvfp4.integration.connectors import check_kv_connectors
from vllm_nvfp4.integration.dtype import CACHE_DTYPE, PLUGIN_NAME

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers


class Nvfp4MixedConfigError(ValueError):
    """The engine configuration cannot run with ``kv_cache_dtype=nvfp4_mixed``; says why."""


@functools.lru_cache(maxsize=8)
def _resolve(num_layers: int, num_kv_heads: int, head_dim: int, model_dir: Optional[str],
             env_value: str) -> KVPolicy:
    del env_value  # part of the cache key only: resolve_policy reads the environment itself
    policy = resolve_policy(num_layers, model_dir)
    policy.check_model(num_layers, num_kv_heads, head_dim)
    return policy


# Policies calibrated at start-up (startup_calibration.py), by id() of the engine's config.
_STARTUP_POLICIES: dict[int, KVPolicy] = {}


def set_startup_policy(vllm_config: Any, policy: KVPolicy) -> None:
    """Make ``policy`` (the default rule's formats with start-up calibrated scales) the policy in
    force for ``vllm_config`` in this process, for as long as that config object lives."""
    shape = ModelShape.from_vllm_config(vllm_config)
    if policy.to_compact() != model_policy(vllm_config).to_compact():
        raise Nvfp4MixedConfigError(
            f"start-up calibration changed the layer formats ({policy.to_compact()}); the KV "
            "cache was allocated for the formats in force")
    policy.check_model(shape.num_layers, shape.total_num_kv_heads, shape.head_dim)
    key = id(vllm_config)
    _STARTUP_POLICIES[key] = policy
    weakref.finalize(vllm_config, _STARTUP_POLICIES.pop, key, None)


def model_policy(vllm_config: Any) -> KVPolicy:
    """The policy in force for this engine config (resolved once per process and setting)."""
    startup = _STARTUP_POLICIES.get(id(vllm_config))
    if startup is not None:
        return startup
    shape = ModelShape.from_vllm_config(vllm_config)
    return _resolve(shape.num_layers, shape.total_num_kv_heads, shape.head_dim, shape.model_dir,
                    os.environ.get(POLICY_ENV, ""))


def layer_index(layer_name: str, num_layers: int) -> int:
    """Policy row of an attention layer: the decoder-layer number in its name.

    ``model.layers.7.self_attn.attn`` -> 7. Decoder layers are numbered in model order, also
    under pipeline parallelism (each stage keeps the global numbers), so this matches the
    policy's "attention layer order in the model" for the dense models we accept.
    """
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1 or not 0 <= numbers[0] < num_layers:
        raise Nvfp4MixedConfigError(
            f"nvfp4_mixed: cannot map attention layer {layer_name!r} to a row of the "
            f"{num_layers}-layer policy (expected one layer number in the name)"
        )
    return numbers[0]


#: vLLM's name prefix for the layers of a separate draft model (``method="draft_model"``)
DRAFT_MODEL_PREFIX = "draft_model."
#: The rule for a speculative draft's own attention layers (EAGLE heads, draft models): the
#: policy describes the target model only, so draft layers store K and V in FP8 with the default
#: scale. Drafts only propose tokens; the target's verify step decides every output token.
DRAFT_LAYER_POLICY = LayerPolicy(KVFormat.FP8, KVFormat.FP8)


def is_draft_layer(vllm_config: Any, layer_name: str, num_layers: int) -> bool:
    """True for an attention layer of the speculative draft (not a row of the target's policy).

    vLLM names a draft model's layers ``draft_model.model.layers.<i>...``; EAGLE heads number
    their layers after the target's (``model.layers.<num_layers + i>...``).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "draft_model_config", None) is None:
        return False
    if layer_name.startswith(DRAFT_MODEL_PREFIX):
        return True
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    return len(numbers) == 1 and numbers[0] >= num_layers


def layer_plan(vllm_config: Any, layer: Any) -> tuple[Optional[int], LayerPolicy, KVPageLayout]:
    """Policy index (None for a draft layer), policy row and page layout of one attention layer.

    ``layer`` is vLLM's ``Attention`` module (``layer_name``, ``num_kv_heads`` on this rank,
    ``head_size``). Target layers take their row of the policy; draft layers take
    :data:`DRAFT_LAYER_POLICY` and their own head shape.
    """
    shape = ModelShape.from_vllm_config(vllm_config)
    if is_draft_layer(vllm_config, layer.layer_name, shape.num_layers):
        layout = KVPageLayout(layer.num_kv_heads, layer.head_size, shape.block_size,
                              DRAFT_LAYER_POLICY.k, DRAFT_LAYER_POLICY.v)
        return None, DRAFT_LAYER_POLICY, layout
    policy = model_policy(vllm_config)
    index = layer_index(layer.layer_name, shape.num_layers)
    row = policy.layers[index]
    layout = KVPageLayout(shape.num_kv_heads, shape.head_dim, shape.block_size, row.k, row.v)
    return index, row, layout


def other_backend_error(name: str) -> ValueError:
    """The error for an explicitly requested attention backend that is not ours."""
    return ValueError(
        f"attention backend {name} cannot serve kv_cache_dtype={CACHE_DTYPE}; leave "
        "--attention-backend unset (the nvfp4_mixed backend is chosen automatically)"
    )


def check_plugin_enabled() -> None:
    """Plugin mode: raise unless ``VLLM_PLUGINS`` lets every vLLM process load our plugin.

    (Reached when the plugin was registered by hand in a process whose ``VLLM_PLUGINS`` leaves
    it out; the engine core and workers would then not know ``nvfp4_mixed``.)
    """
    from vllm import envs

    plugins = envs.VLLM_PLUGINS
    if plugins is not None and PLUGIN_NAME not in plugins:
        raise Nvfp4MixedConfigError(
            f"kv_cache_dtype={CACHE_DTYPE} needs the vLLM plugin {PLUGIN_NAME!r} in every vLLM "
            f"process, but VLLM_PLUGINS={','.join(plugins)!r} leaves it out; add {PLUGIN_NAME} "
            "to VLLM_PLUGINS (or unset it)"
        )


def check_engine_config(vllm_config: Any) -> KVPolicy:
    """Start-up validation of an ``nvfp4_mixed`` engine config; returns the policy in force.

    Raises :class:`Nvfp4MixedConfigError` (or :class:`~vllm_nvfp4.policy.PolicyError`) naming
    the problem: MLA / sliding-window / hybrid models,
    head_dim or block size the page layout cannot hold, an explicit other attention backend,
    ``--kv-cache-dtype-skip-layers``, a KV connector that does not copy whole blocks, or a
    policy that does not fit the model.
    """
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if mc.use_mla:
        raise Nvfp4MixedConfigError(
            f"kv_cache_dtype={CACHE_DTYPE} does not support MLA models ({mc.architecture}); "
            "it stores per-head K and V. Use --kv-cache-dtype fp8 or auto for MLA models."
        )
    layer_types = getattr(mc.hf_text_config, "layer_types", None) or ()
    odd_layers = sorted({t for t in layer_types if t not in ("attention", "full_attention")})
    if mc.get_sliding_window() is not None or odd_layers or mc.is_hybrid:
        what = ", ".join(odd_layers) or "sliding-window attention"
        raise Nvfp4MixedConfigError(
            f"kv_cache_dtype={CACHE_DTYPE} supports dense full-attention decoder models only; "
            f"{mc.architecture} has {what} layers, which would need a second KV-cache group "
            "(padded pages). Use --kv-cache-dtype fp8 for this model."
        )
    if cc.kv_cache_dtype_skip_layers:
        raise Nvfp4MixedConfigError(
            f"--kv-cache-dtype-skip-layers cannot be combined with {CACHE_DTYPE}: the per-layer "
            "choice comes from the policy (see $VLLM_NVFP4_POLICY / nvfp4_policy.json)"
        )
    check_kv_connectors(vllm_config)
    backend = vllm_config.attention_config.backend
    if backend is not None and backend.name != "CUSTOM":  # early here; per layer in selection
        raise other_backend_error(backend.name)
    shape = ModelShape.from_vllm_config(vllm_config)
    if shape.head_dim % NVFP4_BLOCK_SIZE:
        raise Nvfp4MixedConfigError(
            f"kv_cache_dtype={CACHE_DTYPE} needs head_dim to be a multiple of "
            f"{NVFP4_BLOCK_SIZE} (NVFP4 scale blocks); this model's head_dim is {shape.head_dim}"
        )
    if shape.block_size % PAGE_ALIGN:
        raise Nvfp4MixedConfigError(
            f"kv_cache_dtype={CACHE_DTYPE} needs --block-size to be a multiple of {PAGE_ALIGN}, "
            f"got {shape.block_size}"
        )
    try:
        policy = model_policy(vllm_config)
    except PolicyError as e:
        raise PolicyError(f"kv_cache_dtype={CACHE_DTYPE}: no usable KV policy for {mc.model}: {e}") from None
    logger.info("vllm-nvfp4: %s", policy.describe())
    return policy
