"""Which policy a model is served with (:func:`resolve_policy`), first match wins:

1. ``$VLLM_NVFP4_POLICY``: a path to a JSON policy file, or a compact string.
2. ``nvfp4_policy.json`` inside the model directory.
3. The default rule (:func:`~vllm_nvfp4.policy.default_rule.default_policy`; an engine without a
   policy calibrates at start-up instead, :mod:`vllm_nvfp4.integration.startup_calibration`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

from vllm_nvfp4.env_vars import POLICY_ENV
from vllm_nvfp4.policy.default_rule import default_policy
from vllm_nvfp4.policy.errors import PolicyError
from vllm_nvfp4.policy.kv_policy import KVPolicy
from vllm_nvfp4.policy.layer_types import LayerType

logger = logging.getLogger(__name__)

POLICY_FILENAME = "nvfp4_policy.json"


def resolve_policy(
    num_layers: int,
    model_dir: Optional[Union[str, Path]] = None,
    env: Optional[Mapping[str, str]] = None,
    layer_types: Optional[Sequence[LayerType]] = None,
) -> KVPolicy:
    """Find the policy for a model: ``$VLLM_NVFP4_POLICY``, then the model dir, then the default.

    The policy's ``source`` says where it came from (the start-up log line prints it). A variable
    that is set but empty (or blank) counts as unset, and ``source`` says so.

    ``layer_types``: the model's (default: all full attention); the policy found must match them.
    """
    env = os.environ if env is None else env
    raw = env.get(POLICY_ENV)
    setting = (raw or "").strip()
    if setting:
        policy = policy_from_setting(setting, num_layers, layer_types)
        policy.check_model(num_layers, layer_types=layer_types)
        return policy
    ignored = f"; ${POLICY_ENV} is set but empty, so it was ignored" if raw is not None else ""
    if model_dir is not None:
        candidate = Path(model_dir) / POLICY_FILENAME
        if candidate.is_file():
            policy = KVPolicy.load(candidate)
            policy = replace(policy, source=policy.source + ignored)
            policy.check_model(num_layers, layer_types=layer_types)
            return policy
    policy = default_policy(num_layers, layer_types)
    logger.debug(
        "vllm-nvfp4: no $%s and no %s in the model directory; the %s: %s",
        POLICY_ENV, POLICY_FILENAME, policy.source, policy.to_compact(),
    )
    return replace(policy, source=policy.source + ignored)


def policy_from_setting(setting: str, num_layers: int,
                        layer_types: Optional[Sequence[LayerType]] = None) -> KVPolicy:
    """The policy a ``$VLLM_NVFP4_POLICY`` value names: a JSON file, else a compact string."""
    path = Path(setting).expanduser()
    if path.is_dir():
        raise PolicyError(f"${POLICY_ENV}={setting!r} is a directory; name the policy file "
                          f"(e.g. {path / POLICY_FILENAME})")
    if path.is_file():
        return replace(KVPolicy.load(path), source=f"{path} (${POLICY_ENV})")
    if setting.endswith(".json") or os.sep in setting:
        raise PolicyError(f"policy file {setting} (from ${POLICY_ENV}) does not exist")
    return KVPolicy.from_compact(setting, num_layers, source=f"${POLICY_ENV}", layer_types=layer_types)
