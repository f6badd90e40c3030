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
from typing import Any, Optional, Sequence

from vllm_nvfp4.formats import NVFP4_BLOCK_SIZE, KVFormat
from vllm_nvfp4.integration.block_sizes import hybrid_plan, unpackable_sliding_formats
from vllm_nvfp4.layout import PAGE_ALIGN, KVPageLayout
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.policy import (
    POLICY_ENV,
    KVPolicy,
    LayerPolicy,
    LayerType,
    PolicyError,
    layer_types_from_config,
    resolve_policy,
)

from vllm_nvfp4.integration.connectors import check_kv_connectors
from vllm_nvfp4.integration.dtype import CACHE_DTYPE, PLUGIN_NAME

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers


class Nvfp4MixedConfigError(ValueError):
    """The engine configuration cannot run with ``kv_cache_dtype=nvfp4_mixed``; says why."""


@functools.lru_cache(maxsize=8)
def _resolve(num_layers: int, layer_types: tuple[LayerType, ...], num_kv_heads: int,
             head_dim: int, model_dir: Optional[str], env_value: str) -> KVPolicy:
    del env_value  # part of the cache key only: resolve_policy reads the environment itself
    policy = resolve_policy(num_layers, model_dir, layer_types=layer_types)
    policy.check_model(num_layers, num_kv_heads, head_dim, layer_types)
    return policy


# Policies calibrated at start-up (startup_calibration.py), by id() of the engine's config.
_STARTUP_POLICIES: dict[int, KVPolicy] = {}
# Engine configs whose KV-cache specs were taken (id()): their layer formats are fixed.
_FORMATS_FIXED: set[int] = set()


def fix_formats(vllm_config: Any) -> None:
    """Record that ``vllm_config``'s KV-cache specs (page sizes, hence formats) were taken."""
    key = id(vllm_config)
    if key not in _FORMATS_FIXED:
        _FORMATS_FIXED.add(key)
        weakref.finalize(vllm_config, _FORMATS_FIXED.discard, key)


def set_startup_policy(vllm_config: Any, policy: KVPolicy) -> None:
    """Make ``policy`` (start-up calibrated scales, formats of the rule or of the start-up
    selection) the policy in force for ``vllm_config`` in this process, for as long as that
    config object lives. Formats may change only before the KV-cache specs are taken."""
    shape = ModelShape.from_vllm_config(vllm_config)
    policy.check_model(shape.num_layers, shape.total_num_kv_heads, shape.head_dim)
    key = id(vllm_config)
    if policy.to_compact() != model_policy(vllm_config).to_compact():
        if key in _FORMATS_FIXED:
            raise Nvfp4MixedConfigError(
                f"start-up calibration changed the layer formats ({policy.to_compact()}) after "
                "the KV-cache pages were sized for the formats in force")
        _GROUP_BLOCKS.pop(key, None)  # the hybrid block plan follows the new page sizes
    _STARTUP_POLICIES[key] = policy
    weakref.finalize(vllm_config, _STARTUP_POLICIES.pop, key, None)


def model_policy(vllm_config: Any) -> KVPolicy:
    """The policy in force for this engine config (resolved once per process and setting)."""
    startup = _STARTUP_POLICIES.get(id(vllm_config))
    if startup is not None:
        return startup
    shape = ModelShape.from_vllm_config(vllm_config)
    return _resolve(shape.num_layers, shape.layer_types, shape.total_num_kv_heads,
                    shape.head_dim, shape.model_dir, os.environ.get(POLICY_ENV, ""))


def layer_index(layer_name: str, num_layers: int) -> int:
    """Policy row of an attention layer: the decoder-layer number in its name.

    ``model.layers.7.self_attn.attn`` -> 7. Decoder layers are numbered in model order, also
    under pipeline parallelism (each stage keeps the global numbers), as the policy numbers
    its rows (layers without KV cache keep their numbers and rows).
    """
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1 or not 0 <= numbers[0] < num_layers:
        raise Nvfp4MixedConfigError(
            f"nvfp4_mixed: cannot map attention layer {layer_name!r} to a row of the "
            f"{num_layers}-layer policy (expected one layer number in the name)"
        )
    return numbers[0]


_GROUP_BLOCKS: dict[int, tuple[int, int]] = {}
# The configured block size the plan of each engine config started from (id()).
_PLANNED_FROM: dict[int, int] = {}


def _remember_planned_from(vllm_config: Any, block_size: int) -> None:
    key = id(vllm_config)
    if key not in _PLANNED_FROM:
        weakref.finalize(vllm_config, _PLANNED_FROM.pop, key, None)
    _PLANNED_FROM[key] = int(block_size)


def planned_block_size(vllm_config: Any) -> int:
    """The configured KV-cache block size (tokens) that :func:`group_block_sizes` plans from.

    Read it here, not from ``cache_config.block_size``, once the engine is up: vLLM's engine
    core then replaces that with its smallest KV-cache group's block size (``v1/engine/core.py``,
    0.32 and 0.34 alike) and the front end copies it back (``core_client.py``). Under
    ``nvfp4_mixed`` a hybrid's groups differ: on vLLM 0.34 (configured 64) Gemma 3 27B gets
    groups of 16, 16 and 64 tokens and the front end reads 16; planning again from 16 gives
    other groups (blocks of half the bytes) than the engine has. Recorded in the front end by
    :func:`check_engine_config` and in the engine by :func:`group_block_sizes` (when the specs
    are taken); a config never seen gives its ``cache_config.block_size``."""
    return _PLANNED_FROM.get(id(vllm_config), vllm_config.cache_config.block_size)


def group_block_sizes(policy: KVPolicy, shape: ModelShape, vllm_config: Any) -> tuple[int, int]:
    """``(full, sliding)`` tokens per block of the full-attention and sliding-window layers.

    A model with both kinds, its sliding layers of one window (any mix of formats), takes
    :func:`~vllm_nvfp4.integration.block_sizes.hybrid_plan` (vLLM packs their groups into
    shared blocks; the sizes that waste the least of them at ``max_model_len``); any other
    model keeps the configured block size for both. Fixed per engine config at the first call
    (the KV-cache specs and the attention impls must agree, also if vLLM later fits
    ``max_model_len`` to the memory)."""
    if not shape.needs_packed_groups:
        return shape.block_size, shape.block_size
    key = id(vllm_config)
    if key not in _GROUP_BLOCKS:
        _remember_planned_from(vllm_config, shape.block_size)
        _GROUP_BLOCKS[key] = _choose_group_block_sizes(policy, shape, vllm_config)
        weakref.finalize(vllm_config, _GROUP_BLOCKS.pop, key, None)
    return _GROUP_BLOCKS[key]


def _choose_group_block_sizes(policy: KVPolicy, shape: ModelShape,
                              vllm_config: Any) -> tuple[int, int]:
    plan = hybrid_plan(policy, shape.num_kv_heads, shape.head_dim, shape.block_size,
                       vllm_config.model_config.max_model_len, vllm_config.max_in_flight_tokens)
    if plan is None:
        return shape.block_size, shape.block_size
    return plan.full_block, plan.sliding_block


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
    ``head_size``, ``sliding_window``: the layer's own, they may differ between layers). Target
    layers take their row of the policy and must be what its type says (else
    :class:`Nvfp4MixedConfigError`) and take :func:`group_block_sizes`. Draft
    layers take :data:`DRAFT_LAYER_POLICY` and their own head shape.
    """
    shape = ModelShape.from_vllm_config(vllm_config)
    if is_draft_layer(vllm_config, layer.layer_name, shape.num_layers):
        layout = KVPageLayout(layer.num_kv_heads, layer.head_size, shape.block_size,
                              DRAFT_LAYER_POLICY.k, DRAFT_LAYER_POLICY.v)
        return None, DRAFT_LAYER_POLICY, layout
    policy = model_policy(vllm_config)
    index = layer_index(layer.layer_name, shape.num_layers)
    row = policy.layers[index]
    kind, window = row.layer_type, getattr(layer, "sliding_window", None)
    if not kind.holds_kv or (window or None) != kind.window:
        seen = f"sliding({window})" if window else "full"
        raise Nvfp4MixedConfigError(
            f"{layer.layer_name}: vLLM builds this layer as {seen} attention, but the model config "
            f"(and the policy) say layer {index} is {kind.label()}; this model's layer types "
            "cannot be read from its config, so nvfp4_mixed cannot serve it")
    full_block, sliding_block = group_block_sizes(policy, shape, vllm_config)
    block_size = sliding_block if kind.kind == "sliding" else full_block
    layout = KVPageLayout(layer.num_kv_heads, layer.head_size, block_size, row.k, row.v)
    return index, row, layout


def other_backend_error(name: str) -> ValueError:
    """The error for an explicitly requested attention backend that is not ours."""
    return ValueError(
        f"attention backend {name} cannot serve kv_cache_dtype={CACHE_DTYPE}; leave "
        "--attention-backend unset (the nvfp4_mixed backend is chosen automatically)"
    )


def plugins_leaving_us_out(plugins: Optional[Sequence[str]]) -> Optional[str]:
    """The problem, with its fix, when vLLM's ``VLLM_PLUGINS`` list (``vllm.envs``: None when
    unset, every general plugin loads) leaves out our plugin; None when it does not."""
    if plugins is None or PLUGIN_NAME in plugins:
        return None
    return (f"kv_cache_dtype={CACHE_DTYPE} needs the vLLM plugin {PLUGIN_NAME!r} in every vLLM "
            f"process, but VLLM_PLUGINS={','.join(plugins)!r} leaves it out; add {PLUGIN_NAME} "
            "to VLLM_PLUGINS (or unset it)")


def check_plugin_enabled() -> None:
    """Plugin mode: raise unless ``VLLM_PLUGINS`` lets every vLLM process load our plugin.

    (Reached when the plugin was registered by hand in a process whose ``VLLM_PLUGINS`` leaves
    it out; the engine core and workers would then not know ``nvfp4_mixed``.)
    """
    from vllm import envs

    problem = plugins_leaving_us_out(envs.VLLM_PLUGINS)
    if problem is not None:
        raise Nvfp4MixedConfigError(problem)


#: what nvfp4_mixed serves, for the refusals of everything else
SUPPORTED_MODELS = (
    "decoder models whose layers are full attention, sliding-window attention (either with "
    "attention sinks) or layers without KV cache (linear attention / Mamba / Gated DeltaNet, "
    "left to vLLM): Llama, Qwen2/3, Mistral (with or without a window), Gemma 3, gpt-oss, "
    "Qwen3-Next / Qwen3.5-style hybrids"
)
#: block-outermost layouts: pages of different sizes pack side by side in every block
PACKED_LAYOUTS = ("BLNHC", "BLHNC")


def _unsupported(what: str) -> Nvfp4MixedConfigError:
    return Nvfp4MixedConfigError(
        f"kv_cache_dtype={CACHE_DTYPE} does not support {what}. It supports {SUPPORTED_MODELS}. "
        "Use --kv-cache-dtype fp8 (or auto) for this model.")


def choose_kv_cache_layout(vllm_config: Any, shape: ModelShape) -> Optional[str]:
    """Pin a block-outermost KV-cache layout when vLLM will form several kinds of KV-cache
    groups (returns it; None: vLLM's own choice is fine).

    vLLM 0.32 gives every group the same bytes per block. In a layer-outermost layout it
    equalizes pages across groups by padding each smaller page to the largest (the NVFP4 pages
    would be padded to FP8 size: the saving gone); in a block-outermost layout it packs each
    group's pages side by side in a block (``_get_packed_kv_cache_groups``, as for
    DeepSeek-V4's heterogeneous pages), so each layer keeps its own page size.
    """
    from vllm import envs

    if not shape.needs_packed_groups:
        return None
    cc = vllm_config.cache_config
    requested = cc.kv_cache_layout or envs.VLLM_KV_CACHE_LAYOUT
    if requested is not None and requested not in PACKED_LAYOUTS:
        raise Nvfp4MixedConfigError(
            f"KV-cache layout {requested} pads the pages of this hybrid model's KV-cache groups to "
            f"one size, which would undo the NVFP4 saving; {CACHE_DTYPE} needs a block-outermost "
            f"layout here ({' or '.join(PACKED_LAYOUTS)}): unset VLLM_KV_CACHE_LAYOUT or set it "
            f"to {PACKED_LAYOUTS[0]}")
    cc.kv_cache_layout = requested or PACKED_LAYOUTS[0]
    return cc.kv_cache_layout


def check_engine_config(vllm_config: Any) -> KVPolicy:
    """Start-up validation of an ``nvfp4_mixed`` engine config; returns the policy it resolves
    (the policy in force unless start-up calibration replaces the default rule; logged by
    :func:`~vllm_nvfp4.integration.startup_calibration.calibrate_engine`).

    Raises :class:`Nvfp4MixedConfigError` (or :class:`~vllm_nvfp4.policy.PolicyError`) naming
    the problem: MLA (DeepSeek, incl. V4's compressed layers), cross-layer KV sharing, hybrid
    models whose layer types the config does not list, head_dim or block size the page layout
    cannot hold, an explicit other attention backend, ``--kv-cache-dtype-skip-layers``, a KV
    connector that does not copy whole blocks, a non-block-outermost KV-cache layout for a
    hybrid model, or a policy that does not fit the model. Pins the KV-cache layout for hybrid
    models (:func:`choose_kv_cache_layout`).
    """
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    text_config = mc.hf_text_config
    if mc.use_mla:
        raise _unsupported(f"MLA models ({mc.architecture}; DeepSeek's latent KV and "
                           "DeepSeek-V4's compressed layers are not per-head K and V)")
    if getattr(text_config, "num_kv_shared_layers", 0):
        raise _unsupported(f"cross-layer KV sharing ({mc.architecture}: "
                           f"{text_config.num_kv_shared_layers} layers reuse another layer's KV)")
    if mc.is_hybrid and getattr(text_config, "layer_types", None) is None:
        raise _unsupported(f"{mc.architecture}: a hybrid model whose config has no layer_types "
                           "(the policy cannot tell its attention layers from its state layers)")
    try:
        layer_types_from_config(text_config)
    except PolicyError as e:
        raise _unsupported(f"this model's layers ({e})") from None
    shape = ModelShape.from_vllm_config(vllm_config)
    if cc.kv_cache_dtype_skip_layers:
        raise Nvfp4MixedConfigError(
            f"--kv-cache-dtype-skip-layers cannot be combined with {CACHE_DTYPE}: the per-layer "
            "choice comes from the policy (see $VLLM_NVFP4_POLICY / nvfp4_policy.json; sliding "
            "layers can be selected by type, e.g. 'swa:fp8,full:nvfp4')"
        )
    check_kv_connectors(vllm_config)
    backend = vllm_config.attention_config.backend
    if backend is not None and backend.name != "CUSTOM":  # early here; per layer in selection
        raise other_backend_error(backend.name)
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
    mix = unpackable_sliding_formats(policy)
    if mix is not None:
        raise Nvfp4MixedConfigError(
            f"kv_cache_dtype={CACHE_DTYPE}: vLLM's KV-cache manager cannot group sliding-window "
            "layers of different K/V formats in unequal numbers next to full-attention layers "
            "and layers without KV cache or sliding layers of another window; the policy's "
            f"sliding layers are {mix}. Give every sliding layer the same 'k' and 'v' formats "
            "(or as many layers to each pair): in a compact policy a type rule such as "
            "'swa:fp8' with no index rule naming a sliding layer, in nvfp4_policy.json equal "
            "'k'/'v' in their rows")
    _remember_planned_from(vllm_config, shape.block_size)
    layout = choose_kv_cache_layout(vllm_config, shape)
    # The policy in force is logged once, by the engine core, where it is decided (start-up
    # calibration may still replace the default rule): startup_calibration.calibrate_engine.
    if layout is not None:
        logger.info("vllm-nvfp4: hybrid model: KV-cache layout %s, so each KV-cache group packs "
                    "its layers' own page sizes into the shared blocks (no padding to one size)",
                    layout)
    return policy
