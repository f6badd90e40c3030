"""Run a Hugging Face causal LM with its KV cache fake-quantized exactly as vLLM would store it.

How it hooks in
---------------
transformers 5 dispatches attention through ``ALL_ATTENTION_FUNCTIONS``; this module registers
``vllm_nvfp4_kv|sdpa`` and ``vllm_nvfp4_kv|eager``, and :func:`kv_cache_quantization` switches a
model to them inside a ``with`` block. The wrapper gets ``key``/``value``
``[batch, kv_heads, seq, head_dim]`` after RoPE and before GQA repetition - the tensors vLLM
caches - and the layer index from ``module.layer_idx``.

What "as served" means
----------------------
* Every K and V head vector is quantized once from the model dtype with :mod:`vllm_nvfp4.formats`
  (``fp8_quantize`` / ``nvfp4_quantize``) in the layer's format with its policy scale (missing
  scales: :attr:`~vllm_nvfp4.formats.KVFormat.default_scale`, as in serving), dequantized in FP32
  and cast to the query dtype, as the Triton attention reads it.
* The prompt's own K/V are quantized too (vLLM writes, then attends). With a ``DynamicCache`` the
  whole history is re-quantized each step: static scales give every token the bytes it was
  written with; only compute is repeated.
* Non-finite K/V follow the kernels (``nonfinite="propagate"``): a bad 16-block decodes to NaN.

The sink key
------------
A policy layer with ``k_sink_uncentered`` stores the key at position 0 of every sequence (the
attention sink) as the serving cache does: quantized before K centering, ``mu / lam`` subtracted
after decoding (:func:`with_uncentered_sink`).

The rotating K center
---------------------
A policy layer with ``k_rot`` stores ``K - mu' - R(p) b_k`` and attends the read-back plus
``R(p) b_k`` (:func:`~vllm_nvfp4.key_transform.rot_offset`), ``p`` from the forward's
``position_ids`` (:func:`~vllm_nvfp4.calibration.rope.key_positions`): the keys the served
cache's readers see, up to the constant ``mu'`` (softmax-invariant).

Study options
-------------
:class:`KVOption` objects (``options``) add what the serving cache does not store (the
repository's ``studies/kv_options.py``: rotations, per-head formats, other sink-key stores). A
:class:`KVObserver` records the per-layer, per-KV-head ``amax`` of the unquantized K and V (and,
given the model's RoPE, the mean pre-RoPE key); a :class:`RotRangeObserver` the amax of the keys
a rotating K center stores.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from vllm_nvfp4.formats import (
    NonFinite,
    KVFormat,
    check_kv_format,
    fp8_dequantize,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_dequantize_folded,
    nvfp4_quantize,
)
from vllm_nvfp4.calibration.hf_model import attention_modules, model_layer_types, text_config
from vllm_nvfp4.calibration.rope import Rope, key_positions, rope_unrotate
from vllm_nvfp4.kernels.launch import RotCenter
from vllm_nvfp4.key_transform import permute_channels, rot_offset, sink_shift, stored_keys
from vllm_nvfp4.policy import KVPolicy, PolicyError

HOOK_PREFIX = "vllm_nvfp4_kv|"
_BASE_IMPLEMENTATIONS = ("sdpa", "eager")

ScaleArg = Union[float, Sequence[float], torch.Tensor]
#: how an NVFP4 cache is read back: the exact decoding (what the kernels do) or the scale-folded
#: one of an FP8 tensor-core route (:func:`~vllm_nvfp4.formats.nvfp4_dequantize_folded`)
NVFP4_DECODINGS = {"exact": nvfp4_dequantize, "folded": nvfp4_dequantize_folded}


# ---------------------------------------------------------------------------- fake quantization
def _check_decoding(name: str) -> None:
    if name not in NVFP4_DECODINGS:
        raise ValueError(f"nvfp4_decoding must be one of {', '.join(NVFP4_DECODINGS)}, got {name!r}")


def _head_scale(scale: ScaleArg, num_heads: int, extra_dims: int) -> torch.Tensor:
    """FP32 scale broadcastable over ``[..., heads, seq, (head_dim)]``: scalar or ``[heads, 1(, 1)]``."""
    s = torch.as_tensor(scale, dtype=torch.float32)
    if s.dim() == 0:
        return s
    s = s.reshape(-1)
    if s.numel() != num_heads:
        raise ValueError(f"per-head scale has {s.numel()} values, the tensor has {num_heads} KV heads")
    return s.reshape(num_heads, *([1] * extra_dims))


def fake_quantize(
    x: torch.Tensor, fmt: str, scale: ScaleArg, nonfinite: NonFinite = "propagate",
    nvfp4_decoding: str = "exact", dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Quantize and dequantize ``x [..., kv_heads, seq, head_dim]`` as the cache stores it.

    Args:
        x: K or V in the model dtype, heads on dim -3 (transformers' layout).
        fmt: ``"fp8"`` (``scale`` = FP8 scale, amax/448) or ``"nvfp4"`` (``scale`` = global scale,
            amax/2688).
        scale: a positive float, or one per KV head (sequence or tensor ``[kv_heads]``).
        nonfinite: passed to the formats reference (``"propagate"`` = the kernels' behaviour).
        nvfp4_decoding: a key of :data:`NVFP4_DECODINGS` (NVFP4 only).
        dtype: the dtype of the result (default ``x.dtype``).
    Returns:
        Tensor of ``x.shape``: FP32 dequantization cast to ``dtype``.
    """
    dtype = x.dtype if dtype is None else dtype
    fmt = check_kv_format(fmt)
    _check_decoding(nvfp4_decoding)
    if x.dim() < 3:
        raise ValueError(f"expected [..., kv_heads, seq, head_dim], got shape {tuple(x.shape)}")
    heads = x.shape[-3]
    if fmt is KVFormat.FP8:
        s = _head_scale(scale, heads, extra_dims=2).to(x.device)
        return fp8_dequantize(fp8_quantize(x, s, nonfinite=nonfinite), s, dtype=dtype)
    g = _head_scale(scale, heads, extra_dims=1).to(x.device)
    packed, block_scales = nvfp4_quantize(x, g, nonfinite=nonfinite)
    return NVFP4_DECODINGS[nvfp4_decoding](packed, block_scales, g, dtype=dtype)


# ---------------------------------------------------------------------------- observation
class _Observer:
    """What every observer shares: the layers, token counters and :meth:`range_only`."""

    #: whether the hook passes ``positions`` (the keys' positions, int64 ``[seq]``) to observe()
    wants_positions = False

    def __init__(self, num_layers: int, kv_layers: Optional[Sequence[int]] = None) -> None:
        self.num_layers = num_layers
        self.kv_layers = list(range(num_layers)) if kv_layers is None else list(kv_layers)
        self.tokens: list[int] = [0] * num_layers
        self.range_tokens: list[int] = [0] * num_layers  # observed inside range_only()
        self._range_only = False

    @contextlib.contextmanager
    def range_only(self) -> Iterator["_Observer"]:
        """Within the block, observations update only the range statistics (class doc)."""
        if self._range_only:
            raise RuntimeError("KVObserver.range_only blocks cannot be nested")
        self._range_only = True
        try:
            yield self
        finally:
            self._range_only = False

    def _count(self, layer: int, key: torch.Tensor) -> None:
        counter = self.range_tokens if self._range_only else self.tokens
        counter[layer] += key.shape[0] * key.shape[2]

    def missing_layers(self) -> list[int]:
        """Layers never observed from position 0 (a model whose attention did not go through
        the hook)."""
        return [i for i in self.kv_layers if not self.tokens[i]]


def _check_finite(layer: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"layer {layer}: {name} holds NaN/Inf; cannot calibrate")


class KVObserver(_Observer):
    """Running per-layer, per-KV-head amax of K and V (FP32 tensors ``[kv_heads]``), and per K
    channel (``[kv_heads, head_dim]``): amax (the input of K smoothing), max, min and sum (K
    centering: the mean and the amax of ``K - mean``), sum of squares (the channel RMS that
    orders a K channel permutation); and of the first key of every sequence (position 0: each
    observed sequence must start there) the per-channel max and min (whether the sink key fits
    the K range uncentered). Indexed by decoder layer; ``kv_layers`` (default: all) are the
    layers that hold a KV cache and must be observed.

    Inside :meth:`range_only` (windows run at shifted positions, :mod:`.position_range`) only the
    range statistics (K and V amax, K channel amax, max and min) take in what is observed, and
    not the first key of each sequence (at a shifted position it would be the sink key where no
    served sequence holds one); the mean, sum of squares, first-key statistics and ``tokens``
    keep coming from the windows run from position 0 (``range_tokens`` counts the others).

    Given the model's ``rope`` (:func:`~vllm_nvfp4.calibration.rope.model_rope`), also the
    per-channel sum of the pre-RoPE keys ``R(p)^-1 K`` of the windows from position 0, ``p``
    from the forward's position ids (:meth:`k_pre_mean`: ``b`` of the rotating K center)."""

    def __init__(self, num_layers: int, kv_layers: Optional[Sequence[int]] = None,
                 rope: Optional[Rope] = None) -> None:
        super().__init__(num_layers, kv_layers)
        self.rope = rope
        self.wants_positions = rope is not None
        self.k_pre_sum: list[Optional[torch.Tensor]] = [None] * num_layers  # FP64
        self.k_amax: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v_amax: list[Optional[torch.Tensor]] = [None] * num_layers
        self.k_channel_amax: list[Optional[torch.Tensor]] = [None] * num_layers
        self.k_channel_max: list[Optional[torch.Tensor]] = [None] * num_layers
        self.k_channel_min: list[Optional[torch.Tensor]] = [None] * num_layers
        self.k_channel_sum: list[Optional[torch.Tensor]] = [None] * num_layers  # FP64
        self.k_channel_sumsq: list[Optional[torch.Tensor]] = [None] * num_layers  # FP64
        self.k_first_max: list[Optional[torch.Tensor]] = [None] * num_layers
        self.k_first_min: list[Optional[torch.Tensor]] = [None] * num_layers

    def k_channel_mean(self, layer: int) -> torch.Tensor:
        """Mean of each K channel over the observed tokens, FP32 ``[kv_heads, head_dim]``."""
        return (self.k_channel_sum[layer] / self.tokens[layer]).float()  # type: ignore[operator]

    def k_pre_mean(self, layer: int) -> torch.Tensor:
        """Mean pre-RoPE key ``b`` (``R(p)^-1 K``, the RoPE's attention scaling divided out as
        the model applies it) over the tokens observed from position 0, FP32 ``[kv_heads,
        head_dim]`` (needs ``rope``)."""
        if self.k_pre_sum[layer] is None:
            raise ValueError(f"layer {layer}: no pre-RoPE keys observed (KVObserver without rope?)")
        return (self.k_pre_sum[layer] / self.tokens[layer]).float()  # type: ignore[operator]

    def k_channel_rms(self, layer: int, centered: bool) -> torch.Tensor:
        """Root mean square of each K channel (of ``K - mean`` when ``centered``) over the observed
        tokens, FP32 ``[kv_heads, head_dim]``."""
        mean_sq = self.k_channel_sumsq[layer] / self.tokens[layer]  # type: ignore[operator]
        if centered:
            mean_sq = mean_sq - (self.k_channel_sum[layer] / self.tokens[layer]) ** 2  # type: ignore[operator]
        return mean_sq.clamp(min=0).sqrt().float()

    def k_centered_channel_amax(self, layer: int) -> torch.Tensor:
        """Largest ``|K - mean|`` of each channel, FP32 ``[kv_heads, head_dim]``."""
        mu = self.k_channel_mean(layer)
        return torch.maximum(self.k_channel_max[layer] - mu, mu - self.k_channel_min[layer])  # type: ignore[operator]

    def k_first_amax(self, layer: int, smooth: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Largest ``|K_0 / lam|`` of each KV head over the observed first keys (uncentered),
        FP32 ``[kv_heads]``; ``smooth`` (``lam [kv_heads, head_dim]``, channel order as
        observed) or None."""
        top = torch.maximum(self.k_first_max[layer].abs(), self.k_first_min[layer].abs())  # type: ignore[union-attr]
        return (top if smooth is None else top / smooth).amax(dim=1)

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                positions: Optional[torch.Tensor] = None) -> None:
        """Fold in ``key``/``value [batch, kv_heads, seq, head_dim]`` of ``layer`` (each of the
        ``batch`` sequences from position 0, or from a shifted position inside
        :meth:`range_only`); ``positions`` (int64 ``[seq]``, the keys' positions) with
        ``rope``."""
        if self._range_only:  # the sink key at a shifted position is no served key
            key, value = key[:, :, 1:], value[:, :, 1:]
            if key.shape[2] == 0:
                return
        k32, v32 = key.detach().float(), value.detach().float()
        _check_finite(layer, K=k32, V=v32)
        stats = {"k_amax": (k32.abs().amax(dim=(0, 2, 3)), torch.maximum),  # [kv_heads]
                 "v_amax": (v32.abs().amax(dim=(0, 2, 3)), torch.maximum),
                 "k_channel_amax": (k32.abs().amax(dim=(0, 2)), torch.maximum),
                 "k_channel_max": (k32.amax(dim=(0, 2)), torch.maximum),
                 "k_channel_min": (k32.amin(dim=(0, 2)), torch.minimum)}
        if not self._range_only:  # each [kv_heads, head_dim]
            stats.update({"k_channel_sum": (k32.double().sum(dim=(0, 2)), torch.add),
                          "k_channel_sumsq": (k32.double().square().sum(dim=(0, 2)), torch.add),
                          "k_first_max": (k32[:, :, 0].amax(dim=0), torch.maximum),
                          "k_first_min": (k32[:, :, 0].amin(dim=0), torch.minimum)})
            if self.rope is not None:
                if positions is None:
                    raise ValueError("KVObserver with rope needs the keys' positions")
                pre = rope_unrotate(k32, positions, self.rope.inv_freq, self.rope.scaling)
                stats["k_pre_sum"] = (pre.double().sum(dim=(0, 2)), torch.add)
        for name, (val, fold) in stats.items():
            prev = getattr(self, name)[layer]
            getattr(self, name)[layer] = val.cpu() if prev is None else fold(prev, val.cpu())
        self._count(layer, key)


class RotRangeObserver(_Observer):
    """Per layer and KV head the amax (FP32 ``[kv_heads]``, :attr:`k_amax`) of the keys a
    rotating K center stores, ``K - mu' - R(p) b_k``, for the layers of ``centers`` (layer ->
    ``(mu' [kv_heads, head_dim], RotCenter)``); the second pass of the calibration once ``mu'``
    and ``b_k`` are fixed (docs/design/rotating_centering.md, section 2). Inside
    :meth:`range_only` the first key of each sequence is left out, as :class:`KVObserver`
    does."""

    wants_positions = True

    def __init__(self, num_layers: int, centers: Mapping[int, tuple[torch.Tensor, RotCenter]],
                 kv_layers: Optional[Sequence[int]] = None) -> None:
        super().__init__(num_layers, kv_layers)
        self.centers = dict(centers)
        self.k_amax: list[Optional[torch.Tensor]] = [None] * num_layers

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                positions: Optional[torch.Tensor] = None) -> None:
        """Fold in ``key [batch, kv_heads, seq, head_dim]`` of ``layer`` at ``positions``
        (int64 ``[seq]``); ``value`` is not used."""
        if positions is None:
            raise ValueError("RotRangeObserver needs the keys' positions")
        if self._range_only:
            key, positions = key[:, :, 1:], positions[1:]
            if key.shape[2] == 0:
                return
        if layer in self.centers:
            k32 = key.detach().float()
            _check_finite(layer, K=k32)
            mu, rot = self.centers[layer]
            off = rot_offset(rot.idx, rot.b, rot.theta, positions, k32.shape[-1]).transpose(0, 1)
            a = (k32 - mu.to(k32.device)[:, None, :] - off).abs().amax(dim=(0, 2, 3)).cpu()
            prev = self.k_amax[layer]
            self.k_amax[layer] = a if prev is None else torch.maximum(prev, a)
        self._count(layer, key)


# ---------------------------------------------------------------------------- per-layer state
@dataclass(frozen=True)
class LayerQuant:
    """One layer's formats, scales and K transforms as the hook stores them."""

    k_fmt: str
    v_fmt: str
    k_scale: ScaleArg
    v_scale: ScaleArg
    k_smooth: Optional[torch.Tensor] = None  # FP32 [kv_heads, head_dim]
    k_center: Optional[torch.Tensor] = None  # FP32 [kv_heads, head_dim]
    k_perm: Optional[torch.Tensor] = None  # int64 [kv_heads, head_dim]
    k_sink: Optional[torch.Tensor] = None  # bool [kv_heads]: position 0 stored uncentered
    k_rot: Optional[RotCenter] = None  # the rotating center (with k_center = mu')

    @property
    def transforms_k(self) -> bool:
        """Whether the cache stores K other than as computed (permuted, centered or smoothed)."""
        return self.k_smooth is not None or self.k_center is not None or self.k_perm is not None

    def rot_offset(self, positions: torch.Tensor, head_dim: int) -> Optional[torch.Tensor]:
        """``R(p) b_k`` FP32 ``[kv_heads, len(positions), head_dim]`` on the device of
        ``positions`` (int64 ``[seq]``); None without ``k_rot``."""
        rot = self.k_rot
        if rot is None:
            return None
        return rot_offset(rot.idx, rot.b, rot.theta, positions, head_dim).transpose(0, 1)


def rot_center_of(lp: Any) -> Optional[RotCenter]:
    """The policy row's ``k_rot`` as a CPU :class:`~vllm_nvfp4.kernels.launch.RotCenter` (None
    without it)."""
    k = lp.k_rot
    if k is None:
        return None
    return RotCenter(torch.tensor(k.pairs, dtype=torch.int32), torch.tensor(k.b, dtype=torch.float32),
                     torch.tensor(k.theta, dtype=torch.float32))


def _layer_quants(policy: KVPolicy) -> list[Optional[LayerQuant]]:
    """Per decoder layer, its formats and the scale its format uses (defaults where missing);
    None for a layer without KV cache."""
    out: list[Optional[LayerQuant]] = []
    for lp in policy.layers:
        if not lp.layer_type.holds_kv:
            out.append(None)
            continue
        scales = []
        for kv in ("k", "v"):
            s = lp.quant_scale(kv)
            if s is None:
                s = lp.format_of(kv).default_scale
            scales.append(s)
        smooth, center = (None if rows is None else torch.tensor(rows, dtype=torch.float32)
                          for rows in (lp.k_smooth, lp.k_center))
        perm = None if lp.k_perm is None else torch.tensor(lp.k_perm, dtype=torch.int64)
        sink = None if center is None else lp.sink_heads(center.shape[0])
        out.append(LayerQuant(lp.k, lp.v, scales[0], scales[1], smooth, center, perm,
                               None if sink is None else torch.tensor(sink), rot_center_of(lp)))
    return out


def with_uncentered_sink(stored: torch.Tensor, raw_key: torch.Tensor, fmt: str, scale: ScaleArg,
                         center: torch.Tensor, smooth: Optional[torch.Tensor],
                         perm: Optional[torch.Tensor], heads: torch.Tensor,
                         nonfinite: NonFinite = "propagate",
                         nvfp4_decoding: str = "exact") -> torch.Tensor:
    """``stored`` (the read-back of the centered keys ``[batch, kv_heads, seq, head_dim]``, seq
    from position 0) with position 0 of the KV heads ``heads`` (bool ``[kv_heads]``) as the
    serving cache holds it (policy ``k_sink_uncentered``): ``raw_key`` (the keys before the K
    transforms, same shape) at position 0 stored as ``K[perm] / lam`` in ``fmt`` with ``scale``,
    decoded in FP32, minus :func:`~vllm_nvfp4.key_transform.sink_shift`, cast to
    ``stored.dtype``. ``center``/``smooth``/``perm`` ``[kv_heads, head_dim]`` (permuted order)."""
    if stored.shape[-2] == 0:
        return stored
    dev = raw_key.device
    lam, p = (None if t is None else t.to(dev)[:, None, :] for t in (smooth, perm))
    first = fake_quantize(stored_keys(raw_key[..., :1, :], None, lam, p), fmt, scale, nonfinite,
                          nvfp4_decoding, dtype=torch.float32)
    shift = sink_shift(center.to(dev), None if smooth is None else smooth.to(dev))
    first = (first - shift[:, None, :]).to(stored.dtype)
    out = stored.clone()
    out[..., :1, :] = torch.where(heads.to(dev)[:, None, None], first, stored[..., :1, :])
    return out


def transform_qk(query: torch.Tensor, key: torch.Tensor, lam: Optional[torch.Tensor],
                 mu: Optional[torch.Tensor] = None, perm: Optional[torch.Tensor] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """K channel permutation, centering and smoothing as the integration does them: the cache
    gets ``(key[perm] - mu) / lam`` (:func:`vllm_nvfp4.key_transform.stored_keys`), the
    query ``query[perm] * lam`` (FP32, cast back). ``query [b, q_heads, s, d]``, ``key [b,
    kv_heads, s, d]``, ``lam`` and ``mu`` ``[kv_heads, d]`` (permuted order) and ``perm`` (int64)
    ``[kv_heads, d]`` or None (a query head uses the rows of its KV head). ``q . k`` moves by
    ``q . mu`` for every key of a query alike, so softmax does not change."""
    group = query.shape[1] // key.shape[1]
    if perm is not None:
        query = permute_channels(query, perm.repeat_interleave(group, dim=0)[:, None, :])
    if lam is not None:
        lam = lam.to(key.device)
        query = (query.float() * lam.repeat_interleave(group, dim=0)[:, None, :]).to(query.dtype)
    key = stored_keys(key, None if mu is None else mu.to(key.device)[:, None, :],
                      None if lam is None else lam[:, None, :],
                      None if perm is None else perm[:, None, :])
    return query, key


def stored_keys_read_back(quant: LayerQuant, query: torch.Tensor, key: torch.Tensor,
                          positions: Optional[torch.Tensor], nonfinite: NonFinite = "propagate",
                          nvfp4_decoding: str = "exact",
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's keys as the cache stores them and its readers see them: ``(query, key,
    read_back)`` with ``query [b, q_heads, s, d]`` as the kernels get it (permuted, smoothed),
    ``key`` after the K transforms (``(K[perm] - mu) / lam`` in ``key.dtype``, with ``k_rot`` minus
    ``R(p) b_k`` in FP32: what is quantized) and
    ``read_back`` its fake-quantized value plus ``R(p) b_k`` (``k_rot``), position 0 of the
    flagged heads stored uncentered (``k_sink``), in ``key.dtype``. ``key [b, kv_heads, s, d]``
    (the sequence from position 0 where ``k_sink`` is set); ``positions`` (int64 ``[s]``, the
    keys' positions) needed with ``k_rot`` only."""
    raw_key = key
    offset = None
    if quant.k_rot is not None:
        if positions is None:
            raise ValueError("a layer with k_rot needs the keys' positions")
        offset = quant.rot_offset(positions, key.shape[-1])
    if quant.transforms_k:
        query, key = transform_qk(query, key, quant.k_smooth, quant.k_center, quant.k_perm)
    if offset is not None:  # the writer subtracts R(p) b_k in FP32 from the centered key
        key = key.float() - offset.to(key.device)
    stored = fake_quantize(key, quant.k_fmt, quant.k_scale, nonfinite, nvfp4_decoding,
                           dtype=None if offset is None else torch.float32)
    if offset is not None:  # the readers add R(p) b_k back
        stored = (stored + offset.to(stored.device)).to(raw_key.dtype)
    if quant.k_sink is not None:
        stored = with_uncentered_sink(stored, raw_key, quant.k_fmt, quant.k_scale, quant.k_center,
                                      quant.k_smooth, quant.k_perm, quant.k_sink, nonfinite,
                                      nvfp4_decoding)
    return query, key, stored


class KVOption:
    """A change of what the hooked attention stores beyond the policy, for accuracy studies (the
    options in the repository's ``studies/kv_options.py``: rotations, per-head formats, sink-key
    stores the cache does not serve). Each hook point's default leaves its tensors as they are;
    transformers' layout throughout (``[batch, heads, seq, head_dim]``, the sequence from
    position 0)."""

    def bind(self, policy: Optional[KVPolicy], num_kv_heads: int) -> "KVOption":
        """The option as it runs with ``policy`` (checked against it: a clear error where it does
        not fit); default: itself."""
        return self

    @property
    def first_layer(self) -> Optional[int]:
        """The lowest layer the option changes, for an option set per measurement (the
        :class:`~vllm_nvfp4.calibration.evaluator.Evaluator` resumes there); None: it stays the
        same for the baseline and every measurement."""
        return None

    def inputs(self, layer: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value of ``layer`` before observation and quantization."""
        return query, key, value

    def output(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """The attention output ``[batch, seq, heads, head_dim]`` of ``layer``."""
        return out

    def stored_key(self, layer: int, stored: torch.Tensor, key: torch.Tensor, raw_key: torch.Tensor,
                   quant: "LayerQuant", nonfinite: NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        """The keys ``layer`` attends: ``stored`` (the cache's read-back of ``key``, the keys
        after the policy's K transforms; ``raw_key`` before them)."""
        return stored

    def stored_value(self, layer: int, stored: torch.Tensor, value: torch.Tensor,
                     quant: "LayerQuant", nonfinite: NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        """The values ``layer`` attends: ``stored`` (the cache's read-back of ``value``)."""
        return stored


@dataclass
class _HookState:
    base: str
    quants: Optional[list[LayerQuant]]
    observer: Optional[_Observer]
    nonfinite: NonFinite
    nvfp4_decoding: str = "exact"
    options: tuple[KVOption, ...] = ()
    calls: int = 0


# Active states, keyed by id() of the attention modules' config object (shared by a model's layers).
_ACTIVE: dict[int, _HookState] = {}
_LOCK = threading.Lock()


def _make_wrapper(base_name: str) -> Callable[..., Any]:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Any:
        state = _ACTIVE.get(id(module.config))
        if state is None:
            return _attend(base_name, module, query, key, value, attention_mask, **kwargs)
        layer = module.layer_idx
        state.calls += 1
        for opt in state.options:
            query, key, value = opt.inputs(layer, query, key, value)
        lq = None if state.quants is None else state.quants[layer]
        positions = None
        if (state.observer is not None and state.observer.wants_positions) or (
                lq is not None and lq.k_rot is not None):
            positions = key_positions(kwargs.get("position_ids"), key.shape[-2], key.device)
        if state.observer is not None:
            if state.observer.wants_positions:
                state.observer.observe(layer, key, value, positions=positions)
            else:
                state.observer.observe(layer, key, value)
        if lq is not None:
            raw_key = key
            query, key, stored = stored_keys_read_back(lq, query, key, positions, state.nonfinite,
                                                       state.nvfp4_decoding)
            stored_v = fake_quantize(value, lq.v_fmt, lq.v_scale, state.nonfinite,
                                     state.nvfp4_decoding)
            for opt in state.options:
                stored = opt.stored_key(layer, stored, key, raw_key, lq, state.nonfinite,
                                        state.nvfp4_decoding)
                stored_v = opt.stored_value(layer, stored_v, value, lq, state.nonfinite,
                                            state.nvfp4_decoding)
            key, value = stored.to(query.dtype), stored_v.to(query.dtype)
        out, weights = _attend(base_name, module, query, key, value, attention_mask, **kwargs)
        for opt in reversed(state.options):
            out = opt.output(layer, out)
        return out, weights

    attention.__name__ = f"vllm_nvfp4_kv_{base_name}"
    return attention


def _attend(base_name: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor, attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Any:
    """The base attention implementation ``base_name``; returns ``(output, weights)``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base_name == "eager":  # not in the registry: every model ships its own (sinks, soft-cap)
        return _model_eager(module)(module, query, key, value, attention_mask, **kwargs)
    return ALL_ATTENTION_FUNCTIONS[base_name](module, query, key, value, attention_mask, **kwargs)


def _model_eager(module: torch.nn.Module) -> Callable[..., Any]:
    """The ``eager_attention_forward`` of the module's own modeling file (gpt-oss's adds its
    sinks, Gemma's its soft-cap), else Llama's generic one."""
    import sys

    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is not None:
        return own
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def register_hooks() -> None:
    """Register the wrapped attention (and matching mask) functions with transformers; idempotent."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    with _LOCK:
        for base in _BASE_IMPLEMENTATIONS:
            name = HOOK_PREFIX + base
            if name in AttentionInterface._global_mapping:
                continue
            AttentionInterface.register(name, _make_wrapper(base))
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])


def _set_impl(model: torch.nn.Module, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    if text_config(model)._attn_implementation != name:  # older / unusual models
        text_config(model)._attn_implementation_internal = name


@contextlib.contextmanager
def kv_cache_quantization(
    model: torch.nn.Module,
    policy: Optional[KVPolicy] = None,
    observer: Optional[_Observer] = None,
    nonfinite: NonFinite = "propagate",
    nvfp4_decoding: str = "exact",
    options: Sequence[KVOption] = (),
) -> Iterator[_HookState]:
    """Within the block, ``model`` runs with K/V fake-quantized per ``policy`` and/or observed.

    ``policy=None`` leaves K/V untouched (pure observation or a BF16 reference).
    ``nvfp4_decoding``: how NVFP4 layers are read back (:data:`NVFP4_DECODINGS`). ``options``:
    study changes beyond the policy (:class:`KVOption`), applied in order (outputs in reverse). Raises
    :class:`~vllm_nvfp4.policy.PolicyError` if the policy does not fit the model and
    ``RuntimeError`` for models it cannot hook. Yields the hook state (``.calls`` counts the
    attention calls that went through the hook, a check that the model is supported).
    """
    mods = attention_modules(model)
    if not mods:
        raise RuntimeError(
            f"{type(model).__name__}: found no attention modules with layer_idx/k_proj; "
            "only Llama/Qwen2/Mistral-style transformers models are supported"
        )
    cfg = text_config(model)
    types = model_layer_types(model)
    num_layers = len(types)
    if policy is not None:
        policy.check_model(num_layers, getattr(cfg, "num_key_value_heads", None), layer_types=types)
    if observer is not None and observer.num_layers != num_layers:
        raise ValueError(f"observer is for {observer.num_layers} layers, the model has {num_layers}")
    base = cfg._attn_implementation or "sdpa"
    if base.startswith(HOOK_PREFIX):
        raise RuntimeError("kv_cache_quantization blocks cannot be nested on the same model")
    if base not in _BASE_IMPLEMENTATIONS:
        raise RuntimeError(f"attention implementation {base!r} is not supported; load with sdpa or eager")
    _check_decoding(nvfp4_decoding)
    bound = tuple(opt.bind(policy, cfg.num_key_value_heads) for opt in options)
    register_hooks()
    state = _HookState(base, _layer_quants(policy) if policy is not None else None, observer,
                       nonfinite, nvfp4_decoding, bound)
    keys = {id(m.config) for m in mods}
    with _LOCK:
        if any(k in _ACTIVE for k in keys):
            raise RuntimeError("this model already runs inside kv_cache_quantization")
        for k in keys:
            _ACTIVE[k] = state
    try:
        _set_impl(model, HOOK_PREFIX + base)
        yield state
    finally:
        _set_impl(model, base)
        with _LOCK:
            for k in keys:
                _ACTIVE.pop(k, None)

