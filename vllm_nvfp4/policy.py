"""Per-layer KV precision policy: which format each attention layer stores K and V in, plus scales.

Two forms, both round-trip:

* JSON file (versioned)::

    {"format": "vllm-nvfp4-policy", "version": 1, "num_layers": 30,
     "layers": [{"index": 0, "k": "fp8", "v": "fp8",
                 "k_scale": 0.02, "v_scale": 0.01,            # FP8 scales (amax / 448)
                 "k_global_scale": 0.003, "v_global_scale": 0.001},  # NVFP4 (amax / 2688)
                ...],
     "provenance": {...free-form: tool version, model hash, data, metrics...}}

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
  ``0-1:fp8,2-27:nvfp4,28-29:fp8``. ``RANGE`` is ``i``, ``i-j`` (inclusive) or ``*`` (every layer
  not named elsewhere); negative indices count from the end (``-1`` is the last layer, ``-2--1``
  the last two). ``SPEC`` is a format for K and V alike, or ``k=FMT,v=FMT`` for different ones
  (``5:k=fp8,v=nvfp4``). Every layer must be covered exactly once.

Resolution at serve time (:func:`resolve_policy`), first match wins:

1. ``$VLLM_NVFP4_POLICY``: a path to a JSON policy file, or a compact string.
2. ``nvfp4_policy.json`` inside the model directory.
3. The default rule: first and last layer FP8 for K and V, every other layer NVFP4 (logged).

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
#: per KV head and channel: K smoothing factors, K centering offsets
CHANNEL_FIELDS = ("k_smooth", "k_center")

Scale = Union[float, tuple[float, ...]]
Smooth = tuple[tuple[float, ...], ...]  # [kv_heads][head_dim]


class PolicyError(ValueError):
    """A policy that is malformed or does not fit the model; the message says what to fix."""


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
    """Formats and (optional) calibrated scales of one attention layer's K and V."""

    k: KVFormat
    v: KVFormat
    k_scale: Optional[Scale] = None
    v_scale: Optional[Scale] = None
    k_global_scale: Optional[Scale] = None
    v_global_scale: Optional[Scale] = None
    k_smooth: Optional[Smooth] = None
    k_center: Optional[Smooth] = None

    def __post_init__(self) -> None:
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
        return len(self.layers)

    # ------------------------------------------------------------------ compact string form
    @classmethod
    def from_compact(cls, text: str, num_layers: int, source: str = "<string>") -> "KVPolicy":
        """Parse ``0-1:fp8,2-27:nvfp4`` style text for a model of ``num_layers`` layers."""
        if num_layers <= 0:
            raise PolicyError(f"num_layers must be positive, got {num_layers}")
        entries = _split_compact(text)
        assigned: list[Optional[tuple[str, str]]] = [None] * num_layers
        wildcard: Optional[tuple[str, str]] = None
        for rng, spec in entries:
            if rng == "*":
                if wildcard is not None:
                    raise PolicyError(f"'*' appears twice in policy {text!r}")
                wildcard = spec
                continue
            for i in _expand_range(rng, num_layers, text):
                if assigned[i] is not None:
                    raise PolicyError(f"layer {i} is named twice (overlapping ranges) in {text!r}")
                assigned[i] = spec
        missing = [i for i, a in enumerate(assigned) if a is None]
        if missing and wildcard is None:
            raise PolicyError(
                f"policy {text!r} leaves layers {_format_indices(missing)} of {num_layers} "
                "without a format (add them, or a '*:FMT' item for the rest)"
            )
        layers = tuple(LayerPolicy(*(a or wildcard)) for a in assigned)  # type: ignore[misc]
        return cls(layers=layers, source=source)

    def to_compact(self) -> str:
        """The formats as a compact string (scales are not part of this form)."""
        items: list[str] = []
        start = 0
        for i in range(1, self.num_layers + 1):
            if i < self.num_layers and _fmt_key(self.layers[i]) == _fmt_key(self.layers[start]):
                continue
            rng = str(start) if i - 1 == start else f"{start}-{i - 1}"
            k, v = _fmt_key(self.layers[start])
            items.append(f"{rng}:{k}" if k == v else f"{rng}:k={k},v={v}")
            start = i
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
            unknown = set(entry) - {"index", "k", "v", *SCALE_FIELDS, *CHANNEL_FIELDS}
            if unknown:
                raise PolicyError(f"{where}: unknown keys {sorted(unknown)}")
            if "k" not in entry or "v" not in entry:
                raise PolicyError(f"{where}: needs 'k' and 'v' formats ({'/'.join(KV_FORMATS)})")
            try:
                parsed.append(LayerPolicy(**{k: val for k, val in entry.items() if k != "index"}))
            except PolicyError as e:
                raise PolicyError(f"{where}: {e}") from None
        prov = data.get("provenance", {})
        if not isinstance(prov, dict):
            raise PolicyError(f"{source}: 'provenance' must be an object")
        return cls(layers=tuple(parsed), provenance=prov, source=source)

    def to_dict(self) -> dict[str, Any]:
        layers = []
        for i, lp in enumerate(self.layers):
            entry: dict[str, Any] = {"index": i}
            for key, val in asdict(lp).items():
                if val is not None:
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
                    head_dim: Optional[int] = None) -> None:
        """Raise :class:`PolicyError` unless the policy fits a model of this shape."""
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

    def kv_bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """Cache bytes one token occupies across all layers (K + V, scales included)."""
        return sum(
            num_kv_heads * (bytes_per_head(lp.k, head_dim) + bytes_per_head(lp.v, head_dim))
            for lp in self.layers
        )

    def fraction_of_fp8(self) -> float:
        """KV bytes relative to an all-FP8 cache (head_dim independent)."""
        per_fp8 = KVFormat.FP8.bytes_per_element
        total = sum(lp.k.bytes_per_element + lp.v.bytes_per_element for lp in self.layers)
        return total / (2 * self.num_layers * per_fp8)

    def describe(self) -> str:
        """A multi-line table of the policy, for the start-up log."""
        lines = [f"KV policy from {self.source}: {self.to_compact()} "
                 f"({self.fraction_of_fp8():.3f}x FP8 bytes)"]
        for i, lp in enumerate(self.layers):
            ks, vs = lp.quant_scale("k"), lp.quant_scale("v")
            extra = ("  K centered" if lp.k_center else "") + ("  K smoothed" if lp.k_smooth else "")
            lines.append(f"  layer {i:3d}: K {lp.k:5s} scale {_fmt_scale(ks)}  V {lp.v:5s} "
                         f"scale {_fmt_scale(vs)}{extra}")
        return "\n".join(lines)


def _to_json(val: Any) -> Any:
    """Tuples (per-head scales, k_smooth rows) as JSON lists, recursively; formats as names."""
    if isinstance(val, KVFormat):
        return val.value
    return [_to_json(v) for v in val] if isinstance(val, tuple) else val


def default_policy(num_layers: int) -> KVPolicy:
    """The default rule: first and last layer FP8 (K and V), the rest NVFP4."""
    if num_layers <= 2:
        return KVPolicy.from_compact("*:fp8", num_layers, source="default rule")
    return KVPolicy.from_compact(
        f"0:fp8,{num_layers - 1}:fp8,*:nvfp4", num_layers, source="default rule (first/last FP8)"
    )


def resolve_policy(
    num_layers: int,
    model_dir: Optional[Union[str, Path]] = None,
    env: Optional[Mapping[str, str]] = None,
) -> KVPolicy:
    """Find the policy for a model: ``$VLLM_NVFP4_POLICY``, then the model dir, then the default.

    The policy's ``source`` says where it came from (the start-up log line prints it). A variable
    that is set but empty (or blank) counts as unset, and ``source`` says so.
    """
    env = os.environ if env is None else env
    raw = env.get(POLICY_ENV)
    setting = (raw or "").strip()
    if setting:
        policy = _policy_from_env(setting, num_layers)
        policy.check_model(num_layers)
        return policy
    ignored = f"; ${POLICY_ENV} is set but empty, so it was ignored" if raw is not None else ""
    if model_dir is not None:
        candidate = Path(model_dir) / POLICY_FILENAME
        if candidate.is_file():
            policy = KVPolicy.load(candidate)
            policy = replace(policy, source=policy.source + ignored)
            policy.check_model(num_layers)
            return policy
    policy = default_policy(num_layers)
    logger.info(
        "vllm-nvfp4: no $%s and no %s in the model directory; using the default rule: %s",
        POLICY_ENV, POLICY_FILENAME, policy.to_compact(),
    )
    return replace(policy, source=policy.source + ignored)


def _policy_from_env(setting: str, num_layers: int) -> KVPolicy:
    """The policy ``$VLLM_NVFP4_POLICY`` names: a JSON file, else a compact string."""
    path = Path(setting).expanduser()
    if path.is_dir():
        raise PolicyError(f"${POLICY_ENV}={setting!r} is a directory; name the policy file "
                          f"(e.g. {path / POLICY_FILENAME})")
    if path.is_file():
        return replace(KVPolicy.load(path), source=f"{path} (${POLICY_ENV})")
    if setting.endswith(".json") or os.sep in setting:
        raise PolicyError(f"policy file {setting} (from ${POLICY_ENV}) does not exist")
    return KVPolicy.from_compact(setting, num_layers, source=f"${POLICY_ENV}")


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


def _format_indices(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices[:10])) + (" ..." if len(indices) > 10 else "")


def _fmt_scale(s: Optional[Scale]) -> str:
    if s is None:
        return "default"
    if isinstance(s, tuple):
        return f"per-head[{len(s)}] max {max(s):.4g}"
    return f"{s:.4g}"
