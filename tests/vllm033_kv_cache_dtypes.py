# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Test fixture: vLLM 0.33.0's custom KV-cache dtype registry, verbatim from ``vllm/config/cache.py``
(vLLM 0.34.0's is the same code, byte for byte, and the same ``CacheDType`` literal).

Only the part the plugin calls is vendored (``KV_CACHE_DTYPES``, ``KVCacheDTypeHandler``,
``register_kv_cache_dtype``, ``get_kv_cache_dtype_handler``, ``is_known_kv_cache_dtype``), so the
0.33 registration path runs on CPU CI, where only vLLM 0.32 is installed. The code below the
imports is unchanged from vLLM 0.33.0; the imports take the same objects from the installed vLLM
(``STR_DTYPE_TO_TORCH_DTYPE``, ``KVQuantMode``), and ``CacheDType`` is 0.33's literal.
"""

from typing import Literal, Protocol, get_args, runtime_checkable

import torch

from vllm.logger import init_logger
from vllm.utils.torch_utils import (
    STR_DTYPE_TO_TORCH_DTYPE,
)
from vllm.v1.kv_cache_interface import KVQuantMode

logger = init_logger(__name__)

CacheDType = Literal[
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "nvfp4_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "octave_k3v4",
    "octave_k3v3",
    "octave_k3v3_compact",
    "ultraquant_4bit",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
]

# Mutable mirror of the CacheDType Literal. Custom dtypes registered by
# platform backends are appended here at registration time. Never snapshot
# this list (no list(...), tuple(...), or import-time key capture) —
# later-registered entries must stay visible to all consumers.
KV_CACHE_DTYPES: list[str] = list(get_args(CacheDType))


@runtime_checkable
class KVCacheDTypeHandler(Protocol):
    """Contract for a custom ``--kv-cache-dtype`` value.

    A platform backend implements this protocol to answer the questions vLLM
    currently answers with closed tables (``STR_DTYPE_TO_TORCH_DTYPE`` /
    ``get_kv_quant_mode`` / ``is_quantized_kv_cache``). A single handler may
    be device-aware (e.g., resolving different torch dtypes per device
    generation).
    """

    name: str

    def torch_dtype(self) -> torch.dtype:
        """Storage dtype for KV cache tensors.

        Called once at registration time; the result is injected into the
        shared ``STR_DTYPE_TO_TORCH_DTYPE`` dict so existing consumers need no
        changes. The device must already be resolvable (registration runs at
        platform activation time).
        """
        ...

    def quant_mode(self) -> KVQuantMode:
        """The :class:`KVQuantMode` used by generic kernels.

        Return an existing mode to reuse generic kernel paths, or
        ``KVQuantMode.CUSTOM`` when the backend fully self-manages kernel
        dispatch.
        """
        ...


# Custom dtype handlers: name -> handler instance. Defined after
# KVCacheDTypeHandler so the annotation resolves at module load time.
_KV_CACHE_DTYPE_HANDLERS: dict[str, KVCacheDTypeHandler] = {}


def register_kv_cache_dtype(name: str):
    """Register a custom ``--kv-cache-dtype`` value (eager decorator).

    Runs at platform activation time (first ``current_platform`` access),
    which is after ``--help`` exits and before any KV cache tensor is
    allocated. During decoration the handler will:

    - append ``name`` to the mutable ``KV_CACHE_DTYPES`` list (driving
      Pydantic + CLI validation);
    - resolve ``torch_dtype()`` once and inject it into
      ``STR_DTYPE_TO_TORCH_DTYPE``, so all existing ``dict[name]`` /
      ``name in dict`` sites need zero changes;
    - be stored for later ``quant_mode()`` queries.

    Examples:
        >>> @register_kv_cache_dtype("int8")
        ... class Int8Handler:
        ...     name = "int8"
        ...
        ...     def torch_dtype(self):
        ...         return torch.int8
        ...
        ...     def quant_mode(self):
        ...         return KVQuantMode.CUSTOM

    """

    def _decorate(cls):
        if name in KV_CACHE_DTYPES:
            logger.warning(
                "The kv-cache-dtype '%s' already exists and will be "
                "overwritten by handler %s.",
                name,
                cls,
            )
        else:
            KV_CACHE_DTYPES.append(name)
        inst = cls()
        # Inject into the shared dtype dict in-place so every existing
        # direct [] / `in` access site sees the new entry.
        STR_DTYPE_TO_TORCH_DTYPE[name] = inst.torch_dtype()
        _KV_CACHE_DTYPE_HANDLERS[name] = inst
        return cls

    return _decorate


def get_kv_cache_dtype_handler(name: str) -> KVCacheDTypeHandler | None:
    """Return the handler for ``name``.

    Returns None for upstream dtypes that have no handler (the dtype table
    already covers these).
    """
    return _KV_CACHE_DTYPE_HANDLERS.get(name)


def is_known_kv_cache_dtype(name: str) -> bool:
    """Whether ``name`` is a valid ``--kv-cache-dtype`` value."""
    return name in KV_CACHE_DTYPES
