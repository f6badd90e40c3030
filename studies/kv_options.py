"""Study-only options of the reference path: what the fake-quantized cache of
:mod:`vllm_nvfp4.calibration.kv_hooks` can store beyond what the serving cache stores.

Each is a :class:`~vllm_nvfp4.calibration.kv_hooks.KVOption`, passed to
``kv_cache_quantization(..., options=[...])`` or set on an
:class:`~vllm_nvfp4.calibration.evaluator.Evaluator` (``options``):

* :class:`KVRotation` - chosen layers' K and/or V stored rotated along head_dim
  (:mod:`studies.rotation`; the query rotated alike, the output rotated back);
* :class:`KeySink` - the first keys of every sequence stored another way in NVFP4-K layers (FP8,
  unquantized, or NVFP4 before K centering for more than the one key the policy's
  ``k_sink_uncentered`` serves);
* :class:`HeadFormats` - single KV heads of a K or V slot in the other format (the paged cache
  holds one format per slot);
* :class:`RotatingCenter` - K centered on a position-dependent offset ``R(p) b`` (the pre-RoPE
  key mean rotated to each key's position) instead of the policy's constant ``mu``; with
  :func:`hybrid_offsets`, ``R(p) b`` on a few RoPE pairs and a constant offset on the others;
* :class:`ValueCenter` - V stored minus a per-head mean value, the mean added back after decoding.
* :class:`ValueSink` - the first values of every sequence stored in FP8 or unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from vllm_nvfp4.calibration.kv_hooks import KVOption, LayerQuant, ScaleArg, fake_quantize
from vllm_nvfp4.calibration.rope import rope_rotate, rope_unrotate  # noqa: F401 (the studies import them here)
from vllm_nvfp4.formats import E2M1_MAX, KVFormat, NonFinite, check_kv_format
from vllm_nvfp4.key_transform import stored_keys
from vllm_nvfp4.policy import KVPolicy
from studies.rotation import rotate, rotation_matrix, unrotate


@dataclass(frozen=True)
class KVRotation(KVOption):
    """Which layers' K and V the cache stores rotated (:mod:`studies.rotation`, ``kind``).

    A rotated K also rotates the query (``q . k`` unchanged); a rotated V rotates the attention
    output back. Rotation comes first: observation, K centering/smoothing and quantization all
    see the rotated vectors (centering commutes with it: ``R k - R mu = R (k - mu)``)."""

    kind: str
    k_layers: frozenset[int]
    v_layers: frozenset[int]

    @classmethod
    def every_layer(cls, kind: str, num_layers: int, k: bool = True, v: bool = True) -> "KVRotation":
        """``kind`` on K (``k``) and/or V (``v``) of every layer."""
        layers = frozenset(range(num_layers))
        return cls(kind, layers if k else frozenset(), layers if v else frozenset())

    def inputs(self, layer: int, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        matrix = rotation_matrix(self.kind, key.shape[-1])
        if layer in self.k_layers:
            query, key = rotate(query, matrix), rotate(key, matrix)
        if layer in self.v_layers:
            value = rotate(value, matrix)
        return query, key, value

    def output(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        if layer not in self.v_layers:
            return out
        return unrotate(out, rotation_matrix(self.kind, out.shape[-1]))


def fp8_at_nvfp4_range(x: torch.Tensor, nvfp4_scale: ScaleArg, nonfinite: NonFinite) -> torch.Tensor:
    """``x [..., kv_heads, seq, head_dim]`` through FP8 at the slot's NVFP4 global scale x 6
    (amax/448 where the global scale is amax/2688): a sink copy covering the NVFP4 range."""
    return fake_quantize(x, "fp8", torch.as_tensor(nvfp4_scale, dtype=torch.float32) * E2M1_MAX,
                         nonfinite)


#: how :class:`KeySink` stores the sink keys: FP8 at 6x the NVFP4 global scale, unquantized, or NVFP4
#: of the key before K centering (the center subtracted after decoding)
KEY_SINK_STORES = ("fp8", "exact", "uncentered")


@dataclass(frozen=True)
class KeySink(KVOption):
    """The first ``tokens`` keys of every sequence stored another way (``store``, one of
    :data:`KEY_SINK_STORES`) in the layers whose K is NVFP4. ``fp8`` uses the layer's NVFP4 global
    scale x 6 (amax/448 where the global scale is amax/2688); ``uncentered`` quantizes
    ``K / lam`` to NVFP4 with the layer's global scale and subtracts ``mu / lam`` after decoding,
    which stores no extra bytes (K centering, :mod:`vllm_nvfp4.key_transform`, makes the sink
    key, small before centering, one of the largest after it; the policy's
    ``k_sink_uncentered`` serves it for the first key). ``layers``: the decoder layers it
    applies to (None: every NVFP4-K layer)."""

    tokens: int
    store: str = "fp8"
    layers: Optional[frozenset[int]] = None

    def covers(self, layer: int) -> bool:
        """Whether the sink applies to decoder layer ``layer`` (its K must be NVFP4 as well)."""
        return self.layers is None or layer in self.layers

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"KeySink needs tokens >= 1, got {self.tokens}")
        if self.store not in KEY_SINK_STORES:
            raise ValueError(f"KeySink store must be one of {', '.join(KEY_SINK_STORES)}, got {self.store!r}")

    def stored_key(self, layer: int, stored: torch.Tensor, key: torch.Tensor, raw_key: torch.Tensor,
                   quant: LayerQuant, nonfinite: NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        if quant.k_fmt != KVFormat.NVFP4 or not self.covers(layer):
            return stored
        return self.apply(stored, raw_key, quant, nonfinite)

    def apply(self, stored: torch.Tensor, raw_key: torch.Tensor, quant: LayerQuant,
              nonfinite: NonFinite) -> torch.Tensor:
        """``stored`` (the NVFP4 read-back of the transformed keys, ``[batch, kv_heads, seq,
        head_dim]``) with its first ``tokens`` positions stored as ``store`` says; ``raw_key``:
        the keys before K centering and smoothing, same shape."""
        n = min(self.tokens, raw_key.shape[-2])
        raw = raw_key[..., :n, :]
        mu, lam, perm = (None if t is None else t.to(raw.device)[:, None, :]
                         for t in (quant.k_center, quant.k_smooth, quant.k_perm))
        if self.store == "uncentered":
            head = fake_quantize(stored_keys(raw, None, lam, perm), "nvfp4", quant.k_scale,
                                 nonfinite).float()
            if mu is not None:
                head = head - (mu if lam is None else mu / lam)
        else:
            head = stored_keys(raw, mu, lam, perm)
            if self.store == "fp8":
                head = fp8_at_nvfp4_range(head, quant.k_scale, nonfinite)
        out = stored.clone()
        out[..., :n, :] = head.to(out.dtype)
        return out


#: one overridden KV head: its index, its format and the scale of that format
HeadOverride = tuple[int, KVFormat, ScaleArg]


@dataclass(frozen=True)
class HeadFormats(KVOption):
    """Single KV heads stored in another format than their slot's: ``heads[(layer, "k" or
    "v")][head]`` is ``"fp8"`` or ``"nvfp4"``; every other head keeps the policy's format. A head's
    scale is its layer's for that format (the policy keeps an FP8 scale and an NVFP4 global scale
    per slot, :func:`~vllm_nvfp4.calibration.sensitivity.all_format`; missing: the format's
    default). Set per measurement (:attr:`first_layer`); needs a policy."""

    heads: Mapping[tuple[int, str], Mapping[int, str]]

    def __post_init__(self) -> None:
        for (layer, kv), per_head in self.heads.items():
            if kv not in ("k", "v") or not isinstance(layer, int) or layer < 0:
                raise ValueError(f"HeadFormats key must be (layer >= 0, 'k' or 'v'), got {(layer, kv)!r}")
            for head, fmt in per_head.items():
                check_kv_format(fmt)
                if not isinstance(head, int) or head < 0:
                    raise ValueError(f"HeadFormats: layer {layer} {kv}: head must be an int >= 0, got {head!r}")

    @property
    def first_layer(self) -> Optional[int]:
        """The lowest layer with an overridden head (None: none)."""
        return min((layer for (layer, _), per_head in self.heads.items() if per_head), default=None)

    def bind(self, policy: Optional[KVPolicy], num_kv_heads: int) -> "KVOption":
        if policy is None:
            raise ValueError("head_formats needs a policy (the formats and scales of the other heads)")
        return _BoundHeadFormats(self.overrides(policy, num_kv_heads))

    def overrides(self, policy: KVPolicy, num_kv_heads: int) -> dict[tuple[int, str], list[HeadOverride]]:
        """``{(layer, kv): [(head, format, that head's scale)]}`` resolved against ``policy``."""
        out: dict[tuple[int, str], list[HeadOverride]] = {}
        for (layer, kv), per_head in self.heads.items():
            if layer >= policy.num_layers:
                raise ValueError(f"HeadFormats: layer {layer}: the policy has {policy.num_layers} layers")
            lp = policy.layers[layer]
            if not lp.layer_type.holds_kv:
                raise ValueError(f"HeadFormats: layer {layer} has no KV cache")
            if kv == "k" and lp.k_rot is not None:
                raise ValueError(f"HeadFormats: layer {layer} K has a rotating center (k_rot), "
                                 "whose offset the re-quantized heads would lose")
            for head, fmt in sorted(per_head.items()):
                if head >= num_kv_heads:
                    raise ValueError(f"HeadFormats: layer {layer} {kv} head {head}: the model has "
                                     f"{num_kv_heads} KV heads")
                fmt = check_kv_format(fmt)
                scale = getattr(lp, f"{kv}_scale" if fmt is KVFormat.FP8 else f"{kv}_global_scale")
                scale = fmt.default_scale if scale is None else scale
                if isinstance(scale, (tuple, list)):
                    scale = scale[head]
                out.setdefault((layer, kv), []).append((head, fmt, scale))
        return out


@dataclass(frozen=True)
class _BoundHeadFormats(KVOption):
    """:class:`HeadFormats` resolved against a policy: the overridden heads re-quantized from the
    tensor before quantization (K after the policy's K transforms) in their own format."""

    overrides: Mapping[tuple[int, str], list[HeadOverride]]

    def _requantize(self, layer: int, kv: str, stored: torch.Tensor, x: torch.Tensor,
                    nonfinite: NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        heads = self.overrides.get((layer, kv))
        if not heads:
            return stored
        out = stored.clone()
        for head, fmt, scale in heads:
            out[:, head:head + 1] = fake_quantize(x[:, head:head + 1], fmt, scale, nonfinite,
                                                  nvfp4_decoding).to(out.dtype)
        return out

    def stored_key(self, layer: int, stored: torch.Tensor, key: torch.Tensor, raw_key: torch.Tensor,
                   quant: LayerQuant, nonfinite: NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        return self._requantize(layer, "k", stored, key, nonfinite, nvfp4_decoding)

    def stored_value(self, layer: int, stored: torch.Tensor, value: torch.Tensor,
                     quant: LayerQuant, nonfinite: NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        return self._requantize(layer, "v", stored, value, nonfinite, nvfp4_decoding)


# ---------------------------------------------------------------------------- rotating K centering
def rope_frequencies(model: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] FP32, attention_scaling)`` of a Llama-style model's RoPE
    (``model.model.rotary_emb``)."""
    emb = model.model.rotary_emb
    return emb.inv_freq.detach().float().cpu(), float(getattr(emb, "attention_scaling", 1.0))


def hybrid_offsets(b: torch.Tensor, mu: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b', mu')`` for :class:`RotatingCenter` (``offsets``, ``constant``) that rotate ``b
    [kv_heads, head_dim]`` only on each head's ``pairs`` RoPE pairs ``(i, i + head_dim/2)`` of
    largest ``|b_pair|`` and keep the constant post-RoPE offset ``mu`` on the others (``b'`` is 0
    where ``mu'`` is not). ``pairs = head_dim/2``: ``(b, 0)``; ``0``: ``(0, mu)``."""
    half = b.shape[-1] // 2
    if not 0 <= pairs <= half:
        raise ValueError(f"pairs={pairs}: a head of dimension {b.shape[-1]} has {half} RoPE pairs")
    norm = b.float().view(*b.shape[:-1], 2, half).norm(dim=-2)  # [kv_heads, half]
    keep = torch.zeros_like(norm, dtype=torch.bool)
    keep.scatter_(-1, norm.topk(pairs, dim=-1).indices, True)
    keep = torch.cat([keep, keep], dim=-1)
    return torch.where(keep, b.float(), 0.0), torch.where(keep, 0.0, mu.float())


@dataclass(frozen=True)
class RotatingCenter(KVOption):
    """K centered on ``R(p) b`` in the layers of ``offsets``: ``b [kv_heads, head_dim]`` is the
    mean pre-RoPE key, ``R(p)`` the model's RoPE at the key's position ``p`` (the sequence index:
    every sequence from position 0). The cache stores ``K - R(p) b`` in the layer's K format and
    scale, and the attention reads ``dequant + R(p) b`` (what a kernel would attend that
    subtracts the offset when writing and adds ``q . R(p) b`` per key). ``sink[layer]`` (bool
    ``[kv_heads]``): heads whose key at position 0 is stored uncentered (quantized as computed).
    Those layers must carry no policy K transform (the option replaces the centering: :meth:`bind`
    checks it)."""

    inv_freq: torch.Tensor
    scaling: float
    offsets: Mapping[int, torch.Tensor]
    sink: Mapping[int, torch.Tensor]
    #: per layer a constant post-RoPE offset ``[kv_heads, head_dim]`` added to ``R(p) b`` (the
    #: hybrid of :func:`hybrid_offsets`: nonzero only on the pairs where ``b`` is 0)
    constant: Mapping[int, torch.Tensor] = field(default_factory=dict)

    def bind(self, policy: Optional[KVPolicy], num_kv_heads: int) -> "RotatingCenter":
        if policy is None:
            raise ValueError("RotatingCenter needs a policy (it stores keys in its K formats)")
        for layer, b in self.offsets.items():
            lp = policy.layers[layer]
            if lp.k_center is not None or lp.k_smooth is not None or lp.k_perm is not None:
                raise ValueError(f"layer {layer}: RotatingCenter replaces the K centering; the "
                                 "policy must not center, smooth or permute its K")
            if b.shape[0] != num_kv_heads:
                raise ValueError(f"layer {layer}: offsets for {b.shape[0]} KV heads, the model has {num_kv_heads}")
        return self

    def rotated_offset(self, layer: int, seq: int, device: torch.device) -> torch.Tensor:
        """``R(p) b`` (plus the layer's ``constant``) of ``layer`` for ``p = 0 .. seq-1``: FP32
        ``[kv_heads, seq, head_dim]``."""
        b = self.offsets[layer].float().to(device)
        pos = torch.arange(seq, device=device)
        off = rope_rotate(b[:, None, :].expand(-1, seq, -1), pos, self.inv_freq.to(device), self.scaling)
        c = self.constant.get(layer)
        return off if c is None else off + c.float().to(device)[:, None, :]

    def stored_key(self, layer: int, stored: torch.Tensor, key: torch.Tensor, raw_key: torch.Tensor,
                   quant: LayerQuant, nonfinite: NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        if layer not in self.offsets:
            return stored
        off = self.rotated_offset(layer, raw_key.shape[-2], raw_key.device)
        centered = (raw_key.float() - off).to(raw_key.dtype)
        out = fake_quantize(centered, quant.k_fmt, quant.k_scale, nonfinite, nvfp4_decoding,
                            dtype=torch.float32) + off
        heads = self.sink.get(layer)
        if heads is not None and bool(heads.any()) and raw_key.shape[-2]:
            first = fake_quantize(raw_key[..., :1, :], quant.k_fmt, quant.k_scale, nonfinite,
                                  nvfp4_decoding, dtype=torch.float32)
            out[..., :1, :] = torch.where(heads.to(out.device)[:, None, None], first, out[..., :1, :])
        return out.to(stored.dtype)


@dataclass(frozen=True)
class ValueCenter(KVOption):
    """V stored as ``V - nu`` in the layers whose V is NVFP4 (``nu``: per decoder layer, FP32
    ``[kv_heads, head_dim]``, e.g. the calibration window's mean value), ``nu`` added back after
    decoding. Without attention sinks the softmax weights sum to 1, so this equals adding ``nu``
    to the attention output: no bytes stored. Quantized with the policy's V global scale.
    ``first_uncentered``: the value at position 0 (the attention sink's, small and heavily
    attended) stored as it is."""

    means: Mapping[int, torch.Tensor] = field(default_factory=dict)
    first_uncentered: bool = False

    def stored_value(self, layer: int, stored: torch.Tensor, value: torch.Tensor,
                     quant: LayerQuant, nonfinite: NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        if quant.v_fmt != KVFormat.NVFP4 or layer not in self.means:
            return stored
        nu = self.means[layer].to(value.device)[:, None, :]  # [kv_heads, 1, D]
        centered = (value.float() - nu).to(value.dtype)
        out = fake_quantize(centered, "nvfp4", quant.v_scale, nonfinite, nvfp4_decoding).float() + nu
        if self.first_uncentered:
            out[..., :1, :] = stored[..., :1, :]
        return out


@dataclass(frozen=True)
class ValueSink(KVOption):
    """The first ``tokens`` values of every sequence stored ``store`` (``fp8``:
    :func:`fp8_at_nvfp4_range`, as :class:`KeySink`; ``exact``: unquantized) in the layers whose V
    is NVFP4: what an FP8 sink slot holding the value beside the key would add."""

    tokens: int
    store: str = "fp8"

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.store not in ("fp8", "exact"):
            raise ValueError(f"ValueSink needs tokens >= 1 and store fp8 or exact, got "
                             f"{self.tokens}, {self.store!r}")

    def stored_value(self, layer: int, stored: torch.Tensor, value: torch.Tensor,
                     quant: LayerQuant, nonfinite: NonFinite, nvfp4_decoding: str) -> torch.Tensor:
        if quant.v_fmt != KVFormat.NVFP4:
            return stored
        head = value[..., :self.tokens, :]
        if self.store == "fp8":
            head = fp8_at_nvfp4_range(head, quant.v_scale, nonfinite)
        out = stored.clone()
        out[..., :self.tokens, :] = head.to(out.dtype)
        return out
