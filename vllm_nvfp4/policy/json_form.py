"""The versioned JSON form of a policy: parsing with validation, writing, file I/O.

::

    {"format": "vllm-nvfp4-policy", "version": 1, "num_layers": 30,
     "layers": [{"index": 0, "type": "sliding", "window": 512, "k": "fp8", "v": "fp8",
                 "k_scale": 0.02, "v_scale": 0.01,            # FP8 scales (amax / 448)
                 "k_global_scale": 0.003, "v_global_scale": 0.001},  # NVFP4 (amax / 2688)
                {"index": 1, "type": "none"},                  # e.g. a Gated DeltaNet layer
                ...],
     "provenance": {...free-form: tool version, model hash, data, metrics...}}

``"type"`` may be left out for full attention (policies of dense models written before the types
existed read unchanged); ``"sinks": true`` marks a layer with attention sinks. The scale,
channel and per-head flag fields (``"k_sink_uncentered"``) and ``"k_rot"`` (an object:
``"pairs"``, ``"b"``, ``"theta"``) are those of
:class:`~vllm_nvfp4.policy.layer_policy.LayerPolicy`. Files are
written by :func:`vllm_nvfp4.json_text.dumps` (one line per vector).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from vllm_nvfp4 import json_text
from vllm_nvfp4.formats import KV_FORMATS, KVFormat
from vllm_nvfp4.policy.errors import PolicyError
from vllm_nvfp4.policy.layer_policy import CHANNEL_FIELDS, HEAD_FLAG_FIELDS, SCALE_FIELDS, LayerPolicy
from vllm_nvfp4.policy.layer_types import LayerType

POLICY_FORMAT = "vllm-nvfp4-policy"
POLICY_VERSION = 1
TYPE_FIELDS = ("type", "window", "sinks")
#: where a malformed policy's error sends the reader: the schema and what writes a valid file
FORMAT_DOC = ("the policy file format is documented in vllm_nvfp4/policy/json_form.py; "
              "`vllm-nvfp4 calibrate`, `select` and `tune` write one")
CONTEXT_CHARS = 20  # characters of the text quoted before the fault of malformed JSON


def layers_from_dict(data: Any, source: str) -> tuple[tuple[LayerPolicy, ...], dict[str, Any]]:
    """``(rows, provenance)`` of a parsed JSON policy; every malformation raises
    :class:`PolicyError` naming ``source``, the entry and where the format is documented
    (:data:`FORMAT_DOC`)."""
    try:
        return _layers_from_dict(data, source)
    except PolicyError as e:
        raise PolicyError(f"{e}; {FORMAT_DOC}") from None


def _layers_from_dict(data: Any, source: str) -> tuple[tuple[LayerPolicy, ...], dict[str, Any]]:
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: top level must be a JSON object")
    if data.get("format") != POLICY_FORMAT:
        what = ("has no 'format' header" if "format" not in data
                else f"has 'format' {data['format']!r}")
        raise PolicyError(f"{source}: not a vllm-nvfp4 policy: it {what}; a policy file starts "
                          f'{{"format": "{POLICY_FORMAT}", "version": {POLICY_VERSION}, ...}}')
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
        unknown = set(entry) - {"index", *TYPE_FIELDS, "k", "v", *SCALE_FIELDS, *CHANNEL_FIELDS,
                                *HEAD_FLAG_FIELDS, "k_rot"}
        if unknown:
            raise PolicyError(f"{where}: unknown keys {sorted(unknown)}")
        try:
            parsed.append(_row_from_entry(entry))
        except PolicyError as e:
            raise PolicyError(f"{where}: {e}") from None
    prov = data.get("provenance", {})
    if not isinstance(prov, dict):
        raise PolicyError(f"{source}: 'provenance' must be an object")
    return tuple(parsed), prov


def _row_from_entry(entry: Mapping[str, Any]) -> LayerPolicy:
    layer_type = LayerType(entry.get("type", "full"), entry.get("window"), entry.get("sinks", False) is True)
    if entry.get("sinks", False) not in (True, False):
        raise PolicyError(f"'sinks' must be true or false, got {entry['sinks']!r}")
    if layer_type.holds_kv and ("k" not in entry or "v" not in entry):
        raise PolicyError(f"needs 'k' and 'v' formats ({'/'.join(KV_FORMATS)})")
    fields = {"k": None, "v": None, **{k: val for k, val in entry.items() if k not in ("index", *TYPE_FIELDS)}}
    return LayerPolicy(**fields, layer_type=layer_type)


def policy_to_dict(layers: Sequence[LayerPolicy], provenance: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object of a policy (the inverse of :func:`layers_from_dict`)."""
    entries = []
    for i, lp in enumerate(layers):
        entry: dict[str, Any] = {"index": i, **lp.layer_type.to_json()}
        for key, val in asdict(lp).items():
            if val is not None and key != "layer_type":
                entry[key] = _to_json(val)
        entries.append(entry)
    return {
        "format": POLICY_FORMAT,
        "version": POLICY_VERSION,
        "num_layers": len(layers),
        "layers": entries,
        "provenance": dict(provenance),
    }


def _to_json(val: Any) -> Any:
    """Tuples (per-head scales, k_smooth rows) as JSON lists, recursively; formats as names;
    objects (``k_rot``, a dict after ``asdict``) key by key."""
    if isinstance(val, KVFormat):
        return val.value
    if isinstance(val, dict):
        return {k: _to_json(v) for k, v in val.items()}
    return [_to_json(v) for v in val] if isinstance(val, tuple) else val


def read_policy_file(path: Path) -> Any:
    """The parsed JSON of a policy file; a missing, unreadable or malformed file raises
    :class:`PolicyError` saying which."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyError(f"policy file {path} does not exist") from None
    except IsADirectoryError:
        raise PolicyError(f"policy file {path} is a directory; give the JSON file") from None
    except OSError as e:
        raise PolicyError(f"cannot read policy file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise PolicyError(f"policy file {path} is not UTF-8 text (not a JSON policy); "
                          f"{FORMAT_DOC}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PolicyError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: "
                          f"{_json_fault(e)}; {FORMAT_DOC}") from None


def _json_fault(e: json.JSONDecodeError) -> str:
    """The decoder's message (without its dangling ``at``) and the text around the fault:
    the :data:`CONTEXT_CHARS` characters before it, quoted (control characters escaped)."""
    msg = e.msg[:-3] if e.msg.endswith(" at") else e.msg
    before, after = e.doc[max(0, e.pos - CONTEXT_CHARS):e.pos], e.doc[e.pos:e.pos + CONTEXT_CHARS]
    if not e.doc.strip():
        return f"{msg} (the file is empty)"
    return f"{msg} after {before!r}" if before else f"{msg} at the start: {after!r}"


def write_policy_file(path: Union[str, Path], data: Mapping[str, Any], overwrite: bool) -> Path:
    """Write ``data`` compactly (one line per vector); refuses to replace an existing file unless
    ``overwrite``."""
    p = Path(path)
    if p.exists() and not overwrite:
        raise FileExistsError(f"{p} exists; refusing to overwrite it (use --force / overwrite=True)")
    p.write_text(json_text.dumps(data) + "\n", encoding="utf-8")
    return p
