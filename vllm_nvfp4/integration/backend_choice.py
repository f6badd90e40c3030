"""Which attention backend serves ``nvfp4_mixed``: always ours, on CUDA and on CPU.

vLLM's platforms pick backends by priority (CUDA: FlashInfer claims any ``nvfp4*`` dtype on
SM100) or unconditionally (CPU: always ``CPU_ATTN``), so the choice is made before the platform
is asked. Our backend is reached through the static ``AttentionBackendEnum.CUSTOM`` member (a
dynamically added member would not unpickle in spawned processes); the override is registered
in every process by the plugin.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm_nvfp4.integration.dtype import CACHE_DTYPE, is_ours
from vllm_nvfp4.integration.model import other_backend_error

BACKEND_PATH = "vllm_nvfp4.integration.backend.Nvfp4MixedBackend"


def register_custom_backend() -> None:
    """Point ``AttentionBackendEnum.CUSTOM`` at our backend unless someone else owns it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if not custom.is_overridden():
        register_backend(custom, BACKEND_PATH)


def select_backend(selected_backend: Optional[Any], selector_config: Any) -> Optional[str]:
    """Our backend's class path for an ``nvfp4_mixed`` layer; None for any other dtype.

    Raises ``ValueError`` for an MLA layer, a non-decoder layer, or an explicitly requested
    backend other than ours.
    """
    if not is_ours(selector_config.kv_cache_dtype):
        return None
    if selector_config.use_mla or selector_config.use_sparse:
        raise ValueError(
            f"kv_cache_dtype={CACHE_DTYPE} does not support MLA / sparse attention layers; "
            "use --kv-cache-dtype fp8 or auto for this model"
        )
    if selected_backend is not None:
        name = getattr(selected_backend, "name", str(selected_backend))
        path = selected_backend.get_path() if name == "CUSTOM" else None
        if path != BACKEND_PATH:
            raise other_backend_error(name)
    from vllm_nvfp4.integration.backend import Nvfp4MixedBackend

    reasons = Nvfp4MixedBackend.check_layer(selector_config)
    if reasons:
        raise ValueError(f"kv_cache_dtype={CACHE_DTYPE}: {'; '.join(reasons)}")
    return BACKEND_PATH
