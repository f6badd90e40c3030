"""JSON text for policies and results: indented structure, every list of numbers on one line.

Per-channel vectors (``k_smooth``, ``k_center``, ``k_perm``: ``[kv_heads][head_dim]``) written
one number per line make a 28-layer policy 7,600 lines long; here each ``head_dim`` vector is one
line and the file stays readable as a diff. Numbers are written by :func:`json.dumps`, so floats
round-trip exactly (shortest repr) and ``json.loads(dumps(x)) == json.loads(json.dumps(x))``.
"""

from __future__ import annotations

import json
from typing import Any


def dumps(obj: Any, indent: int = 2) -> str:
    """``obj`` as JSON text: dicts and lists of non-numbers indented by ``indent`` spaces per
    level, lists (or tuples) whose items are all numbers on one line. Dict keys must be strings."""
    return _encode(obj, 0, indent)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _encode(obj: Any, level: int, indent: int) -> str:
    inner = " " * (indent * (level + 1))
    outer = " " * (indent * level)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = []
        for key, val in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"JSON object keys must be strings, got {key!r} ({type(key).__name__})")
            items.append(f"{inner}{json.dumps(key)}: {_encode(val, level + 1, indent)}")
        return "{\n" + ",\n".join(items) + "\n" + outer + "}"
    if isinstance(obj, (list, tuple)):
        if all(_is_number(x) for x in obj):
            return json.dumps(list(obj))
        items = [inner + _encode(x, level + 1, indent) for x in obj]
        return "[\n" + ",\n".join(items) + "\n" + outer + "]"
    return json.dumps(obj)
