"""The ``nvfp4_mixed`` attention backend: backend class, metadata, metadata builder and impl.

The impl writes K/V into the layer's pages and attends over them, both through
:mod:`vllm_nvfp4.ops` (Triton kernels on CUDA, the torch reference on CPU). vLLM builds the impl
without telling it its layer; the metadata builder binds each layer's page layout and scales
(:meth:`Nvfp4MixedImpl.bind`). The builder is constructed after the model is loaded and after
``Attention.process_weights_after_loading`` has reset vLLM's own ``_k_scale``/``_v_scale`` to 1.0
for unquantized checkpoints, and before any CUDA graph is captured. Our scales are separate
persistent device tensors on the impl, updated in place, so a later rebuild of the builder cannot
invalidate captured graphs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Optional

import torch
from vllm.config.vllm import get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_nvfp4 import ops
from vllm_nvfp4.formats import NVFP4_BLOCK_SIZE
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.key_transform import key_centers, permute_channels, stored_keys
from vllm_nvfp4.layout import PAGE_ALIGN, KVPageLayout
from vllm_nvfp4.policy import CHANNEL_FIELDS, DEFAULT_FP8_SCALE, DEFAULT_NVFP4_GLOBAL_SCALE, LayerPolicy

from vllm_nvfp4.integration.dense_prefill import (
    DENSE_DTYPES,
    PrefillGroup,
    dense_prefill,
    dense_prefill_enabled,
    dense_prefill_supports,
    flash_varlen,
    plan_prefill_groups,
    reserve_scratch,
    scratch_rows,
)
from vllm_nvfp4.integration.dtype import CACHE_DTYPE
from vllm_nvfp4.integration.model import layer_plan
from vllm_nvfp4.integration.rank_params import INDEX_FIELDS, INT32_FIELDS, rank_row_values
from vllm_nvfp4.integration.calibration_forward import CalibrationBatch
from vllm_nvfp4.integration.startup_calibration import planned

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers
_warned_default_scales = False


class Nvfp4MixedBackend(AttentionBackend):
    """Paged attention over per-layer FP8/NVFP4 pages (Triton on CUDA, torch on CPU)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [CACHE_DTYPE]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the static enum member that resolves to this class (see backend_choice.py)

    @staticmethod
    def get_impl_cls() -> type:
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
        # Only connectors that copy whole blocks; the others are refused at start-up
        # (connectors.check_kv_connectors).
        return True

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Block-contiguous ([H, N, C] of one layer contiguous inside a block; H = 1 here): a
        # layer's page is one run of bytes, so offloading / transfer copies whole pages, scale
        # planes included. Layer-major first (each layer's pages evenly strided).
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)

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
    # decodes (vLLM reorders them first: one token, or 1 + k when verifying k speculative
    # tokens), attended on the pages; the rest are the groups
    num_decodes: int = 0
    num_decode_tokens: int = 0
    decode_max_query_len: int = 1  # launch bounds of those decodes
    decode_max_seq_len: int = 0
    prefill_groups: tuple[PrefillGroup, ...] = ()
    # bool [>= num_actual_tokens]: the tokens at position 0 of their sequence (None: no layer of
    # this KV-cache group stores its sink key uncentered); a view of a persistent buffer
    first_keys: Optional[torch.Tensor] = None
    # int32 [>= num_actual_tokens]: each token's index in its sequence (-1 past the batch) (None:
    # no layer of this KV-cache group has a rotating K center); a view of a persistent buffer
    positions: Optional[torch.Tensor] = None


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int,
                    rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (int32 ``[N]``) = each token's index in its sequence, ``p = seq_lens[r] - q_len[r]
    + (t - query_start_loc[r]) = t + seq_lens[r] - query_start_loc[r + 1]`` for token ``t`` of
    request ``r`` (the first request whose query range ends past ``t``; empty, padded requests
    hold no token), and -1 for the rows past the batch (``t >= query_start_loc[num_reqs]``).
    ``rows``: int32 ``arange(N)`` (persistent). Reads device tensors only (no host sync: CUDA-graph
    capturable); a handful of elementwise launches, run eagerly in every step's metadata build.
    These are the positions the readers assume (the key's index in its sequence); the metadata
    builder takes them from vLLM's own (:func:`fields_from_vllm_positions`) where it has them."""
    if num_reqs == 0:
        return out.fill_(-1)
    ends = query_start_loc[1:num_reqs + 1]
    req = torch.searchsorted(ends, rows, right=True).clamp_(max=num_reqs - 1)
    torch.add(rows, (seq_lens[:num_reqs] - ends)[req], out=out)
    return out.masked_fill_(rows >= ends[-1], -1)


def mark_first_keys(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int,
                    counts: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
    """``marks`` (bool ``[N]``) True exactly at the tokens whose absolute position is 0: the
    first query token of each request whose context before this step is empty (``seq_lens[s]
    == q_len > 0``; not a chunk after the first, not a prefix-cache hit, not a decode). Reads
    device tensors only (no host sync: CUDA-graph capturable); ``counts`` (int32, longer than
    ``marks``: ``[N + 1]``, scratch) takes the requests' first rows, ``query_start_loc[s] <= num
    tokens <= N``.

    Runs eagerly in every step's metadata build (decode steps included), so it stays a handful of
    elementwise launches: an empty request (a padded one, ``q_len == 0``) shares its first row
    with the next request, so its row is sent to the last slot of ``counts``, which ``marks``
    never reads; the other requests' first rows are distinct, and a plain scatter is exact (an
    accumulating ``index_put_`` would sort the rows on CUDA, several more launches a step)."""
    starts = query_start_loc[:num_reqs]
    q_lens = query_start_loc[1:num_reqs + 1] - starts
    live = q_lens > 0
    fresh = (seq_lens[:num_reqs] == q_lens) & live
    rows = torch.where(live, starts, counts.shape[0] - 1).long()
    counts.zero_()
    counts.scatter_(0, rows, fresh.to(torch.int32))
    return torch.gt(counts[:marks.shape[0]], 0, out=marks)


def vllm_token_positions(m: CommonAttentionMetadata) -> Optional[torch.Tensor]:
    """vLLM's positions of the step's tokens (``CommonAttentionMetadata.positions``, int ``[>=
    num_actual_tokens]``), or None where the caller set none. vLLM's model runners fill them as
    ``num_computed_tokens + i`` (the token's index in its sequence; M-RoPE models keep their
    position ids in another buffer), the padded rows with 0 or stale values."""
    pos = getattr(m, "positions", None)
    if (pos is None or pos.dim() != 1 or pos.dtype.is_floating_point
            or pos.shape[0] < m.num_actual_tokens):
        return None
    return pos


def fields_from_vllm_positions(positions: torch.Tensor, out: torch.Tensor,
                               marks: Optional[torch.Tensor]) -> int:
    """The step's token fields from vLLM's ``positions`` (:func:`vllm_token_positions`) in two
    launches: ``out[:n]`` (int32) = the positions, ``marks[:n]`` (bool, if given) = position 0,
    ``n = min(len(positions), len(out))``. Returns ``n``. Padded rows (no slot: never written)
    may be marked."""
    n = min(positions.shape[0], out.shape[0])
    out[:n].copy_(positions[:n])
    if marks is not None:
        torch.eq(out[:n], 0, out=marks[:n])
    return n


class Nvfp4MixedMetadataBuilder(AttentionMetadataBuilder[Nvfp4MixedMetadata]):
    """Builds :class:`Nvfp4MixedMetadata` and binds each layer's layout and scales."""

    # Full CUDA graphs for single-token decode batches (the memory-bound case); mixed
    # prefill/decode batches run piecewise, attention eager. Captured launches are sized for
    # max_model_len (see build_for_cudagraph_capture), so replays stay correct for any context.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first, so a mixed batch splits into paged decode + dense prefill. With
        # speculative decoding a verify step (1 + k query tokens) counts as a decode: the paged
        # kernels attend it on the pages instead of dequantizing its whole context.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self._dense_prefill = dense_prefill_enabled(device)
        # one KV-cache group = one kind of layer: its sliding window (None: full attention)
        layer_spec = getattr(kv_cache_spec, "first_spec", kv_cache_spec)  # UniformTypeKVCacheSpecs
        self._sliding_window = getattr(layer_spec, "sliding_window", None)
        self._scratch_rows = scratch_rows(vllm_config)
        self._max_model_len = vllm_config.model_config.max_model_len
        forward_context = vllm_config.compilation_config.static_forward_context
        uncentered_sinks = rot_centers = False
        for name in layer_names:
            layer = forward_context[name]
            index, row, layout = layer_plan(vllm_config, layer)
            layer.impl.bind(name, index, row, layout, vllm_config, device)
            uncentered_sinks |= layer.impl.key0_shift is not None
            rot_centers |= layer.impl.rot_center is not None
        # where some layer stores its sink key uncentered, which tokens sit at position 0, and
        # where some layer has a rotating K center, each token's position (persistent: captured
        # CUDA graphs read them); the positions buffer serves both where vLLM gives positions
        n = vllm_config.scheduler_config.max_num_batched_tokens
        self._rot_centers = rot_centers
        self._first_key_buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        if uncentered_sinks:
            self._first_key_buffers = (torch.zeros(n + 1, dtype=torch.int32, device=device),
                                       torch.zeros(n, dtype=torch.bool, device=device))
        self._position_buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        if rot_centers or uncentered_sinks:
            self._position_buffers = (torch.arange(n, dtype=torch.int32, device=device),
                                      torch.zeros(n, dtype=torch.int32, device=device))

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
        self._token_fields(m, meta)
        threshold = self.reorder_batch_threshold
        if not self._dense_prefill or m.max_query_len <= threshold:
            return meta
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            m, decode_threshold=threshold)
        seq_lens_cpu = m.seq_lens_cpu_upper_bound  # exact for prefill rows
        if seq_lens_cpu is None:
            seq_lens_cpu = m.seq_lens.cpu()
        groups = plan_prefill_groups(m.query_start_loc_cpu[: m.num_reqs + 1],
                                     seq_lens_cpu[: m.num_reqs], num_decodes,
                                     self._scratch_rows, self.device, self._sliding_window)
        return replace(meta, num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
                       decode_max_query_len=threshold,
                       decode_max_seq_len=decode_bound if threshold == 1 else m.max_seq_len,
                       prefill_groups=groups)

    def _token_fields(self, m: CommonAttentionMetadata, meta: Nvfp4MixedMetadata) -> None:
        """``meta.first_keys`` / ``meta.positions`` where some layer reads them: from vLLM's
        positions (two launches) where the step has them, else derived from the query and
        sequence lengths (:func:`mark_first_keys`, :func:`token_positions`: ~7 launches each,
        61-108 us of host time a step each on an H100 against 23 us for both from vLLM's)."""
        if self._position_buffers is None:
            return
        rows, out = self._position_buffers
        marks = None if self._first_key_buffers is None else self._first_key_buffers[1]
        vllm_pos = vllm_token_positions(m)
        if vllm_pos is not None:
            fields_from_vllm_positions(vllm_pos, out, marks)
            meta.first_keys = marks
            meta.positions = out if self._rot_centers else None
            return
        if self._first_key_buffers is not None:
            meta.first_keys = mark_first_keys(m.query_start_loc, m.seq_lens, m.num_reqs,
                                              *self._first_key_buffers)
        if self._rot_centers:
            meta.positions = token_positions(m.query_start_loc, m.seq_lens, m.num_reqs, rows, out)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> Nvfp4MixedMetadata:
        # The host ints are launch bounds baked into the graph: size them for the worst case.
        meta = self.build(0, common_attn_metadata)
        return replace(meta, max_seq_len=self._max_model_len)


def page_view(kv_cache: torch.Tensor, layout: KVPageLayout) -> torch.Tensor:
    """vLLM's ``[blocks, 1, block_size, C]`` layer view as the ops' ``[blocks, page_bytes]``."""
    expected = (1, layout.block_size, layout.bytes_per_token)
    if tuple(kv_cache.shape[1:]) != expected or kv_cache.stride(3) != 1 or (
            kv_cache.stride(2) != layout.bytes_per_token):
        raise RuntimeError(
            f"{CACHE_DTYPE}: vLLM handed a KV cache view of shape {tuple(kv_cache.shape)} strides "
            f"{kv_cache.stride()}, expected dense pages [blocks, {', '.join(map(str, expected))}] "
            "(was the block split into kernel blocks, or a non-block-contiguous layout forced?)"
        )
    return torch.as_strided(kv_cache, (kv_cache.shape[0], layout.page_bytes),
                            (kv_cache.stride(0), 1), kv_cache.storage_offset())


def check_rot_theta(layer_name: str, k_rot: Any, hf_config: Any, head_dim: int) -> None:
    """The policy's ``k_rot`` angles against the model's unscaled RoPE, ``theta_i =
    base^(-2i / head_dim)`` of each rotated pair ``i`` to 1e-6 relative: RuntimeError naming the
    layer where they differ; a scaled RoPE (``rope_type`` other than default) or a config without
    one base is only logged (the calibration took the angles from the model it ran)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling",
                                                                    None) or {}
    base = getattr(hf_config, "rope_theta", None) or params.get("rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if base is None or rope_type != "default":
        logger.info("vllm-nvfp4: %s: k_rot angles taken as the policy gives them (RoPE %s, "
                    "base %s)", layer_name, rope_type, base)
        return
    pairs = torch.tensor(k_rot.pairs, dtype=torch.float64)
    want = float(base) ** (-2.0 * pairs / head_dim)
    rel = ((torch.tensor(k_rot.theta, dtype=torch.float64) - want).abs() / want).max()
    if rel > 1e-6:
        raise RuntimeError(
            f"{layer_name}: the policy's k_rot angles differ from the model's RoPE (base {base}, "
            f"head_dim {head_dim}) by up to {float(rel):.2e} relative; was the policy calibrated "
            "for another model?")


class Nvfp4MixedImpl(AttentionImpl[Nvfp4MixedMetadata]):
    """Attention for one layer whose K/V pages are FP8 or NVFP4 per the policy."""

    # Queries stay in the model dtype: Attention.__init__ would otherwise build an FP8 query
    # quantizer for any kv_cache_dtype starting with "nvfp4".
    supports_quant_query_input = False

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: Optional[int] = None, alibi_slopes: Optional[list[float]] = None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = CACHE_DTYPE,
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None, **unsupported: Any) -> None:
        problems = [name for name, bad in (
            ("ALiBi", alibi_slopes is not None),
            (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
            ("KV sharing across layers", kv_sharing_target_layer_name is not None),
            (f"options {sorted(unsupported)}", bool(unsupported)),
        ) if bad]
        if problems:
            raise NotImplementedError(f"{CACHE_DTYPE} attention does not support {', '.join(problems)}")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"attention sinks must be one logit per query head [{num_heads}], "
                             f"got shape {tuple(sinks.shape)}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {sliding_window}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or None
        self.sliding_window = sliding_window  # keys at positions > pos - window (None: all)
        # gpt-oss's learned per-head logits: vLLM's parameter (model dtype, loaded after this
        # constructor) and its fp32 copy for the kernels, made by bind() after loading
        self.sinks = sinks
        self.sink_logits: Optional[torch.Tensor] = None  # float32 [num_heads], persistent
        self.attn_type = attn_type
        self.layer_name: Optional[str] = None
        self.layout: Optional[KVPageLayout] = None
        self.k_scale: Optional[torch.Tensor] = None  # float32 [num_kv_heads], persistent
        self.v_scale: Optional[torch.Tensor] = None
        self.k_smooth: Optional[torch.Tensor] = None  # float32 [num_kv_heads, D]: cache holds K / it
        self.q_smooth: Optional[torch.Tensor] = None  # float32 [num_heads, D]: queries times it
        self.k_center: Optional[torch.Tensor] = None  # float32 [num_kv_heads, D]: cache holds K - it
        self.k_perm: Optional[torch.Tensor] = None  # int64 [num_kv_heads, D]: cache holds K[..., it]
        self.q_perm: Optional[torch.Tensor] = None  # int64 [num_heads, D]: queries permuted alike
        # the sink key stored uncentered (policy k_sink_uncentered), float32 [num_kv_heads, D]:
        # position 0 holds K - k0_center, and readers subtract key0_shift from its decoding
        self.k0_center: Optional[torch.Tensor] = None
        self.key0_shift: Optional[torch.Tensor] = None
        # the rotating K center (policy k_rot): RotCenter's tensors, persistent, and the flagged
        # sink heads written without it at position 0 (int32 [num_kv_heads])
        self.rot_idx: Optional[torch.Tensor] = None  # int32 [num_kv_heads, k]
        self.rot_b: Optional[torch.Tensor] = None  # float32 [num_kv_heads, 2, k]
        self.rot_theta: Optional[torch.Tensor] = None  # float32 [num_kv_heads, k]
        self.key0_plain: Optional[torch.Tensor] = None
        self.rot_center: Optional[RotCenter] = None
        self._ops: Optional[ops.LayerOps] = None  # checked once per layer and cache tensor
        self._ops_of: Optional[torch.Tensor] = None
        config = get_current_vllm_config_or_none()  # set while vLLM builds the model's layers
        self._scratch_rows = scratch_rows(config) if config and config.model_config else 0

    def bind(self, layer_name: str, index: Optional[int], row: LayerPolicy, layout: KVPageLayout,
             vllm_config: Any, device: torch.device) -> None:
        """Attach the layer's page layout and policy scales (in place if already bound).

        ``index`` is the layer's policy row, None for a speculative draft's layer (whose row is
        the fixed draft rule, so it does not trigger the uncalibrated-scales warning).
        """
        global _warned_default_scales
        from vllm.distributed import get_tensor_model_parallel_rank

        if layout.num_kv_heads != self.num_kv_heads or layout.head_dim != self.head_size:
            raise RuntimeError(f"{layer_name}: layout {layout} does not match the layer "
                               f"({self.num_kv_heads} KV heads, head size {self.head_size})")
        if row.layer_type.sinks != (self.sinks is not None):
            raise RuntimeError(
                f"{layer_name}: the policy row (from the model config) says layer {index} is "
                f"{row.layer_type.label()}, but vLLM built it "
                f"{'with' if self.sinks is not None else 'without'} attention sinks")
        if row.k_center is not None and self.logits_soft_cap is not None:
            raise RuntimeError(
                f"{layer_name}: the policy centers K (k_center), which shifts every logit of a "
                f"query by q . mu; the model's logits soft-cap ({self.logits_soft_cap}) is not "
                f"shift-invariant. Calibrate without --k-center for this model")
        dropped = [n for n in CHANNEL_FIELDS if getattr(row, n) is None and getattr(self, n) is not None]
        if row.k_sink_uncentered is None and self.key0_shift is not None:
            dropped.append("k_sink_uncentered")
        if row.k_rot is None and self.rot_center is not None:
            dropped.append("k_rot")
        if dropped:
            raise RuntimeError(f"{layer_name}: rebinding cannot drop {dropped[0]}")
        if index is not None and not _warned_default_scales and (
                row.quant_scale("k") is None or row.quant_scale("v") is None) \
                and not planned(vllm_config):  # start-up calibration replaces them before serving
            _warned_default_scales = True
            logger.warning(
                "vllm-nvfp4: the policy has no calibrated scale for some K/V planes (first: layer "
                "%d); using the defaults FP8 scale %.4g and NVFP4 global scale %.4g (|x| <= 448 "
                "representable). Calibrate the model for accuracy.",
                index, DEFAULT_FP8_SCALE, DEFAULT_NVFP4_GLOBAL_SCALE)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        tensors = rank_row_values(row, layer_name, vllm_config.model_config.get_total_num_kv_heads(),
                                  self.num_kv_heads, self.num_heads, self.head_size,
                                  get_tensor_model_parallel_rank() if tp_size > 1 else 0, tp_size)
        if self.sinks is not None:
            tensors["sink_logits"] = self.sinks.detach().float().cpu().tolist()
        # vLLM binds twice (once inside inference mode while it sizes CUDA-graph memory, then
        # outside it for the real cache): keep these normal tensors so the in-place update
        # is legal in both places.
        with torch.inference_mode(False):
            for attr, vals in tensors.items():
                new = torch.tensor(vals, dtype=torch.int64 if attr in INDEX_FIELDS else
                                   torch.int32 if attr in INT32_FIELDS else torch.float32)
                current = getattr(self, attr)
                if current is None or current.shape != new.shape:
                    setattr(self, attr, new.to(device))
                else:
                    current.copy_(new)  # in place: CUDA graphs keep pointing at it
        if row.k_rot is not None:
            self.rot_center = RotCenter(self.rot_idx, self.rot_b, self.rot_theta)
            try:
                self.rot_center.check(self.num_kv_heads, self.head_size)
            except ValueError as e:
                raise RuntimeError(
                    f"{layer_name}: the policy's k_rot (layer {index}) has k = "
                    f"{row.k_rot.num_pairs} pairs per KV head, which the attention kernels do not "
                    f"take ({e}); calibrate with a power of 2 in [8, {self.head_size // 2}]") from e
            check_rot_theta(layer_name, row.k_rot, getattr(vllm_config.model_config,
                                                           "hf_text_config", None), self.head_size)
        self.layer_name, self.layout = layer_name, layout
        self._ops = self._ops_of = None  # the next call checks the new layout and scales

    def _layer_ops(self, kv_cache: torch.Tensor) -> ops.LayerOps:
        """The layer's cache operations over ``kv_cache`` (vLLM's view), built at its first use."""
        if self._ops_of is not kv_cache:
            fused = self._center_in_write
            self._ops = ops.LayerOps(page_view(kv_cache, self.layout), self.layout, self.k_scale,
                                     self.v_scale, self.sliding_window, self.logits_soft_cap,
                                     self.sink_logits, key0_shift=self.key0_shift,
                                     rot_center=self.rot_center, key0_plain=self.key0_plain,
                                     k_center=self.k_center if fused else None,
                                     k0_center=self.k0_center if fused else None)
            self._ops_of = kv_cache
        return self._ops

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize this step's K/V into the layer's pages (slot < 0: padding, skipped). Stored:
        ``K - mu' - R(p) b_k`` (``k_center``, then the rotating center at the token's position
        from the step's metadata, subtracted by the write), the flagged sink heads' key at
        position 0 as computed."""
        if self.layout is None or kv_cache.numel() == 0:
            return  # profiling run before the KV cache exists
        n = min(key.shape[0], slot_mapping.shape[0])
        if n == 0:
            return
        key = key[:n]
        first = positions = None
        if self.key0_shift is not None:  # position 0 stored without mu (k0_center)
            first = self._first_keys(n)
        if not self._center_in_write:
            key = stored_keys(key, key_centers(self.k_center, self.k0_center, first),
                              self.k_smooth, self.k_perm)
        if self.rot_center is not None:
            positions = self._step_tokens("positions", n, "centers K on a rotating offset",
                                          "where")
        self._layer_ops(kv_cache).write(key, value[:n], slot_mapping[:n], positions,
                                        first if self._center_in_write else None)

    @property
    def _center_in_write(self) -> bool:
        """Whether the cache write subtracts ``k_center`` itself (no launches of its own): without
        smoothing or a channel permutation, which :func:`stored_keys` applies before the write."""
        return self.k_smooth is None and self.k_perm is None

    def _first_keys(self, n: int) -> torch.Tensor:
        """bool ``[n]``: which of this step's ``n`` written tokens sit at position 0, from the
        step's metadata (:func:`mark_first_keys`)."""
        return self._step_tokens("first_keys", n, "stores its sink key uncentered",
                                 "which of")

    def _step_tokens(self, field: str, n: int, why: str, what: str) -> torch.Tensor:
        """The first ``n`` rows of a per-token field of this step's metadata (``first_keys``,
        ``positions``); RuntimeError naming the layer, ``why`` it needs them, if absent."""
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        if isinstance(meta, list):  # speculative decoding: [0] holds the target model's
            meta = meta[0]
        if isinstance(meta, dict):
            meta = meta.get(self.layer_name)
        rows = getattr(meta, field, None)
        if rows is None or rows.shape[0] < n:
            raise RuntimeError(
                f"{self.layer_name}: the layer {why}, but this step's attention metadata "
                f"({type(meta).__name__}) does not say {what} its {n} tokens sit "
                f"({field})")
        return rows[:n]

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[Nvfp4MixedMetadata],
                output: torch.Tensor, output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal paged attention of ``query [tokens, heads, D]`` into ``output``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{CACHE_DTYPE} attention has no fused output quantization")
        if attn_metadata is None:  # profiling run: count the dense-prefill scratch in the peak
            if query.dtype in DENSE_DTYPES and dense_prefill_enabled(query.device):
                reserve_scratch(self._scratch_rows, self.num_kv_heads, self.head_size,
                                query.dtype, query.device)
            return output.fill_(0)
        if isinstance(attn_metadata, CalibrationBatch):  # start-up calibration: exact attention
            return attn_metadata.attend(self, query, key, value, output)
        m = attn_metadata
        layer_ops = self._layer_ops(kv_cache)
        if self.q_perm is not None:  # the cache holds K's channels in this order
            query = permute_channels(query, self.q_perm)
        if self.q_smooth is not None:  # q . (K / lam) with q * lam: the smoothing cancels
            query = (query.float() * self.q_smooth).to(query.dtype)
        if (not m.prefill_groups or query.dtype not in DENSE_DTYPES
                or not dense_prefill_supports(self.head_size, self.sinks is not None)):
            n = m.num_actual_tokens
            layer_ops.attend(query[:n], m.block_table, m.seq_lens, m.query_start_loc,
                             m.max_query_len, m.max_seq_len, self.scale, output[:n])
            return output
        d, nd = m.num_decodes, m.num_decode_tokens
        if d:
            layer_ops.attend(query[:nd], m.block_table[:d], m.seq_lens[:d],
                             m.query_start_loc[: d + 1], m.decode_max_query_len,
                             m.decode_max_seq_len, self.scale, output[:nd])
        attention, fa_version = flash_varlen()
        for group in m.prefill_groups:
            dense_prefill(query, output, layer_ops.cache, self.layout, self.k_scale, self.v_scale,
                          m.block_table, m.seq_lens, group, self.scale, self.logits_soft_cap,
                          attention, sliding_window=self.sliding_window, sinks=self.sink_logits,
                          key0_shift=self.key0_shift, rot_center=self.rot_center,
                          fa_version=fa_version)
        return output
