"""Per-layer KV-cache spec: each layer's page holds its own formats (FP8 or NVFP4, K and V apart).

The spec describes the page as vLLM's generic allocator sees it, ``[blocks, 1, block_size, C]``
uint8 with ``C`` = bytes per token of this layer (``num_head_slots=1``, ``state_content_bytes=C``).
The bytes inside a page follow :class:`vllm_nvfp4.layout.KVPageLayout`; vLLM never reads them.

Full-attention layers get a ``FullAttentionSpec``, sliding-window layers a ``SlidingWindowSpec``
with their window, so vLLM keeps them in its sliding-window group(s) and frees their blocks
outside the window as it does for any dtype. Layers of one kind whose specs differ only in ``C``
form one ``UniformTypeKVCacheSpecs`` group: one block table, bytes per block = the sum of the
layers' pages, no padding. Several kinds (full + sliding, attention + Mamba state) pack into
the shared blocks side by side under the block-outermost layout that
:func:`~vllm_nvfp4.integration.model.choose_kv_cache_layout` pins for such models.
"""

from __future__ import annotations

from typing import Any

from vllm_nvfp4.integration.dtype import CACHE_DTYPE, CACHE_TORCH_DTYPE
from vllm_nvfp4.integration.model import Nvfp4MixedConfigError, fix_formats, layer_plan


def kv_cache_spec(layer: Any, vllm_config: Any) -> Any:
    """The ``FullAttentionSpec`` / ``SlidingWindowSpec`` of one ``nvfp4_mixed`` attention layer
    (None for encoders)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, SlidingWindowSpec

    if layer.attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER):
        return None  # as vLLM: no KV cache
    if layer.attn_type != AttentionType.DECODER:
        raise Nvfp4MixedConfigError(
            f"{layer.layer_name}: {CACHE_DTYPE} supports decoder self-attention only, "
            f"not {layer.attn_type}"
        )
    if layer.head_size_v != layer.head_size:
        raise Nvfp4MixedConfigError(
            f"{layer.layer_name}: {CACHE_DTYPE} needs equal K and V head sizes, got "
            f"{layer.head_size} and {layer.head_size_v}"
        )
    _, _, layout = layer_plan(vllm_config, layer)
    fix_formats(vllm_config)
    fields = dict(
        block_size=layout.block_size,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        head_size_v=layer.head_size_v,
        dtype=CACHE_TORCH_DTYPE,
        # NONE: vLLM's quantized-KV code paths must not treat these pages as theirs.
        kv_quant_mode=KVQuantMode.NONE,
        num_head_slots=1,
        state_content_bytes=layout.bytes_per_token,
    )
    if layer.sliding_window is not None:
        spec = SlidingWindowSpec(**fields, sliding_window=layer.sliding_window)
    else:
        spec = FullAttentionSpec(**fields)
    assert spec.page_size_bytes == layout.page_bytes, (spec.page_size_bytes, layout)
    return spec
