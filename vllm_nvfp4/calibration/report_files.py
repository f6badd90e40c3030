"""Reading the JSON files of a report directory, with errors that name the file and the fault."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ReportError(ValueError):
    """A report-directory file that is missing, malformed or incomplete; the message names it."""


def read_json(path: Path) -> Any:
    """Parsed JSON of a report-directory file; :class:`ReportError` names the file and the fault."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg} "
                          "(truncated? re-run the command that wrote it)") from None


def check_schema(obj: Any, schema: dict[str, Any], path: Path, prefix: str = "") -> None:
    """Raise :class:`ReportError` naming the first key of ``schema`` that ``obj`` lacks or types
    wrongly. ``schema`` maps keys to a type (``float``: any number) or a nested schema;
    ``prefix`` is the key path so far, e.g. ``layers[2].``."""
    for key, kind in schema.items():
        if not isinstance(obj, dict) or key not in obj:
            raise ReportError(f"{path}: {prefix}{key} is missing (truncated or edited? re-run the "
                              "command that wrote it)")
        value = obj[key]
        if isinstance(kind, dict):
            check_schema(value, kind, path, f"{prefix}{key}.")
            continue
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok:
            raise ReportError(f"{path}: {prefix}{key} must be "
                              f"{'a number' if kind is float else kind.__name__}, got {value!r:.60}")
