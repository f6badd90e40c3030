""":class:`KVPolicy`: the per-layer policy of a whole model, its two forms, model checks, summary.

Rows and layer numbering: one row per *decoder layer*, numbered as vLLM's layer names
(``model.layers.7.self_attn.attn`` is row 7) and ModelOpt's ``kv_cache_quantized_layers`` number
them, in calibrate, analyze, select and serve alike. Both forms round-trip: the versioned JSON
(:mod:`~vllm_nvfp4.policy.json_form`) and the compact string of formats
(:mod:`~vllm_nvfp4.policy.compact`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from vllm_nvfp4.formats import KVFormat, bytes_per_head
from vllm_nvfp4.policy.compact import format_compact, parse_compact
from vllm_nvfp4.policy.errors import PolicyError
from vllm_nvfp4.policy.json_form import layers_from_dict, policy_to_dict, read_policy_file, write_policy_file
from vllm_nvfp4.policy.layer_policy import (CHANNEL_FIELDS, HEAD_FLAG_FIELDS, SCALE_FIELDS,
                                             LayerPolicy, Scale)
from vllm_nvfp4.policy.layer_types import FULL_ATTENTION, LayerType, check_layer_count, format_types


@dataclass(frozen=True)
class KVPolicy:
    """The per-layer policy of a whole model (index = decoder layer order in the model)."""

    layers: tuple[LayerPolicy, ...]
    provenance: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    def __post_init__(self) -> None:
        if not self.layers:
            raise PolicyError("a policy needs at least one layer")

    @property
    def num_layers(self) -> int:
        """Decoder layers (rows), KV-holding or not."""
        return len(self.layers)

    @property
    def layer_types(self) -> tuple[LayerType, ...]:
        return tuple(lp.layer_type for lp in self.layers)

    def kv_layers(self) -> list[tuple[int, LayerPolicy]]:
        """``(index, row)`` of every layer that holds a KV cache, in layer order."""
        return [(i, lp) for i, lp in enumerate(self.layers) if lp.layer_type.holds_kv]

    # ------------------------------------------------------------------ the two forms
    @classmethod
    def from_compact(cls, text: str, num_layers: int, source: str = "<string>",
                     layer_types: Optional[Sequence[LayerType]] = None) -> "KVPolicy":
        """Parse ``0-1:fp8,2-27:nvfp4`` / ``swa:fp8,full:nvfp4`` style text for a model of
        ``num_layers`` decoder layers of ``layer_types`` (default: all full attention)."""
        if num_layers <= 0:
            raise PolicyError(f"num_layers must be positive, got {num_layers}")
        types = tuple(layer_types) if layer_types is not None else (FULL_ATTENTION,) * num_layers
        check_layer_count(types, num_layers)
        return cls(layers=parse_compact(text, types), source=source)

    def to_compact(self) -> str:
        """The formats as a compact string of index ranges (no scales, no types)."""
        return format_compact(self.layers)

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "KVPolicy":
        """Build from the parsed JSON object; every malformation raises :class:`PolicyError`."""
        layers, provenance = layers_from_dict(data, source)
        return cls(layers=layers, provenance=provenance, source=source)

    def to_dict(self) -> dict[str, Any]:
        return policy_to_dict(self.layers, self.provenance)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "KVPolicy":
        """Read a JSON policy file."""
        p = Path(path)
        return cls.from_dict(read_policy_file(p), source=str(p))

    def save(self, path: Union[str, Path], overwrite: bool = False) -> Path:
        """Write as JSON (one line per vector); refuses to replace an existing file unless
        ``overwrite``."""
        return write_policy_file(path, self.to_dict(), overwrite)

    # ------------------------------------------------------------------ model checks and summary
    def check_model(self, num_layers: int, num_kv_heads: Optional[int] = None,
                    head_dim: Optional[int] = None,
                    layer_types: Optional[Sequence[LayerType]] = None) -> None:
        """Raise :class:`PolicyError` unless the policy fits a model of this shape and, if given,
        these per-layer types (window and sinks included)."""
        if head_dim is not None:
            for i, lp in enumerate(self.layers):
                for name in CHANNEL_FIELDS:
                    val = getattr(lp, name)
                    if val is not None and len(val[0]) != head_dim:
                        raise PolicyError(
                            f"policy {self.source}: layer {i} {name} has {len(val[0])} values "
                            f"per head, the model's head_dim is {head_dim}; recalibrate")
        if num_layers != self.num_layers:
            raise PolicyError(
                f"policy {self.source} describes {self.num_layers} attention layers, but the "
                f"model has {num_layers}; calibrate for this model or fix the policy"
            )
        if layer_types is not None:
            check_layer_count(layer_types, num_layers)
            wrong = [i for i, (a, b) in enumerate(zip(self.layer_types, layer_types)) if a != b]
            if wrong:
                i = wrong[0]
                raise PolicyError(
                    f"policy {self.source} does not match the model's layer types: layer {i} is "
                    f"{self.layers[i].layer_type.label()} in the policy but "
                    f"{layer_types[i].label()} in the model ({len(wrong)} layers differ; the "
                    f"model's layers: {format_types(layer_types)}); calibrate for this model or "
                    "fix the policy")
        if num_kv_heads is None:
            return
        for i, lp in enumerate(self.layers):
            for name in (*SCALE_FIELDS, *CHANNEL_FIELDS, *HEAD_FLAG_FIELDS):
                val = getattr(lp, name)
                if isinstance(val, tuple) and len(val) != num_kv_heads:
                    raise PolicyError(
                        f"policy {self.source}: layer {i} {name} has {len(val)} per-head values, "
                        f"the model has {num_kv_heads} KV heads"
                    )

    def with_layer(self, index: int, **changes: Any) -> "KVPolicy":
        """A copy with layer ``index`` changed (formats and/or scales)."""
        layers = list(self.layers)
        layers[index] = replace(layers[index], **changes)
        return replace(self, layers=tuple(layers))

    def kv_bytes_per_token(self, num_kv_heads: int, head_dim: int, kinds: Sequence[str] = ("full", "sliding")) -> int:
        """Cache bytes one token occupies across the KV layers of ``kinds`` (K + V, scales
        included); ``kinds=("full",)``: the layers whose cache grows with the context."""
        return sum(
            num_kv_heads * (bytes_per_head(lp.k, head_dim) + bytes_per_head(lp.v, head_dim))
            for _, lp in self.kv_layers() if lp.layer_type.kind in kinds
        )

    def fraction_of_fp8(self) -> float:
        """KV bytes relative to an all-FP8 cache over the KV layers (head_dim independent); for a
        model with full-attention layers, over those (the cache that grows with the context;
        sliding layers hold at most a window)."""
        rows = [lp for _, lp in self.kv_layers()]
        growing = [lp for lp in rows if lp.layer_type.kind == "full"] or rows
        total = sum(lp.k.bytes_per_element + lp.v.bytes_per_element for lp in growing)
        return total / (2 * len(growing) * KVFormat.FP8.bytes_per_element)

    def describe(self, title: str = "KV policy") -> str:
        """A multi-line table of the policy, for logs and reports: the line ``TITLE: COMPACT
        (X FP8 bytes; SCALES; from SOURCE)`` (``SCALES`` says whether the K/V scales are
        calibrated: :meth:`scales_summary`), then one row per layer (formats, scales, K
        transforms)."""
        lines = [f"{title}: {self.to_compact()} ({self.fraction_of_fp8():.3f}x FP8 bytes; "
                 f"{self.scales_summary()}; from {self.source})"]
        typed = any(t != FULL_ATTENTION for t in self.layer_types)  # dense: no type column
        for i, lp in enumerate(self.layers):
            kind = f"{lp.layer_type.label():18s} " if typed else ""
            if not lp.layer_type.holds_kv:
                lines.append(f"  layer {i:3d}: {kind}(no KV cache)")
                continue
            ks, vs = lp.quant_scale("k"), lp.quant_scale("v")
            extra = (("  K centered" if lp.k_center else "") + ("  K smoothed" if lp.k_smooth else "")
                     + ("  K permuted" if lp.k_perm else ""))
            lines.append(f"  layer {i:3d}: {kind}K {lp.k:5s} scale {_fmt_scale(ks)}  V {lp.v:5s} "
                         f"scale {_fmt_scale(vs)}{extra}")
        return "\n".join(lines)

    def scales_summary(self) -> str:
        """Whether the K/V slots carry scales: ``K/V scales calibrated`` (every slot has one),
        ``default K/V scales (not calibrated)`` (none has) or ``N of M K/V scales default (not
        calibrated)``. Default scales: FP8 1.0, NVFP4 global 1/6."""
        slots = [lp.quant_scale(kv) for _, lp in self.kv_layers() for kv in ("k", "v")]
        missing = sum(s is None for s in slots)
        if not missing:
            return "K/V scales calibrated"
        if missing == len(slots):
            return "default K/V scales (not calibrated)"
        return f"{missing} of {len(slots)} K/V scales default (not calibrated)"


def _fmt_scale(s: Optional[Scale]) -> str:
    if s is None:
        return "default"
    if isinstance(s, tuple):
        return f"per-head[{len(s)}] max {max(s):.4g}"
    return f"{s:.4g}"
