"""EVERY change vllm-nvfp4 makes to vLLM, in one list. Nothing else in the package patches vLLM.

Each :class:`Hook` names what it patches, why, and the vllm-nvfp4 function the patched code calls.
:func:`install` applies them all (idempotent); the plugin's ``register()`` calls it in every vLLM
process. All hooks are inert unless ``kv_cache_dtype == "nvfp4_mixed"``.

The fork-style source patch ``patches/vllm-0.32.0-nvfp4_mixed.patch`` makes the same changes in
vLLM's sources; ``tests/test_integration_patches.py`` checks that it touches exactly the files
listed here (``patch_file``) and calls each hook's ``entry``, so the two cannot drift.

=================  ====================================================  ==========================
hook               patches (vLLM 0.32)                                   calls
=================  ====================================================  ==========================
cache_dtype        config/cache.py ``CacheDType`` literal (+ pydantic     dtype.register_dtype
                   rebuild of CacheConfig, argparse choices),
                   utils/torch_utils.py ``STR_DTYPE_TO_TORCH_DTYPE``;
                   vLLM >= 0.33: ``register_kv_cache_dtype`` instead
custom_backend     ``AttentionBackendEnum.CUSTOM`` -> our backend          selection.register_custom_
                   (only if nobody else registered CUSTOM)                backend
backend_selection  v1/attention/selector.py ``_cached_get_attn_backend``  selection.select_backend
spec               Attention.get_kv_cache_spec (per-layer page size)      spec.kv_cache_spec
startup_check      EngineArgs.create_engine_config (front-end checks)     model.check_engine_config
=================  ====================================================  ==========================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

from vllm_nvfp4.integration.dtype import is_ours

_MARK = "__vllm_nvfp4_hook__"


@dataclass(frozen=True)
class Hook:
    """One patch of vLLM."""

    name: str
    target: str  # what is patched, as ``module:attribute``
    why: str
    entry: str  # the vllm_nvfp4 function the patched code calls
    patch_file: Optional[str]  # file the source patch edits (None: plugin-only, see why)
    install: Callable[[], None]


def _replace(owner: Any, attr: str, make: Callable[[Any], Callable]) -> None:
    """Set ``owner.attr = make(original)`` unless it is already our wrapper."""
    original = getattr(owner, attr)
    if getattr(original, _MARK, False):
        return
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, True)
    setattr(owner, attr, wrapper)


def _install_cache_dtype() -> None:
    from vllm_nvfp4.integration.dtype import register_dtype

    register_dtype()


def _install_custom_backend() -> None:
    from vllm_nvfp4.integration.selection import register_custom_backend

    register_custom_backend()


def _install_backend_selection() -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention import selector

    from vllm_nvfp4.integration.selection import select_backend

    def make(original: Callable) -> Callable:
        def cached_get_attn_backend(backend: Any, attn_selector_config: Any,
                                    num_heads: Optional[int] = None, **kwargs: Any) -> Any:
            path = select_backend(backend, attn_selector_config)
            if path is None:
                return original(backend, attn_selector_config, num_heads, **kwargs)
            return resolve_obj_by_qualname(path)

        cached_get_attn_backend.cache_clear = original.cache_clear  # type: ignore[attr-defined]
        return cached_get_attn_backend

    _replace(selector, "_cached_get_attn_backend", make)


def _install_spec() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    from vllm_nvfp4.integration.spec import kv_cache_spec

    def make(original: Callable) -> Callable:
        def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
            if is_ours(self.kv_cache_dtype):
                return kv_cache_spec(self, vllm_config)
            return original(self, vllm_config)

        return get_kv_cache_spec

    _replace(Attention, "get_kv_cache_spec", make)


def _install_startup_check() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nvfp4.integration.model import check_engine_config

    def make(original: Callable) -> Callable:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            config = original(self, *args, **kwargs)
            if is_ours(config.cache_config.cache_dtype):
                check_engine_config(config)
            return config

        return create_engine_config

    _replace(EngineArgs, "create_engine_config", make)


HOOKS: tuple[Hook, ...] = (
    Hook("cache_dtype", "vllm.config.cache:CacheDType",
         "vLLM 0.32 validates --kv-cache-dtype against a closed Literal (argparse choices, "
         "pydantic, get_attn_backend's assertion) and maps names to torch dtypes in a dict",
         "register_dtype", "vllm/config/cache.py", _install_cache_dtype),
    Hook("custom_backend", "vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM",
         "lets users name our backend explicitly (--attention-backend CUSTOM); the static member "
         "pickles into spawned processes. Plugin-only: the source patch selects by class path",
         "register_custom_backend", None, _install_custom_backend),
    Hook("backend_selection", "vllm.v1.attention.selector:_cached_get_attn_backend",
         "platforms never pick us by themselves: CPU always returns CPU_ATTN, CUDA lets "
         "FlashInfer claim any nvfp4* name on SM100; MLA / other explicit backends get an error",
         "select_backend", "vllm/v1/attention/selector.py", _install_backend_selection),
    Hook("spec", "vllm.model_executor.layers.attention.attention:Attention.get_kv_cache_spec",
         "the only place that knows the layer name when the page size is decided; each layer's "
         "page follows its policy row, and the layers share one KV-cache group",
         "kv_cache_spec", "vllm/model_executor/layers/attention/attention.py", _install_spec),
    Hook("startup_check", "vllm.engine.arg_utils:EngineArgs.create_engine_config",
         "runs in the front-end process of serve / LLM() / lm-eval, so a bad policy or an "
         "unsupported model fails before any worker starts, with a message naming the problem",
         "check_engine_config", "vllm/engine/arg_utils.py", _install_startup_check),
)

_installed = False


def install() -> None:
    """Apply every hook once per process."""
    global _installed
    if _installed:
        return
    for hook in HOOKS:
        hook.install()
    _installed = True
