"""Per-layer KV precision policy: which format each attention layer stores K and V in, plus scales.

Two forms, both round-trip:

Rows and layer numbering: one row per *decoder layer*, numbered as vLLM's layer names
(``model.layers.7.self_attn.attn`` is row 7) and ModelOpt's ``kv_cache_quantized_layers`` number
them, in calibrate, analyze, select and serve alike. Each row has a :class:`LayerType`:

* ``full``    - full (global) attention: its cache grows with the context;
* ``sliding`` - sliding-window (local) attention with its ``window`` (tokens attended, the
  current one included): vLLM frees its blocks outside the window;
* either of them with ``sinks`` - gpt-oss's learned per-head logit in the softmax denominator;
* ``none``    - no KV cache (linear attention, Mamba, Gated DeltaNet): the state is vLLM's own,
  the row carries no formats and no scales.

The types come from the model's config (:func:`layer_types_from_config`); a policy whose types do
not match the model's is refused (:meth:`KVPolicy.check_model`).

* JSON file (versioned)::

    {"format": "vllm-nvfp4-policy", "version": 1, "num_layers": 30,
     "layers": [{"index": 0, "type": "sliding", "window": 512, "k": "fp8", "v": "fp8",
                 "k_scale": 0.02, "v_scale": 0.01,            # FP8 scales (amax / 448)
                 "k_global_scale": 0.003, "v_global_scale": 0.001},  # NVFP4 (amax / 2688)
                {"index": 1, "type": "none"},                  # e.g. a Gated DeltaNet layer
                ...],
     "provenance": {...free-form: tool version, model hash, data, metrics...}}

  ``"type"`` may be left out for full attention (policies of dense models written before the
  types existed read unchanged); ``"sinks": true`` marks a layer with attention sinks.

  Each scale is optional, a positive finite number or a per-KV-head list of them.
  Optional ``"k_smooth"``: per KV head, ``head_dim`` positive factors ``lam`` (K smoothing, as in
  SmoothAttention): the cache stores ``K / lam`` (the K scale calibrated on ``K / lam``) and every
  query is multiplied by ``lam`` of its KV head, so ``q . k`` is unchanged before quantization
  while outlier channels no longer set the 16-value NVFP4 block scales of their neighbours.
  Optional ``"k_center"``: per KV head, ``head_dim`` finite offsets ``mu`` (the calibration mean
  of each post-RoPE K channel): the cache stores ``K - mu`` (then ``/ lam`` if smoothed; scales
  calibrated on that), which moves every logit of a query by the same ``q . mu``, so softmax and
  the attention output are unchanged before quantization, while a channel's constant part (Qwen2's
  K bias) no longer spends the format's resolution. Not valid with a logits soft-cap.

* Compact string (formats only, no scales): comma-separated ``RANGE:SPEC`` items, e.g.
  ``0-1:fp8,2-27:nvfp4,28-29:fp8`` or ``swa:fp8,full:nvfp4,5:fp8``. ``RANGE`` is ``i``, ``i-j``
  (inclusive), a layer type (``full``, or ``swa`` = ``sliding``: every layer of that type) or
  ``*`` (every KV layer not named otherwise); negative indices count from the end (``-1`` is the
  last layer, ``-2--1`` the last two). ``SPEC`` is a format for K and V alike, or
  ``k=FMT,v=FMT`` for different ones (``5:k=fp8,v=nvfp4``). Precedence: an index or range beats a
  type, a type beats ``*``; two indices or ranges naming the same layer, or a type named twice,
  are errors. Layers without a KV cache take no format: a range skips them (it must contain at
  least one KV layer), a single index naming one is an error. Every KV layer must get a format.

Resolution at serve time (:func:`resolve_policy`), first match wins:

1. ``$VLLM_NVFP4_POLICY``: a path to a JSON policy file, or a compact string.
2. ``nvfp4_policy.json`` inside the model directory.
3. The default rule (:func:`default_policy`, logged): sliding-window layers FP8 (their cache is
   bounded by the window, so NVFP4 would save little there, and every token passes through
   them); of the full-attention layers the first and the last FP8, the others NVFP4. A model
   whose KV layers are all sliding-window (Mistral with a window) applies the first/last rule to
   those instead.

Layers without calibrated scales use the defaults :data:`DEFAULT_FP8_SCALE` (1.0, vLLM's own
default) and :data:`DEFAULT_NVFP4_GLOBAL_SCALE` (1/6: the same representable range, |x| <= 448,
as FP8 at scale 1.0), with a warning from the integration.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from vllm_nvfp4 import compact_json
from vllm_nvfp4.formats import KV_FORMATS, KVFormat, bytes_per_head, check_kv_format

logger = logging.getLogger(__name__)

POLICY_FORMAT = "vllm-nvfp4-policy"
POLICY_VERSION = 1
POLICY_ENV = "VLLM_NVFP4_POLICY"
POLICY_FILENAME = "nvfp4_policy.json"
DEFAULT_FP8_SCALE = KVFormat.FP8.default_scale
DEFAULT_NVFP4_GLOBAL_SCALE = KVFormat.NVFP4.default_scale
SCALE_FIELDS = ("k_scale", "v_scale", "k_global_scale", "v_global_scale")
TYPE_FIELDS = ("type", "window", "sinks")
#: per KV head and channel: K smoothing factors, K centering offsets
CHANNEL_FIELDS = ("k_smooth", "k_center")

Scale = Union[float, tuple[float, ...]]
Smooth = tuple[tuple[float, ...], ...]  # [kv_heads][head_dim]


class PolicyError(ValueError):
    """A policy that is malformed or does not fit the model; the message says what to fix."""


LAYER_KINDS = ("full", "sliding", "none")
#: compact-string selectors of a layer kind
KIND_SELECTORS = {"full": "full", "swa": "sliding", "sliding": "sliding"}
#: config ``layer_types`` entries -> kind (transformers' names; ``attention`` is MiniMax's)
CONFIG_LAYER_KINDS = {
    "full_attention": "full", "attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "none", "mamba": "none", "conv": "none",
}
#: model types whose attention layers all carry sinks (a config has no flag for them)
SINK_MODEL_TYPES = ("gpt_oss",)


@dataclass(frozen=True)
class LayerType:
    """What one decoder layer keeps in the KV cache (see the module doc)."""

    kind: str = "full"
    window: Optional[int] = None  # sliding: tokens attended, the current one included
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise PolicyError(f"unknown layer type {self.kind!r}; expected one of {', '.join(LAYER_KINDS)}")
        if self.kind == "sliding":
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window <= 0:
                raise PolicyError(f"a sliding layer needs a window (int > 0), got {self.window!r}")
        elif self.window is not None:
            raise PolicyError(f"a {self.kind} layer has no window (got {self.window!r})")
        if self.sinks and self.kind == "none":
            raise PolicyError("a layer without KV cache cannot have attention sinks")

    @property
    def holds_kv(self) -> bool:
        return self.kind != "none"

    def label(self) -> str:
        """``full``, ``sliding(512)``, ``full+sinks``, ``none``."""
        base = f"sliding({self.window})" if self.kind == "sliding" else self.kind
        return base + ("+sinks" if self.sinks else "")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.window is not None:
            out["window"] = self.window
        if self.sinks:
            out["sinks"] = True
        return out


FULL_ATTENTION = LayerType()
NO_KV = LayerType("none")


def layer_types_from_config(config: Any) -> tuple[LayerType, ...]:
    """Per decoder layer, its :class:`LayerType`, from a (text) model config.

    Reads ``num_hidden_layers``, ``layer_types`` (transformers' per-layer list), ``sliding_window``
    (with ``use_sliding_window``) and ``model_type``. Without ``layer_types`` every layer is
    sliding if the config sets a window (Mistral), else full attention.
    """
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 0:
        raise PolicyError(f"model config has no valid num_hidden_layers ({n!r})")
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    sinks = getattr(config, "model_type", None) in SINK_MODEL_TYPES
    names = getattr(config, "layer_types", None)
    if names is None:
        kind = "sliding" if window else "full"
        return tuple(LayerType(kind, window if window else None, sinks) for _ in range(n))
    if len(names) != n:
        raise PolicyError(f"model config lists {len(names)} layer_types for {n} layers")
    out = []
    for i, name in enumerate(names):
        kind = CONFIG_LAYER_KINDS.get(name)
        if kind is None:
            raise PolicyError(
                f"layer {i} of the model has type {name!r}, which vllm-nvfp4 does not know; "
                f"supported: {', '.join(sorted(CONFIG_LAYER_KINDS))}")
        if kind == "sliding" and not window:
            raise PolicyError(f"layer {i} is sliding_attention but the config sets no sliding_window")
        out.append(LayerType(kind, window if kind == "sliding" else None, sinks and kind != "none"))
    return tuple(out)


def _check_scale(value: Any, where: str) -> Optional[Scale]:
    if value is None:
        return None
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise PolicyError(f"{where}: empty per-head scale list")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise PolicyError(f"{where}: scale must be a number, got {v!r}")
        if not math.isfinite(v) or v <= 0:
            raise PolicyError(f"{where}: scale must be finite and > 0, got {v!r}")
        out.append(float(v))
    return tuple(out) if isinstance(value, (list, tuple)) else out[0]


def _check_channels(value: Any, name: str, positive: bool) -> Optional[Smooth]:
    """Per KV head, one number per channel (``k_smooth``: factors > 0; ``k_center``: any finite
    offsets), as tuples."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(h, (list, tuple)) and h for h in value):
        raise PolicyError(f"{name}: {name} must be a non-empty list (one per KV head) of "
                          f"non-empty lists (one value per channel)")
    if len({len(h) for h in value}) != 1:
        raise PolicyError(f"{name}: {name} lists differ in length {sorted({len(h) for h in value})}")
    heads = []
    for h in value:
        for v in h:
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or (positive and v <= 0)):
                raise PolicyError(f"{name}: {name} values must be finite numbers"
                                  f"{' > 0' if positive else ''}, got {v!r}")
        heads.append(tuple(float(v) for v in h))
    return tuple(heads)


@dataclass(frozen=True)
class LayerPolicy:
    """Formats and (optional) calibrated scales of one decoder layer's K and V.

    A row of type ``none`` (no KV cache) has ``k = v = None`` and nothing else."""

    k: Optional[KVFormat]
    v: Optional[KVFormat]
    k_scale: Optional[Scale] = None
    v_scale: Optional[Scale] = None
    k_global_scale: Optional[Scale] = None
    v_global_scale: Optional[Scale] = None
    k_smooth: Optional[Smooth] = None
    k_center: Optional[Smooth] = None
    layer_type: LayerType = FULL_ATTENTION

    def __post_init__(self) -> None:
        if not isinstance(self.layer_type, LayerType):
            raise PolicyError(f"layer_type must be a LayerType, got {self.layer_type!r}")
        if not self.layer_type.holds_kv:
            extra = [n for n in ("k", "v", *SCALE_FIELDS, *CHANNEL_FIELDS) if getattr(self, n) is not None]
            if extra:
                raise PolicyError(f"a layer without KV cache (type none) takes no {', '.join(extra)}")
            return
        for name in ("k", "v"):
            try:
                object.__setattr__(self, name, check_kv_format(getattr(self, name)))
            except ValueError as e:
                raise PolicyError(str(e)) from None
        for name in SCALE_FIELDS:
            object.__setattr__(self, name, _check_scale(getattr(self, name), name))
        object.__setattr__(self, "k_smooth", _check_channels(self.k_smooth, "k_smooth", True))
        object.__setattr__(self, "k_center", _check_channels(self.k_center, "k_center", False))

    def format_of(self, kv: str) -> KVFormat:
        """Format of ``"k"`` or ``"v"``."""
        return self.k if kv == "k" else self.v

    def quant_scale(self, kv: str) -> Optional[Scale]:
        """The scale the layer's format uses for ``kv``: FP8 scale or NVFP4 global scale."""
        if self.format_of(kv) is KVFormat.FP8:
            return self.k_scale if kv == "k" else self.v_scale
        return self.k_global_scale if kv == "k" else self.v_global_scale


@dataclass(frozen=True)
class KVPolicy:
    """The per-layer policy of a whole model (index = attention layer order in the model)."""

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

    # ------------------------------------------------------------------ compact string form
    @classmethod
    def from_compact(cls, text: str, num_layers: int, source: str = "<string>",
                     layer_types: Optional[Sequence[LayerType]] = None) -> "KVPolicy":
        """Parse ``0-1:fp8,2-27:nvfp4`` / ``swa:fp8,full:nvfp4`` style text for a model of
        ``num_layers`` decoder layers of ``layer_types`` (default: all full attention)."""
        if num_layers <= 0:
            raise PolicyError(f"num_layers must be positive, got {num_layers}")
        types = tuple(layer_types) if layer_types is not None else (FULL_ATTENTION,) * num_layers
        if len(types) != num_layers:
            raise PolicyError(f"{len(types)} layer types given for {num_layers} layers")
        by_index: list[Optional[tuple[str, str]]] = [None] * num_layers
        by_kind: dict[str, tuple[str, str]] = {}
        wildcard: Optional[tuple[str, str]] = None
        for rng, spec in _split_compact(text):
            if rng == "*":
                if wildcard is not None:
                    raise PolicyError(f"'*' appears twice in policy {text!r}")
                wildcard = spec
            elif rng in KIND_SELECTORS:
                kind = KIND_SELECTORS[rng]
                if kind in by_kind:
                    raise PolicyError(f"layer type {rng!r} is named twice in {text!r}")
                if not any(t.kind == kind for t in types):
                    raise PolicyError(f"policy {text!r} names {rng!r} layers, but the model has none "
                                      f"(its layers: {_format_types(types)})")
                by_kind[kind] = spec
            else:
                indices = [i for i in _expand_range(rng, num_layers, text) if types[i].holds_kv]
                if not indices:
                    raise PolicyError(f"{rng!r} in {text!r} names only layers without KV cache "
                                      f"({_format_types(types)}); they take no format")
                for i in indices:
                    if by_index[i] is not None:
                        raise PolicyError(f"layer {i} is named twice (overlapping ranges) in {text!r}")
                    by_index[i] = spec
        layers, missing = [], []
        for i, t in enumerate(types):
            if not t.holds_kv:
                layers.append(LayerPolicy(None, None, layer_type=t))
                continue
            spec = by_index[i] or by_kind.get(t.kind) or wildcard
            if spec is None:
                missing.append(i)
                continue
            layers.append(LayerPolicy(*spec, layer_type=t))
        if missing:
            raise PolicyError(
                f"policy {text!r} leaves layers {_format_indices(missing)} of {num_layers} "
                "without a format (add them, or a '*:FMT' item for the rest)"
            )
        return cls(layers=tuple(layers), source=source)

    def to_compact(self) -> str:
        """The formats as a compact string of index ranges (scales and types are not part of
        this form); a range spans the layers without KV cache between equal rows."""
        items: list[str] = []
        run: list[int] = []  # KV layers of the current run of equal formats

        def flush() -> None:
            if run:
                rng = str(run[0]) if run[0] == run[-1] else f"{run[0]}-{run[-1]}"
                k, v = _fmt_key(self.layers[run[0]])
                items.append(f"{rng}:{k}" if k == v else f"{rng}:k={k},v={v}")

        for i, lp in self.kv_layers():
            if run and _fmt_key(lp) != _fmt_key(self.layers[run[0]]):
                flush()
                run = []
            run.append(i)
        flush()
        return ",".join(items)

    # ------------------------------------------------------------------ JSON form
    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "KVPolicy":
        """Build from the parsed JSON object; every malformation raises :class:`PolicyError`."""
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: top level must be a JSON object")
        if data.get("format") != POLICY_FORMAT:
            raise PolicyError(f"{source}: 'format' must be {POLICY_FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != POLICY_VERSION:
            raise PolicyError(
                f"{source}: unsupported policy version {data.get('version')!r} "
                f"(this vllm-nvfp4 reads version {POLICY_VERSION})"
            )
        layers = data.get("layers")
        n = data.get("num_layers")
        if not isinstance(layers, list) or not isinstance(n, int):
            raise PolicyError(f"{source}: needs 'num_layers' (int) and 'layers' (list)")
        if len(layers) != n:
            raise PolicyError(f"{source}: num_layers is {n} but {len(layers)} layers are listed")
        parsed = []
        for pos, entry in enumerate(layers):
            where = f"{source}: layers[{pos}]"
            if not isinstance(entry, dict):
                raise PolicyError(f"{where}: must be an object")
            if entry.get("index", pos) != pos:
                raise PolicyError(f"{where}: index {entry.get('index')} out of order (expected {pos})")
            unknown = set(entry) - {"index", *TYPE_FIELDS, "k", "v", *SCALE_FIELDS, *CHANNEL_FIELDS}
            if unknown:
                raise PolicyError(f"{where}: unknown keys {sorted(unknown)}")
            try:
                layer_type = LayerType(entry.get("type", "full"), entry.get("window"),
                                       entry.get("sinks", False) is True)
                if entry.get("sinks", False) not in (True, False):
                    raise PolicyError(f"'sinks' must be true or false, got {entry['sinks']!r}")
                if layer_type.holds_kv and ("k" not in entry or "v" not in entry):
                    raise PolicyError(f"needs 'k' and 'v' formats ({'/'.join(KV_FORMATS)})")
                fields = {"k": None, "v": None,
                          **{k: val for k, val in entry.items() if k not in ("index", *TYPE_FIELDS)}}
                parsed.append(LayerPolicy(**fields, layer_type=layer_type))
            except PolicyError as e:
                raise PolicyError(f"{where}: {e}") from None
        prov = data.get("provenance", {})
        if not isinstance(prov, dict):
            raise PolicyError(f"{source}: 'provenance' must be an object")
        return cls(layers=tuple(parsed), provenance=prov, source=source)

    def to_dict(self) -> dict[str, Any]:
        layers = []
        for i, lp in enumerate(self.layers):
            entry: dict[str, Any] = {"index": i, **lp.layer_type.to_json()}
            for key, val in asdict(lp).items():
                if val is not None and key != "layer_type":
                    entry[key] = _to_json(val)
            layers.append(entry)
        return {
            "format": POLICY_FORMAT,
            "version": POLICY_VERSION,
            "num_layers": self.num_layers,
            "layers": layers,
            "provenance": dict(self.provenance),
        }

    @classmethod
    def load(cls, path: Union[str, Path]) -> "KVPolicy":
        """Read a JSON policy file."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PolicyError(f"policy file {p} does not exist") from None
        except IsADirectoryError:
            raise PolicyError(f"policy file {p} is a directory; give the JSON file") from None
        except OSError as e:
            raise PolicyError(f"cannot read policy file {p}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise PolicyError(f"policy file {p} is not UTF-8 text (not a JSON policy)") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PolicyError(f"{p}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        return cls.from_dict(data, source=str(p))

    def save(self, path: Union[str, Path], overwrite: bool = False) -> Path:
        """Write as JSON (:func:`compact_json.dumps`: one line per vector); refuses to replace an
        existing file unless ``overwrite``."""
        p = Path(path)
        if p.exists() and not overwrite:
            raise FileExistsError(f"{p} exists; refusing to overwrite it (use --force / overwrite=True)")
        p.write_text(compact_json.dumps(self.to_dict()) + "\n", encoding="utf-8")
        return p

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
            if len(layer_types) != num_layers:
                raise PolicyError(f"{len(layer_types)} layer types given for {num_layers} layers")
            wrong = [i for i, (a, b) in enumerate(zip(self.layer_types, layer_types)) if a != b]
            if wrong:
                i = wrong[0]
                raise PolicyError(
                    f"policy {self.source} does not match the model's layer types: layer {i} is "
                    f"{self.layers[i].layer_type.label()} in the policy but "
                    f"{layer_types[i].label()} in the model ({len(wrong)} layers differ; the "
                    f"model's layers: {_format_types(layer_types)}); calibrate for this model or "
                    "fix the policy")
        if num_kv_heads is None:
            return
        for i, lp in enumerate(self.layers):
            for name in (*SCALE_FIELDS, *CHANNEL_FIELDS):
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

    def describe(self) -> str:
        """A multi-line table of the policy, for the start-up log."""
        lines = [f"KV policy from {self.source}: {self.to_compact()} "
                 f"({self.fraction_of_fp8():.3f}x FP8 bytes)"]
        typed = any(t != FULL_ATTENTION for t in self.layer_types)  # dense: no type column
        for i, lp in enumerate(self.layers):
            kind = f"{lp.layer_type.label():18s} " if typed else ""
            if not lp.layer_type.holds_kv:
                lines.append(f"  layer {i:3d}: {kind}(no KV cache)")
                continue
            ks, vs = lp.quant_scale("k"), lp.quant_scale("v")
            extra = ("  K centered" if lp.k_center else "") + ("  K smoothed" if lp.k_smooth else "")
            lines.append(f"  layer {i:3d}: {kind}K {lp.k:5s} scale {_fmt_scale(ks)}  V {lp.v:5s} "
                         f"scale {_fmt_scale(vs)}{extra}")
        return "\n".join(lines)


def _to_json(val: Any) -> Any:
    """Tuples (per-head scales, k_smooth rows) as JSON lists, recursively; formats as names."""
    if isinstance(val, KVFormat):
        return val.value
    return [_to_json(v) for v in val] if isinstance(val, tuple) else val


def default_policy(num_layers: int, layer_types: Optional[Sequence[LayerType]] = None) -> KVPolicy:
    """The default rule (module doc): sliding layers FP8; of the growing layers (the
    full-attention ones, or all KV layers if none is full) the first and last FP8, the others
    NVFP4; everything FP8 when there are at most two growing layers."""
    types = tuple(layer_types) if layer_types is not None else (FULL_ATTENTION,) * num_layers
    kv = [i for i, t in enumerate(types) if t.holds_kv]
    if not kv:
        raise PolicyError("the model has no layer with a KV cache; nvfp4_mixed has nothing to store")
    growing = [i for i in kv if types[i].kind == "full"] or kv
    if len(growing) <= 2:
        text, source = "*:fp8", "default rule"
    elif len(growing) == len(kv):
        text, source = f"{growing[0]}:fp8,{growing[-1]}:fp8,*:nvfp4", "default rule (first/last FP8)"
    else:
        text = f"{growing[0]}:fp8,{growing[-1]}:fp8,swa:fp8,full:nvfp4"
        source = "default rule (sliding FP8, first/last full-attention FP8)"
    return KVPolicy.from_compact(text, num_layers, source=source, layer_types=types)


def resolve_policy(
    num_layers: int,
    model_dir: Optional[Union[str, Path]] = None,
    env: Optional[Mapping[str, str]] = None,
    layer_types: Optional[Sequence[LayerType]] = None,
) -> KVPolicy:
    """Find the policy for a model: ``$VLLM_NVFP4_POLICY``, then the model dir, then the default.

    The policy's ``source`` says where it came from (the start-up log line prints it). A variable
    that is set but empty (or blank) counts as unset, and ``source`` says so.

    ``layer_types``: the model's (default: all full attention); the policy found must match them.
    """
    env = os.environ if env is None else env
    raw = env.get(POLICY_ENV)
    setting = (raw or "").strip()
    if setting:
        policy = _policy_from_env(setting, num_layers, layer_types)
        policy.check_model(num_layers, layer_types=layer_types)
        return policy
    ignored = f"; ${POLICY_ENV} is set but empty, so it was ignored" if raw is not None else ""
    if model_dir is not None:
        candidate = Path(model_dir) / POLICY_FILENAME
        if candidate.is_file():
            policy = KVPolicy.load(candidate)
            policy = replace(policy, source=policy.source + ignored)
            policy.check_model(num_layers, layer_types=layer_types)
            return policy
    policy = default_policy(num_layers, layer_types)
    logger.info(
        "vllm-nvfp4: no $%s and no %s in the model directory; using the %s: %s",
        POLICY_ENV, POLICY_FILENAME, policy.source, policy.to_compact(),
    )
    return replace(policy, source=policy.source + ignored)


def _policy_from_env(setting: str, num_layers: int,
                     layer_types: Optional[Sequence[LayerType]] = None) -> KVPolicy:
    """The policy ``$VLLM_NVFP4_POLICY`` names: a JSON file, else a compact string."""
    path = Path(setting).expanduser()
    if path.is_dir():
        raise PolicyError(f"${POLICY_ENV}={setting!r} is a directory; name the policy file "
                          f"(e.g. {path / POLICY_FILENAME})")
    if path.is_file():
        return replace(KVPolicy.load(path), source=f"{path} (${POLICY_ENV})")
    if setting.endswith(".json") or os.sep in setting:
        raise PolicyError(f"policy file {setting} (from ${POLICY_ENV}) does not exist")
    return KVPolicy.from_compact(setting, num_layers, source=f"${POLICY_ENV}", layer_types=layer_types)


# ---------------------------------------------------------------------- compact-form helpers
_RANGE_RE = re.compile(r"^(-?\d+)(?:-(-?\d+))?$")
_KV_RE = re.compile(r"^([kv])=(\w+)$")


def _split_compact(text: str) -> list[tuple[str, tuple[str, str]]]:
    """Split into ``(range, (k_fmt, v_fmt))``; ``k=..,v=..`` may span two comma items."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise PolicyError(f"empty item in policy string {text!r}")
    out: list[tuple[str, tuple[str, str]]] = []
    pending: Optional[tuple[str, dict[str, str]]] = None
    for item in items:
        if ":" in item:
            if pending is not None:
                out.append(_finish_kv(pending, text))
                pending = None
            rng, spec = (s.strip() for s in item.split(":", 1))
            m = _KV_RE.match(spec)
            if m:
                pending = (rng, {m.group(1): m.group(2)})
            else:
                out.append((rng, (_fmt(spec, text), _fmt(spec, text))))
        else:
            m = _KV_RE.match(item)
            if pending is None or not m:
                raise PolicyError(f"cannot parse {item!r} in policy string {text!r} (expected RANGE:FORMAT)")
            if m.group(1) in pending[1]:
                raise PolicyError(f"{m.group(1)} given twice for range {pending[0]!r} in {text!r}")
            pending[1][m.group(1)] = m.group(2)
    if pending is not None:
        out.append(_finish_kv(pending, text))
    return out


def _finish_kv(pending: tuple[str, dict[str, str]], text: str) -> tuple[str, tuple[str, str]]:
    rng, kv = pending
    if set(kv) != {"k", "v"}:
        raise PolicyError(f"range {rng!r} in {text!r} needs both k=FMT and v=FMT")
    return rng, (_fmt(kv["k"], text), _fmt(kv["v"], text))


def _fmt(name: str, text: str) -> KVFormat:
    try:
        return KVFormat.parse(name)
    except ValueError as e:
        raise PolicyError(f"{e} (in {text!r})") from None


def _expand_range(rng: str, num_layers: int, text: str) -> range:
    m = _RANGE_RE.match(rng)
    if not m:
        raise PolicyError(f"bad layer range {rng!r} in {text!r} (use i, i-j, negative from the end, or *)")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    for v in (lo, hi):
        if not -num_layers <= v < num_layers:
            raise PolicyError(f"layer index {v} in {text!r} is out of range for {num_layers} layers")
    lo, hi = lo % num_layers, hi % num_layers
    if hi < lo:
        raise PolicyError(f"empty layer range {rng!r} in {text!r} (start after end)")
    return range(lo, hi + 1)


def _fmt_key(lp: LayerPolicy) -> tuple[str, str]:
    return lp.k, lp.v


def _format_types(types: Sequence[LayerType]) -> str:
    """``0-4 sliding(512), 5 full, ...``: runs of equal types."""
    runs: list[str] = []
    start = 0
    for i in range(1, len(types) + 1):
        if i < len(types) and types[i] == types[start]:
            continue
        rng = str(start) if i - 1 == start else f"{start}-{i - 1}"
        runs.append(f"{rng} {types[start].label()}")
        start = i
    return ", ".join(runs[:8]) + (" ..." if len(runs) > 8 else "")


def _format_indices(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices[:10])) + (" ..." if len(indices) > 10 else "")


def _fmt_scale(s: Optional[Scale]) -> str:
    if s is None:
        return "default"
    if isinstance(s, tuple):
        return f"per-head[{len(s)}] max {max(s):.4g}"
    return f"{s:.4g}"
