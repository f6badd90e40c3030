"""Per-layer KV precision policy: which format each decoder layer stores K and V in, plus scales.

:mod:`.layer_types` (what a layer keeps in the cache, from the model config), :mod:`.layer_policy`
(one row: formats, scales, K smoothing/centering), :mod:`.compact` and :mod:`.json_form` (the two
written forms), :mod:`.kv_policy` (the whole model's policy), :mod:`.default_rule` and
:mod:`.resolve` (which policy a served model gets). A policy whose layer types do not match the
model's is refused (:meth:`KVPolicy.check_model`).
"""

from vllm_nvfp4.policy.errors import PolicyError
from vllm_nvfp4.policy.layer_types import (
    CONFIG_LAYER_KINDS,
    FULL_ATTENTION,
    LAYER_KINDS,
    NO_KV,
    SINK_MODEL_TYPES,
    LayerType,
    layer_types_from_config,
)
from vllm_nvfp4.policy.layer_policy import (
    CHANNEL_FIELDS,
    DEFAULT_FP8_SCALE,
    DEFAULT_NVFP4_GLOBAL_SCALE,
    HEAD_FLAG_FIELDS,
    SCALE_FIELDS,
    KRot,
    LayerPolicy,
    Scale,
    Smooth,
)
from vllm_nvfp4.policy.compact import KIND_SELECTORS
from vllm_nvfp4.policy.json_form import POLICY_FORMAT, POLICY_VERSION, TYPE_FIELDS
from vllm_nvfp4.policy.kv_policy import KVPolicy
from vllm_nvfp4.policy.default_rule import default_policy, growing_layers
from vllm_nvfp4.policy.resolve import POLICY_ENV, POLICY_FILENAME, policy_from_setting, resolve_policy

__all__ = [
    "CHANNEL_FIELDS", "CONFIG_LAYER_KINDS", "DEFAULT_FP8_SCALE", "DEFAULT_NVFP4_GLOBAL_SCALE",
    "FULL_ATTENTION", "HEAD_FLAG_FIELDS", "KRot", "KIND_SELECTORS", "LAYER_KINDS", "NO_KV", "POLICY_ENV",
    "POLICY_FILENAME", "POLICY_FORMAT", "POLICY_VERSION", "SCALE_FIELDS", "SINK_MODEL_TYPES",
    "TYPE_FIELDS", "KVPolicy", "LayerPolicy", "LayerType", "PolicyError", "Scale", "Smooth",
    "default_policy", "growing_layers", "layer_types_from_config", "policy_from_setting", "resolve_policy",
]
