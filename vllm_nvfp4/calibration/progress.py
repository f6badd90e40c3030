"""Progress bars for the long calibration steps (tqdm on stderr; silenced by :func:`set_quiet`)."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

from tqdm import tqdm

_QUIET = False


def set_quiet(quiet: bool) -> None:
    """Turn every progress bar of this package off (``True``) or on."""
    global _QUIET
    _QUIET = quiet


def progress(iterable: Optional[Iterable[Any]] = None, desc: str = "", unit: str = "it",
             total: Optional[int] = None) -> tqdm:
    """A tqdm bar on stderr (also when stderr is a log file, refreshed at most every 2 s)."""
    return tqdm(iterable, desc=desc, unit=unit, total=total, file=sys.stderr, disable=_QUIET,
                mininterval=2.0, dynamic_ncols=True, leave=True)
