"""The ``nvfp4_mixed`` KV-cache dtype name and its registration with vLLM's config machinery."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, get_args

import torch

logger = logging.getLogger(__name__)

CACHE_DTYPE = "nvfp4_mixed"
#: name of our entry point in ``vllm.general_plugins`` (what ``VLLM_PLUGINS`` must list)
PLUGIN_NAME = "nvfp4_mixed"
#: torch dtype of the cache tensors vLLM allocates for us (opaque bytes; the layout is ours)
CACHE_TORCH_DTYPE = torch.uint8


def is_ours(kv_cache_dtype: Any) -> bool:
    """True for the ``nvfp4_mixed`` dtype string."""
    return kv_cache_dtype == CACHE_DTYPE


def add_to_closed_literal() -> None:
    """vLLM 0.32: make ``nvfp4_mixed`` a member of the closed ``CacheDType`` literal.

    ``CacheDType`` is one ``typing.Literal`` object imported by name into ~50 modules (argparse
    choices, ``get_attn_backend``'s assertion, pydantic's validator of ``CacheConfig``), so its
    ``__args__`` are extended in place. Pydantic compiled its validator when ``CacheConfig`` was
    defined; it is rebuilt (``force=True``) so the new member validates. Argparse kwargs are
    cached per config class (``_compute_kwargs``); the cache is cleared so ``--kv-cache-dtype``
    lists the new choice. Idempotent.
    """
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import cache as cache_mod
    from vllm.engine import arg_utils
    from vllm.utils import torch_utils

    literal = cache_mod.CacheDType
    if CACHE_DTYPE not in get_args(literal):
        literal.__args__ = (*literal.__args__, CACHE_DTYPE)
        rebuild_dataclass(cache_mod.CacheConfig, force=True)
        arg_utils._compute_kwargs.cache_clear()
    torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(CACHE_DTYPE, CACHE_TORCH_DTYPE)


class _DtypeHandler:
    """Handler for vLLM >= 0.33's ``register_kv_cache_dtype`` (torch dtype + quant mode).

    The quant mode is ``NONE``: vLLM's own quantized paths (FP8 query quantization, NVFP4
    layouts) must not treat the cache as theirs; our backend does all quantization itself.
    (``KVQuantMode.CUSTOM`` aliases another mode in 0.33, so it is not used.)
    """

    name = CACHE_DTYPE

    def torch_dtype(self) -> torch.dtype:
        return CACHE_TORCH_DTYPE

    def quant_mode(self) -> Any:
        from vllm.v1.kv_cache_interface import KVQuantMode

        return KVQuantMode.NONE


#: where vLLM >= 0.33 defines ``register_kv_cache_dtype`` and ``get_kv_cache_dtype_handler``
REGISTRY_MODULE = "vllm.config.cache"


@dataclass(frozen=True)
class DtypeRegistry:
    """vLLM >= 0.33's custom KV-cache dtype registry (both functions of one module)."""

    register: Callable[[str], Callable[[type], type]]  # register_kv_cache_dtype(name)(Handler)
    lookup: Callable[[str], Any]  # get_kv_cache_dtype_handler(name) -> handler or None


def find_registry_api() -> Optional[DtypeRegistry]:
    """vLLM >= 0.33's dtype registry, or None on releases without it (0.32)."""
    module = importlib.import_module(REGISTRY_MODULE)
    register = getattr(module, "register_kv_cache_dtype", None)
    lookup = getattr(module, "get_kv_cache_dtype_handler", None)
    if register is None and lookup is None:
        return None
    if not (callable(register) and callable(lookup)):
        raise RuntimeError(
            f"{REGISTRY_MODULE} has only one of register_kv_cache_dtype / "
            "get_kv_cache_dtype_handler; this vLLM release is not supported by vllm-nvfp4"
        )
    return DtypeRegistry(register, lookup)


def register_dtype() -> str:
    """Register ``nvfp4_mixed`` through the API this vLLM offers; returns which one was used."""
    registry = find_registry_api()
    if registry is None:
        add_to_closed_literal()
        return "closed-literal (vLLM 0.32)"
    # 0.33's API is a decorator factory: register_kv_cache_dtype(name)(HandlerClass); it
    # instantiates the class. It warns (does not raise) on a second registration, so skip that.
    if not isinstance(registry.lookup(CACHE_DTYPE), _DtypeHandler):
        registry.register(CACHE_DTYPE)(_DtypeHandler)
    return "register_kv_cache_dtype (vLLM >= 0.33)"
