"""The ``nvfp4_mixed`` attention backend: class, metadata and metadata builder.

The builder is also where each layer gets its page layout and scales (``Nvfp4MixedImpl.bind``):
it is constructed after the model is loaded and after ``Attention.process_weights_after_loading``
has reset vLLM's own ``_k_scale``/``_v_scale`` to 1.0 for unquantized checkpoints, and before any
CUDA graph is captured. Our scales are separate persistent device tensors on the impl, updated in
place, so a later rebuild of the builder cannot invalidate captured graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_nvfp4.formats import NVFP4_BLOCK_SIZE
from vllm_nvfp4.layout import PAGE_ALIGN

from vllm_nvfp4.integration.dense_prefill import (
    PrefillGroup,
    dense_prefill_enabled,
    plan_prefill_groups,
    scratch_rows,
)
from vllm_nvfp4.integration.dtype import CACHE_DTYPE
from vllm_nvfp4.integration.model import layer_plan


class Nvfp4MixedBackend(AttentionBackend):
    """Paged attention over per-layer FP8/NVFP4 pages (Triton on CUDA, torch on CPU)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [CACHE_DTYPE]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the static enum member that resolves to this class (see selection.py)

    @staticmethod
    def get_impl_cls() -> type:
        from vllm_nvfp4.integration.impl import Nvfp4MixedImpl

        return Nvfp4MixedImpl

    @staticmethod
    def get_builder_cls() -> type:
        return Nvfp4MixedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list:
        # Pages are not token-major, so vLLM must never split a block into kernel blocks;
        # any multiple of 16 keeps every plane of the page 16-byte aligned.
        return [MultipleOf(PAGE_ALIGN)]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0 and head_size % NVFP4_BLOCK_SIZE == 0

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        return True  # gpt-oss's per-head sink logits, passed to the kernels

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # connectors would move pages they cannot interpret

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        # The Triton kernels target Hopper (SM90) and Blackwell (SM100/SM120).
        return capability is None or capability.major >= 9

    @classmethod
    def check_layer(cls, selector_config: Any) -> list[str]:
        """Reasons this backend cannot serve a layer (empty list: it can)."""
        from vllm.platforms import current_platform

        capability = current_platform.get_device_capability() if current_platform.is_cuda() else None
        if not (current_platform.is_cuda() or current_platform.is_cpu()):
            return [f"platform {current_platform.device_name} is not supported (CUDA or CPU only)"]
        return cls.validate_configuration(device_capability=capability, **selector_config._asdict())


@dataclass
class Nvfp4MixedMetadata:
    """Per-step attention metadata (device tensors persistent across CUDA-graph replays)."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]: context incl. this step's tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor
    # dense prefill (CUDA + FlashAttention, see dense_prefill.py): requests [0, num_decodes) are
    # single-token decodes (vLLM reorders them first); the rest are the groups
    num_decodes: int = 0
    num_decode_tokens: int = 0
    decode_max_seq_len: int = 0  # launch bound of those decodes
    prefill_groups: tuple[PrefillGroup, ...] = ()


class Nvfp4MixedMetadataBuilder(AttentionMetadataBuilder[Nvfp4MixedMetadata]):
    """Builds :class:`Nvfp4MixedMetadata` and binds each layer's layout and scales."""

    # Full CUDA graphs for single-token decode batches (the memory-bound case); mixed
    # prefill/decode batches run piecewise, attention eager. Captured launches are sized for
    # max_model_len (see build_for_cudagraph_capture), so replays stay correct for any context.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # decodes first, so a mixed batch splits into paged decode + dense prefill
    reorder_batch_threshold: ClassVar[int] = 1

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._dense_prefill = dense_prefill_enabled(device)
        self._scratch_rows = scratch_rows(vllm_config)
        self._max_model_len = vllm_config.model_config.max_model_len
        forward_context = vllm_config.compilation_config.static_forward_context
        for name in layer_names:
            impl = forward_context[name].impl
            index, row, layout = layer_plan(vllm_config, name, impl.num_kv_heads, impl.head_size,
                                            impl.sliding_window)
            impl.bind(name, index, row, layout, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> Nvfp4MixedMetadata:
        m = common_attn_metadata
        # On CUDA, decode launches are sized for max_model_len, as the captured graphs are: the
        # split count (a compile-time constant of the kernel) then never differs between eager
        # steps and capture, so serving compiles nothing new (vLLM's JIT monitor warned of it).
        decode_bound = self._max_model_len if self.device.type == "cuda" else m.max_seq_len
        meta = Nvfp4MixedMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=decode_bound if m.max_query_len <= 1 else m.max_seq_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
        )
        if not self._dense_prefill or m.max_query_len <= 1:
            return meta
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(m, decode_threshold=1)
        seq_lens_cpu = m.seq_lens_cpu_upper_bound  # exact for prefill rows
        if seq_lens_cpu is None:
            seq_lens_cpu = m.seq_lens.cpu()
        groups = plan_prefill_groups(m.query_start_loc_cpu[: m.num_reqs + 1],
                                     seq_lens_cpu[: m.num_reqs], num_decodes,
                                     self._scratch_rows, self.device)
        return replace(meta, num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
                       decode_max_seq_len=decode_bound, prefill_groups=groups)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> Nvfp4MixedMetadata:
        # The host ints are launch bounds baked into the graph: size them for the worst case.
        meta = self.build(0, common_attn_metadata)
        return replace(meta, max_seq_len=self._max_model_len)

