"""The cache operations of one attention layer, checked at the edge and dispatched.

* CUDA tensors run the Triton kernels of :mod:`vllm_nvfp4.kernels`;
* CPU tensors run :mod:`vllm_nvfp4.paged_torch` (vLLM's CPU path, CI).

:class:`LayerOps` checks a layer's fixed arguments (cache, layout, scales, window, soft-cap, sinks,
backend) once, when it is built. A call's tensors are checked when their shapes, dtypes, strides
and devices differ from those of the last call that passed, and a step's metadata (block table,
sequence lengths, query starts: the same objects for every layer of the step) when it differs
from the last checked: the first layer of a step runs the checks, the others compare.
:func:`write_kv_cache` and :func:`paged_attention` build a :class:`LayerOps` for one call (tests,
tools). The errors are the same either way.

``backend="torch"`` (or ``VLLM_NVFP4_FORCE_TORCH=1``) forces the torch path on CUDA, and
``backend="triton"`` forces the kernels (on CPU tensors that needs ``TRITON_INTERPRET=1`` set
before :mod:`vllm_nvfp4.kernels` is imported). Checks here never read tensor contents, so the
Triton path stays free of host syncs and CUDA-graph capturable.
"""

from __future__ import annotations

import os
from typing import Literal, Optional

import torch

from vllm_nvfp4 import paged_torch
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.layout import KVPageLayout

Backend = Literal["auto", "torch", "triton"]
FORCE_TORCH_ENV = "VLLM_NVFP4_FORCE_TORCH"
KV_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ATTN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: head dims the Triton kernels are built and tested for (the torch path takes any multiple of 16)
TRITON_HEAD_DIMS = (64, 128, 256, 512)


def _backend(device: torch.device, backend: Backend) -> str:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend != "auto":
        return backend
    if device.type == "cuda" and os.environ.get(FORCE_TORCH_ENV, "0") not in ("1", "true", "True"):
        return "triton"
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}; vllm-nvfp4 runs on CPU or CUDA")
    return "torch"


def _check_scales(layout: KVPageLayout, device: torch.device, **scales: torch.Tensor) -> None:
    for name, t in scales.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor [num_kv_heads], got {getattr(t, 'dtype', t)}")
        if tuple(t.shape) != (layout.num_kv_heads,) or t.device != device:
            raise ValueError(
                f"{name} must have shape ({layout.num_kv_heads},) on {device}, "
                f"got {tuple(t.shape)} on {t.device}"
            )


def _check_heads(name: str, x: torch.Tensor, layout: KVPageLayout, dtypes: tuple) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in dtypes:
        raise TypeError(f"{name} must be a tensor of {dtypes}, got {getattr(x, 'dtype', x)}")
    if x.dim() != 3 or x.shape[-1] != layout.head_dim:
        raise ValueError(
            f"{name} must be [tokens, heads, {layout.head_dim}], got shape {tuple(x.shape)}"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"{name} needs stride(-1) == 1, got strides {tuple(x.stride())}")


SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_triton_head_dim(layout: KVPageLayout) -> None:
    if layout.head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(
            f"head_dim {layout.head_dim} is not supported by the Triton kernels "
            f"(supported: {TRITON_HEAD_DIMS})"
        )


def _check_head_rows(name: str, t: torch.Tensor, layout: KVPageLayout,
                     device: torch.device) -> None:
    """``t`` a contiguous float32 ``[num_kv_heads, head_dim]`` tensor on ``device``."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor [num_kv_heads, head_dim], "
                        f"got {getattr(t, 'dtype', t)}")
    if tuple(t.shape) != (layout.num_kv_heads, layout.head_dim) or t.device != device \
            or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, of shape ({layout.num_kv_heads}, "
                         f"{layout.head_dim}) on {device}, got {tuple(t.shape)} on {t.device}")


def _check_rot_center(rot: RotCenter, layout: KVPageLayout, device: torch.device,
                      backend: str) -> None:
    """A :class:`RotCenter` of the layer's KV heads on ``device`` (the Triton attention kernels'
    ``k`` limit on the Triton backend)."""
    if not isinstance(rot, RotCenter):
        raise TypeError(f"rot_center must be a RotCenter, got {type(rot).__name__}")
    rot.check(layout.num_kv_heads, layout.head_dim, kernel_pairs=backend == "triton")
    if any(t.device != device for t in (rot.idx, rot.b, rot.theta)):
        raise ValueError(f"rot_center must be on {device}, got {rot.idx.device}")


def _check_int32(tensors: tuple[tuple[str, torch.Tensor, int], ...], device: torch.device,
                 beside: str) -> None:
    """Each ``(name, tensor, rank)`` an int32 tensor of that rank on ``device``, where ``beside``
    (a name, for the message) is."""
    for name, t, nd in tensors:
        if t.dtype != torch.int32 or t.dim() != nd:
            raise ValueError(f"{name} must be a {nd}-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {beside} is on {device}")


def _check_step(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                device: torch.device) -> None:
    """The attention metadata of a step: dtypes, ranks, sequence counts, device."""
    _check_int32((("block_table", block_table, 2), ("seq_lens", seq_lens, 1),
                  ("query_start_loc", query_start_loc, 1)), device, "query")
    num_seqs = seq_lens.shape[0]
    if block_table.shape[0] < num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"{num_seqs} sequences need block_table [>= {num_seqs}, blocks] and query_start_loc "
            f"[{num_seqs + 1}], got {tuple(block_table.shape)} and {tuple(query_start_loc.shape)}"
        )


class _Passed:
    """What the per-step checks last passed, so that the other layers of a step skip them.

    ``step``: the metadata tensors (block table, sequence lengths, query starts), held, compared
    by identity: every layer of a step gets the same objects, and a tensor's dtype, rank and
    device never change (its shape only by an in-place resize, which vLLM does not do to these).
    ``signatures``: per kind of call, what its checks read: of the layer, and of each tensor its
    shape, dtype, strides and device; equal signatures pass and fail alike.
    """

    step: tuple[torch.Tensor, ...] = ()
    signatures: dict[str, tuple] = {}

    @classmethod
    def check_step(cls, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, device: torch.device) -> None:
        last = cls.step
        if len(last) == 3 and last[0] is block_table and last[1] is seq_lens and last[2] is query_start_loc:
            return
        _check_step(block_table, seq_lens, query_start_loc, device)
        cls.step = (block_table, seq_lens, query_start_loc)


def _tensor_key(t: torch.Tensor) -> tuple:
    """What the checks read of a tensor (AttributeError for anything else)."""
    return t.shape, t.dtype, t.stride(), t.device


class LayerOps:
    """The cache operations of one attention layer, its fixed arguments checked once (module doc).

    Args:
        cache: uint8 ``[num_blocks, layout.page_bytes]``, ``stride(1) == 1``: the layer's pages.
        layout: the page layout of this layer.
        k_scale, v_scale: float32 ``[num_kv_heads]`` on the cache's device: FP8 scale or NVFP4
            global scale per head (persistent tensors may be updated in place later).
        sliding_window: keys at positions ``> pos - sliding_window`` only (None: no window).
        logits_soft_cap: ``cap * tanh(logits / cap)`` on the scaled logits (None/0: off).
        sinks: ``[num_q_heads]`` fp32/bf16/fp16 per-head sink logits, or None (see
            :func:`paged_attention`).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (module doc).
        key0_shift: float32 ``[num_kv_heads, head_dim]`` on the cache's device, or None: the
            layer stores the key at position 0 of each sequence uncentered, and attention gives
            it the logit of ``k0 - key0_shift`` (:func:`vllm_nvfp4.key_transform.sink_shift`;
            rows of 0 for heads stored centered). Not with a logits soft-cap.
        rot_center: a :class:`~vllm_nvfp4.kernels.launch.RotCenter` on the cache's device, or
            None: keys are stored minus the rotating center ``R(p) b_k`` (policy ``k_rot``; ``p``
            the key's index in its sequence, :meth:`write`'s ``positions``) and read plus it.
            Its ``k`` is any on the torch path, a power of 2 in ``[8, head_dim / 2]`` on Triton.
        key0_plain: int32 ``[num_kv_heads]`` (with ``rot_center``), or None: nonzero where a
            head's key at position 0 is written without the rotating center (the sink key stored
            uncentered; ``key0_shift`` then holds ``mu' + b_k`` for the head).
        k_center: float32 ``[num_kv_heads, head_dim]`` on the cache's device, or None: keys are
            written minus it (policy ``k_center``; FP32, rounded back to the key's dtype, as
            :func:`vllm_nvfp4.key_transform.stored_keys`), before any rotating center.
        k0_center: like ``k_center`` (and with it), or None: the center of the keys
            :meth:`write`'s ``first`` marks (position 0, the sink key stored uncentered).
    """

    def __init__(self, cache: torch.Tensor, layout: KVPageLayout, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, sliding_window: Optional[int] = None,
                 logits_soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                 backend: Backend = "auto", key0_shift: Optional[torch.Tensor] = None,
                 rot_center: Optional[RotCenter] = None,
                 key0_plain: Optional[torch.Tensor] = None,
                 k_center: Optional[torch.Tensor] = None,
                 k0_center: Optional[torch.Tensor] = None) -> None:
        layout.check_cache(cache)
        self.device = cache.device
        _check_scales(layout, self.device, k_scale=k_scale, v_scale=v_scale)
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be None or > 0, got {sliding_window}")
        if logits_soft_cap is not None and logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be None or >= 0, got {logits_soft_cap}")
        if sinks is not None:
            if not isinstance(sinks, torch.Tensor) or sinks.dtype not in SINK_DTYPES:
                raise TypeError(f"sinks must be a tensor of {SINK_DTYPES} [num_q_heads], "
                                f"got {getattr(sinks, 'dtype', sinks)}")
            if sinks.dim() != 1 or sinks.device != self.device:
                raise ValueError(f"sinks must have shape (num_q_heads,) (one logit per query head) "
                                 f"on {self.device}, got {tuple(sinks.shape)} on {sinks.device}")
            if sinks.stride(0) != 1:
                raise ValueError(f"sinks must be contiguous, got stride {sinks.stride(0)}")
        if key0_shift is not None:
            _check_head_rows("key0_shift", key0_shift, layout, self.device)
            if logits_soft_cap:
                raise ValueError("key0_shift (the sink key stored uncentered) needs logits that "
                                 "shift with q . mu, which a logits soft-cap does not allow")
        self.key0_shift = key0_shift
        self.backend = _backend(self.device, backend)
        if self.backend == "triton":
            _check_triton_head_dim(layout)
        if rot_center is not None:
            _check_rot_center(rot_center, layout, self.device, self.backend)
        if key0_plain is not None and (rot_center is None or key0_plain.dtype != torch.int32 or tuple(
                key0_plain.shape) != (layout.num_kv_heads,) or key0_plain.device != self.device):
            raise ValueError(f"key0_plain must be int32 [{layout.num_kv_heads}] on {self.device} "
                             f"with a rot_center, got {key0_plain.dtype} "
                             f"{tuple(key0_plain.shape)} on {key0_plain.device}")
        self.rot_center, self.key0_plain = rot_center, key0_plain
        for name, t in (("k_center", k_center), ("k0_center", k0_center)):
            if t is not None:
                _check_head_rows(name, t, layout, self.device)
        if k0_center is not None and k_center is None:
            raise ValueError("k0_center (the center of position-0 keys) needs k_center")
        self.k_center, self.k0_center = k_center, k0_center
        self.cache, self.layout = cache, layout
        self.k_scale, self.v_scale = k_scale, v_scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.sinks = sinks
        # what the per-call checks read from the layer
        self._layer_key = (layout.num_kv_heads, layout.head_dim, self.device,
                           None if sinks is None else sinks.shape[0])

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              positions: Optional[torch.Tensor] = None,
              first: Optional[torch.Tensor] = None) -> None:
        """Quantize and store this step's K/V into the layer's pages.

        Args:
            key, value: ``[num_tokens, num_kv_heads, head_dim]`` bf16/fp16/fp32,
                ``stride(-1) == 1``, on the cache's device.
            slot_mapping: int32/int64 ``[num_tokens]``; slot = block * block_size + offset;
                < 0 skips.
            positions: int32 ``[>= num_tokens]``, each token's index in its sequence (``< 2^24``);
                needed with a ``rot_center``, which is subtracted from the keys in FP32 first.
            first: bool ``[>= num_tokens]``, the tokens at position 0; needed with a
                ``k0_center`` (their keys are centered by it instead of ``k_center``).
        Bytes match :mod:`vllm_nvfp4.formats` (``nonfinite="propagate"``) bit for bit (with a
        ``rot_center``: of the key minus the offset; the torch path's offset is float64-exact,
        the kernel's within ~1e-6 relative of it).
        """
        rot = self.rot_center
        if rot is not None and positions is not None:
            positions = positions[:key.shape[0]]
        if self.k0_center is not None and first is not None:
            first = first[:key.shape[0]]
        try:
            signature = (self._layer_key, _tensor_key(key), _tensor_key(value),
                         _tensor_key(slot_mapping), rot is not None and _tensor_key(positions),
                         self.k0_center is not None and _tensor_key(first))
        except AttributeError:  # not tensors: the checks say which
            signature = None
        if signature is None or _Passed.signatures.get("write") != signature:
            self._check_write(key, value, slot_mapping, positions, first)
            _Passed.signatures["write"] = signature
        if key.shape[0] == 0:
            return
        centers = (self.k_center, self.k0_center, first)
        if self.backend == "torch":
            paged_torch.write_kv_cache(key, value, self.cache, slot_mapping, self.layout,
                                       self.k_scale, self.v_scale, rot, positions, self.key0_plain,
                                       *centers)
            return
        from vllm_nvfp4.kernels import cache_write

        cache_write.write_kv_cache(key, value, self.cache, slot_mapping, self.layout, self.k_scale,
                                   self.v_scale, rot, positions, self.key0_plain, *centers)

    def _check_write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                     positions: Optional[torch.Tensor], first: Optional[torch.Tensor]) -> None:
        layout = self.layout
        _check_heads("key", key, layout, KV_INPUT_DTYPES)
        _check_heads("value", value, layout, KV_INPUT_DTYPES)
        if key.shape != value.shape or key.shape[1] != layout.num_kv_heads:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                f"[tokens, {layout.num_kv_heads}, {layout.head_dim}]"
            )
        if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (
            key.shape[0],
        ):
            raise ValueError(
                f"slot_mapping must be int32/int64 [{key.shape[0]}], "
                f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
            )
        for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}")
        if self.rot_center is not None:
            if positions is None:
                raise ValueError("a layer with a rot_center needs the tokens' positions to write")
            _check_int32((("positions", positions, 1),), self.device, "the cache")
            if positions.shape[0] != key.shape[0] or positions.stride(0) != 1:
                raise ValueError(f"positions must be contiguous [>= {key.shape[0]}] (one per "
                                 f"token), got {tuple(positions.shape)}")
        if self.k0_center is not None:
            if first is None:
                raise ValueError("a layer with a k0_center needs to know which tokens sit at "
                                 "position 0 to write (first)")
            if first.dtype != torch.bool or first.dim() != 1 or first.shape[0] != key.shape[0] \
                    or first.stride(0) != 1 or first.device != self.device:
                raise ValueError(f"first must be a contiguous bool tensor [>= {key.shape[0]}] "
                                 f"(one per token) on {self.device}, got {first.dtype} "
                                 f"{tuple(first.shape)} on {first.device}")

    def attend(self, query: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
               softmax_scale: float, out: torch.Tensor) -> torch.Tensor:
        """Causal paged attention of a batch of sequences over the layer's pages.

        Args:
            query, out: ``[num_query_tokens, num_q_heads, head_dim]`` (bf16/fp16/fp32);
                ``num_q_heads`` a multiple of ``num_kv_heads`` (GQA/MQA).
            block_table: int32 ``[num_seqs, max_blocks]``.
            seq_lens: int32 ``[num_seqs]``: context length including this step's tokens.
            query_start_loc: int32 ``[num_seqs + 1]``: query token ranges, cumulative.
            max_query_len, max_seq_len: host ints (launch configuration; upper bounds).
            softmax_scale: multiplies ``q . k`` before the softmax.
        Query token j of sequence s sits at position ``seq_lens[s] - q_len + j`` and attends
        causally; the sinks (if any) join the softmax as in :func:`paged_attention`. Returns
        ``out``.
        """
        try:
            signature = (self._layer_key, _tensor_key(query), _tensor_key(out))
        except AttributeError:  # not tensors: the checks say which
            signature = None
        if signature is None or _Passed.signatures.get("attend") != signature:
            self._check_attend(query, out)
            _Passed.signatures["attend"] = signature
        _Passed.check_step(block_table, seq_lens, query_start_loc, self.device)
        if seq_lens.shape[0] == 0 or query.shape[0] == 0:
            return out
        args = (
            query, self.cache, self.layout, self.k_scale, self.v_scale, block_table, seq_lens,
            query_start_loc, int(max_query_len), int(max_seq_len), float(softmax_scale), out,
            self.sliding_window, self.logits_soft_cap, self.sinks, self.key0_shift,
        )
        if self.backend == "torch":
            return paged_torch.paged_attention(*args, rot_center=self.rot_center)
        from vllm_nvfp4.kernels import attention

        return attention.paged_attention(*args, rot_center=self.rot_center)

    def _check_attend(self, query: torch.Tensor, out: torch.Tensor) -> None:
        layout = self.layout
        _check_heads("query", query, layout, ATTN_DTYPES)
        _check_heads("out", out, layout, ATTN_DTYPES)
        if out.shape != query.shape:
            raise ValueError(f"out {tuple(out.shape)} must match query {tuple(query.shape)}")
        if query.shape[1] % layout.num_kv_heads != 0:
            raise ValueError(
                f"num_q_heads {query.shape[1]} must be a multiple of num_kv_heads {layout.num_kv_heads}"
            )
        if self.sinks is not None and self.sinks.shape[0] != query.shape[1]:
            raise ValueError(f"sinks must have shape ({query.shape[1]},) (one logit per query head), "
                             f"got {tuple(self.sinks.shape)}")
        for name, t in (("query", query), ("out", out)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVPageLayout,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    backend: Backend = "auto",
    rot_center: Optional[RotCenter] = None,
    positions: Optional[torch.Tensor] = None,
    key0_plain: Optional[torch.Tensor] = None,
    k_center: Optional[torch.Tensor] = None,
    k0_center: Optional[torch.Tensor] = None,
    first: Optional[torch.Tensor] = None,
) -> None:
    """Quantize and store this step's K/V into one layer's paged cache: :meth:`LayerOps.write`,
    every argument checked (``cache``, ``layout``, scales, ``backend``, ``rot_center``,
    ``key0_plain``, ``k_center``, ``k0_center`` as in :class:`LayerOps`)."""
    LayerOps(cache, layout, k_scale, v_scale, backend=backend, rot_center=rot_center,
             key0_plain=key0_plain, k_center=k_center,
             k0_center=k0_center).write(key, value, slot_mapping, positions, first)


def paged_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    layout: KVPageLayout,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    softmax_scale: float,
    out: torch.Tensor,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    backend: Backend = "auto",
    key0_shift: Optional[torch.Tensor] = None,
    rot_center: Optional[RotCenter] = None,
) -> torch.Tensor:
    """Causal paged attention of a batch of sequences, K/V read from the quantized cache:
    :meth:`LayerOps.attend`, every argument checked (the layer's as in :class:`LayerOps`).

    ``sinks``: ``[num_q_heads]`` fp32 (bf16/fp16 read as fp32), or None: each head's attention-sink
    logit (gpt-oss; vLLM's ``sinks`` / FlashAttention's ``s_aux``). It joins the softmax as one
    more logit without a value: ``out = sum_j e^(l_j - m) v_j / (sum_j e^(l_j - m) +
    e^(sink - m))``, ``m`` the max over the real logits ``l_j`` (scaled, soft-capped, masked) and
    the sink; the sink itself is neither scaled nor capped. ``key0_shift``: see
    :class:`LayerOps`. Returns ``out``.
    """
    return LayerOps(cache, layout, k_scale, v_scale, sliding_window, logits_soft_cap, sinks,
                    backend, key0_shift, rot_center).attend(
        query, block_table, seq_lens, query_start_loc, max_query_len, max_seq_len, softmax_scale,
        out)


def dequantize_kv(
    cache: torch.Tensor,
    layout: KVPageLayout,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seq_len: int,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    first_seq: int = 0,
    seq_starts: Optional[torch.Tensor] = None,
    backend: Backend = "auto",
    key0_shift: Optional[torch.Tensor] = None,
    rot_center: Optional[RotCenter] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K/V of sequences: positions ``[a_i, seq_lens[s])`` of sequence ``s = first_seq + i``
    go to rows ``cu_seqlens[i] + pos - a_i`` of ``k_out``/``v_out``; ``a_i = seq_starts[i]``
    (a sliding window's first visible key), or 0 without ``seq_starts``.

    Args:
        cache, layout, k_scale, v_scale: as in :func:`write_kv_cache`.
        block_table: int32 ``[batch, max_blocks]``; seq_lens: int32 ``[batch]``;
        cu_seqlens: int32 ``[n + 1]``, the output row where each of the ``n`` sequences
            ``first_seq .. first_seq + n - 1`` starts.
        max_seq_len: host int, ``>=`` every ``seq_lens[s] - a_i``.
        seq_starts: int32 ``[n]`` with ``0 <= a_i <= seq_lens[s]``, or None (contents unchecked).
        k_out, v_out: ``[>= cu_seqlens[-1], num_kv_heads, head_dim]`` bf16/fp16/fp32,
            ``stride(-1) == 1``.
    Values are the FP32 dequantization (per-head scales applied; ``key0_shift``, as in
    :class:`LayerOps`, subtracted from position 0's key; then ``R(p) b_k`` of ``rot_center``
    added to every key) rounded once to the output dtype, equal to
    :func:`vllm_nvfp4.paged_torch.read_kv_from_cache` (with ``rot_center``: to ~1e-6 relative,
    the kernel's angles in FP32). Returns ``(k_out, v_out)``.
    """
    layout.check_cache(cache)
    _check_heads("k_out", k_out, layout, ATTN_DTYPES)
    _check_heads("v_out", v_out, layout, ATTN_DTYPES)
    _check_int32((("block_table", block_table, 2), ("seq_lens", seq_lens, 1),
                  ("cu_seqlens", cu_seqlens, 1)), cache.device, "cache")
    end = first_seq + cu_seqlens.shape[0] - 1
    if first_seq < 0 or cu_seqlens.shape[0] < 1 or end > min(seq_lens.shape[0], block_table.shape[0]):
        raise ValueError(f"sequences [{first_seq}, {end}) are not all in seq_lens "
                         f"{tuple(seq_lens.shape)} and block_table {tuple(block_table.shape)}")
    if k_out.shape[1] != layout.num_kv_heads or v_out.shape[1] != layout.num_kv_heads:
        raise ValueError(f"k_out/v_out must have {layout.num_kv_heads} KV heads, got "
                         f"{tuple(k_out.shape)} / {tuple(v_out.shape)}")
    _check_scales(layout, cache.device, k_scale=k_scale, v_scale=v_scale)
    if key0_shift is not None:
        _check_head_rows("key0_shift", key0_shift, layout, cache.device)
    chosen = _backend(cache.device, backend)
    if rot_center is not None:
        _check_rot_center(rot_center, layout, cache.device, "torch")  # the kernel takes any k
    if seq_starts is not None and (seq_starts.dtype != torch.int32 or tuple(seq_starts.shape) != (
            end - first_seq,) or seq_starts.device != cache.device):
        raise ValueError(f"seq_starts must be int32 [{end - first_seq}] on {cache.device}, got "
                         f"{seq_starts.dtype} {tuple(seq_starts.shape)} on {seq_starts.device}")
    if chosen == "torch":
        rows, lens = cu_seqlens.tolist(), seq_lens[first_seq:end].tolist()
        firsts = [0] * len(lens) if seq_starts is None else seq_starts.tolist()
        for i, (row, n, a) in enumerate(zip(rows, lens, firsts)):
            ids = block_table[first_seq + i, : -(-n // layout.block_size)]
            k, v = paged_torch.read_kv_from_cache(cache, layout, ids, k_scale, v_scale, n,
                                                  key0_shift, rot_center)
            k_out[row:row + n - a] = k[a:]
            v_out[row:row + n - a] = v[a:]
        return k_out, v_out
    _check_triton_head_dim(layout)
    from vllm_nvfp4.kernels import dequant

    dequant.dequantize_kv(cache, layout, k_scale, v_scale, block_table, seq_lens, cu_seqlens,
                          int(max_seq_len), k_out, v_out, int(first_seq), seq_starts,
                          key0_shift=key0_shift, rot=rot_center)
    return k_out, v_out
