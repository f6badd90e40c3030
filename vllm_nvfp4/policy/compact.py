"""The compact string form of a policy (formats only, no scales): parser and formatter.

Comma-separated ``RANGE:SPEC`` items, e.g. ``0-1:fp8,2-27:nvfp4,28-29:fp8`` or
``swa:fp8,full:nvfp4,5:fp8``. ``RANGE`` is ``i``, ``i-j`` (inclusive), a layer type (``full``, or
``swa`` = ``sliding``: every layer of that type) or ``*`` (every KV layer not named otherwise);
negative indices count from the end (``-1`` is the last layer, ``-2--1`` the last two). ``SPEC``
is a format for K and V alike, or ``k=FMT,v=FMT`` for different ones (``5:k=fp8,v=nvfp4``).
Precedence: an index or range beats a type, a type beats ``*``; two indices or ranges naming the
same layer, or a type named twice, are errors. Layers without a KV cache take no format: a range
skips them (it must contain at least one KV layer), a single index naming one is an error. Every
KV layer must get a format.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from vllm_nvfp4.formats import KVFormat
from vllm_nvfp4.policy.errors import PolicyError
from vllm_nvfp4.policy.layer_types import LayerType, format_types
from vllm_nvfp4.policy.layer_policy import LayerPolicy

#: compact-string selectors of a layer kind
KIND_SELECTORS = {"full": "full", "swa": "sliding", "sliding": "sliding"}

FormatPair = tuple[KVFormat, KVFormat]  # (K format, V format)

_RANGE_RE = re.compile(r"^(-?\d+)(?:-(-?\d+))?$")
_KV_RE = re.compile(r"^([kv])=(\w+)$")


def parse_compact(text: str, types: Sequence[LayerType]) -> tuple[LayerPolicy, ...]:
    """One row per layer of ``types`` from ``0-1:fp8,2-27:nvfp4`` / ``swa:fp8,full:nvfp4`` text."""
    num_layers = len(types)
    by_index: list[Optional[FormatPair]] = [None] * num_layers
    by_kind: dict[str, FormatPair] = {}
    wildcard: Optional[FormatPair] = None
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
                                  f"(its layers: {format_types(types)})")
            by_kind[kind] = spec
        else:
            indices = [i for i in _expand_range(rng, num_layers, text) if types[i].holds_kv]
            if not indices:
                raise PolicyError(f"{rng!r} in {text!r} names only layers without KV cache "
                                  f"({format_types(types)}); they take no format")
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
    return tuple(layers)


def format_compact(layers: Sequence[LayerPolicy]) -> str:
    """The formats of ``layers`` as a compact string of index ranges (scales and types are not
    part of this form); a range spans the layers without KV cache between equal rows."""
    items: list[str] = []
    run: list[int] = []  # KV layers of the current run of equal formats

    def flush() -> None:
        if run:
            rng = str(run[0]) if run[0] == run[-1] else f"{run[0]}-{run[-1]}"
            k, v = _format_pair(layers[run[0]])
            items.append(f"{rng}:{k}" if k == v else f"{rng}:k={k},v={v}")

    for i, lp in enumerate(layers):
        if not lp.layer_type.holds_kv:
            continue
        if run and _format_pair(lp) != _format_pair(layers[run[0]]):
            flush()
            run = []
        run.append(i)
    flush()
    return ",".join(items)


def _split_compact(text: str) -> list[tuple[str, FormatPair]]:
    """Split into ``(range, (k_fmt, v_fmt))``; ``k=..,v=..`` may span two comma items."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise PolicyError(f"empty item in policy string {text!r}")
    out: list[tuple[str, FormatPair]] = []
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
                out.append((rng, (_parse_format(spec, text), _parse_format(spec, text))))
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


def _finish_kv(pending: tuple[str, dict[str, str]], text: str) -> tuple[str, FormatPair]:
    rng, kv = pending
    if set(kv) != {"k", "v"}:
        raise PolicyError(f"range {rng!r} in {text!r} needs both k=FMT and v=FMT")
    return rng, (_parse_format(kv["k"], text), _parse_format(kv["v"], text))


def _parse_format(name: str, text: str) -> KVFormat:
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


def _format_pair(lp: LayerPolicy) -> FormatPair:
    return lp.k, lp.v


def _format_indices(indices: Sequence[int]) -> str:
    return ", ".join(map(str, indices[:10])) + (" ..." if len(indices) > 10 else "")
