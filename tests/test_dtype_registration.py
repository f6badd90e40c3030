"""``nvfp4_mixed`` registers with vLLM 0.32 (closed literal) and vLLM 0.33 (handler registry).

CI has vLLM 0.32 only; the 0.33 path runs against 0.33's registry code, vendored verbatim in
``tests/vllm033_kv_cache_dtypes.py``. The plugin first broke on 0.33 by calling
``register_kv_cache_dtype(name, handler)``; these tests fail if that call form returns.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from vllm_nvfp4.integration import dtype

FIXTURE = "vllm033_kv_cache_dtypes"


@pytest.fixture
def registry033(monkeypatch: pytest.MonkeyPatch):
    """A fresh copy of 0.33's registry, with its own dtype table, found by the plugin."""
    from vllm.utils import torch_utils

    module = importlib.reload(importlib.import_module(FIXTURE))  # empty handler table
    table = {k: v for k, v in torch_utils.STR_DTYPE_TO_TORCH_DTYPE.items() if k != dtype.CACHE_DTYPE}
    monkeypatch.setattr(module, "STR_DTYPE_TO_TORCH_DTYPE", table)
    monkeypatch.setattr(dtype, "REGISTRY_MODULE", FIXTURE)
    return module


def test_installed_vllm_032_has_no_registry_and_uses_the_closed_literal() -> None:
    from typing import get_args

    from vllm.config.cache import CacheDType, CacheConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    assert dtype.find_registry_api() is None
    assert dtype.register_dtype() == "closed-literal (vLLM 0.32)"
    assert dtype.CACHE_DTYPE in get_args(CacheDType)
    assert STR_DTYPE_TO_TORCH_DTYPE[dtype.CACHE_DTYPE] is torch.uint8
    assert CacheConfig(cache_dtype=dtype.CACHE_DTYPE).cache_dtype == dtype.CACHE_DTYPE


def test_registers_through_033_handler_registry(registry033) -> None:
    from vllm.v1.kv_cache_interface import KVQuantMode

    assert not registry033.is_known_kv_cache_dtype(dtype.CACHE_DTYPE)
    assert dtype.register_dtype() == "register_kv_cache_dtype (vLLM >= 0.33)"

    assert registry033.is_known_kv_cache_dtype(dtype.CACHE_DTYPE)
    assert registry033.KV_CACHE_DTYPES.count(dtype.CACHE_DTYPE) == 1
    assert registry033.STR_DTYPE_TO_TORCH_DTYPE[dtype.CACHE_DTYPE] is torch.uint8
    handler = registry033.get_kv_cache_dtype_handler(dtype.CACHE_DTYPE)
    assert isinstance(handler, registry033.KVCacheDTypeHandler)  # 0.33's runtime protocol
    assert handler.name == dtype.CACHE_DTYPE
    assert handler.torch_dtype() is torch.uint8
    # NONE, not NVFP4: 0.33's get_kv_quant_mode asks the handler first; without it the
    # "nvfp4" prefix would make vLLM treat our pages as its own NVFP4 layout.
    assert handler.quant_mode() is KVQuantMode.NONE


def test_033_registration_is_idempotent(registry033, caplog: pytest.LogCaptureFixture) -> None:
    dtype.register_dtype()
    first = registry033.get_kv_cache_dtype_handler(dtype.CACHE_DTYPE)
    with caplog.at_level(logging.WARNING):
        dtype.register_dtype()  # every vLLM process may load the plugin more than once
    assert registry033.get_kv_cache_dtype_handler(dtype.CACHE_DTYPE) is first
    assert registry033.KV_CACHE_DTYPES.count(dtype.CACHE_DTYPE) == 1
    assert not [r for r in caplog.records if "already exists" in r.getMessage()]


def test_033_rejects_the_old_two_argument_call(registry033) -> None:
    """The call that broke the plugin on vLLM 0.33 fails against the vendored code as it did."""
    with pytest.raises(TypeError, match=r"takes 1 positional argument but 2 were given"):
        registry033.register_kv_cache_dtype(dtype.CACHE_DTYPE, dtype._DtypeHandler)
    assert not registry033.is_known_kv_cache_dtype(dtype.CACHE_DTYPE)


def test_half_present_registry_is_refused(monkeypatch: pytest.MonkeyPatch, registry033) -> None:
    monkeypatch.delattr(registry033, "get_kv_cache_dtype_handler")
    with pytest.raises(RuntimeError, match="only one of register_kv_cache_dtype"):
        dtype.register_dtype()
