"""The ``nvfp4_mixed`` KV-cache dtype name and its registration with vLLM's config machinery."""

from __future__ import annotations

import logging
from typing import Any, get_args

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


def find_registry_api() -> Any:
    """vLLM >= 0.33's ``register_kv_cache_dtype``, or None on releases without it (0.32)."""
    import importlib

    for module in ("vllm.config.cache", "vllm.utils.torch_utils", "vllm.v1.kv_cache_interface"):
        try:
            fn = getattr(importlib.import_module(module), "register_kv_cache_dtype", None)
        except ImportError:
            continue
        if callable(fn):
            return fn
    return None


def register_dtype() -> str:
    """Register ``nvfp4_mixed`` through the API this vLLM offers; returns which one was used."""
    api = find_registry_api()
    if api is None:
        add_to_closed_literal()
        return "closed-literal (vLLM 0.32)"
    from vllm.config import cache as cache_mod

    # 0.33's API is a decorator factory: register_kv_cache_dtype(name)(HandlerClass); it
    # instantiates the class. It warns (does not raise) on a second registration, so skip that.
    lookup = getattr(cache_mod, "get_kv_cache_dtype_handler", None)
    if lookup is None or not isinstance(lookup(CACHE_DTYPE), _DtypeHandler):
        api(CACHE_DTYPE)(_DtypeHandler)
    return "register_kv_cache_dtype (vLLM >= 0.33)"
