"""Progress bars for the long calibration steps (tqdm on stderr; silenced by :func:`set_quiet`).

Inside :func:`single_bar` every :func:`progress` call becomes a stage of ONE bar (``tune``: the
calibration windows, the analysis forwards and the selection's measurement share it): the bar's
total grows by each stage's size as the stage starts, and its postfix names the stage.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterable, Iterator, Optional

from tqdm import tqdm

_QUIET = False
_SHARED: Optional[tqdm] = None


def set_quiet(quiet: bool) -> None:
    """Turn every progress bar of this package off (``True``) or on."""
    global _QUIET
    _QUIET = quiet


def _bar(desc: str, unit: str, total: Optional[int], iterable: Optional[Iterable[Any]] = None) -> tqdm:
    return tqdm(iterable, desc=desc, unit=unit, total=total, file=sys.stderr, disable=_QUIET,
                mininterval=2.0, dynamic_ncols=True, leave=True)


class _Stage:
    """A :func:`progress` call inside :func:`single_bar`: counts into the shared bar."""

    def __init__(self, bar: tqdm, iterable: Optional[Iterable[Any]], desc: str,
                 total: Optional[int]) -> None:
        self.bar, self.iterable, self.desc = bar, iterable, desc
        size = total if total is not None else len(iterable) if hasattr(iterable, "__len__") else 0  # type: ignore[arg-type]
        bar.total = (bar.total or 0) + size
        bar.set_postfix_str(desc)

    def __enter__(self) -> "_Stage":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __iter__(self) -> Iterator[Any]:
        for item in () if self.iterable is None else self.iterable:
            yield item
            self.bar.update(1)

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def set_postfix_str(self, text: str) -> None:
        self.bar.set_postfix_str(f"{self.desc}: {text}")


def progress(iterable: Optional[Iterable[Any]] = None, desc: str = "", unit: str = "it",
             total: Optional[int] = None) -> Any:
    """A tqdm bar on stderr (also when stderr is a log file, refreshed at most every 2 s), or a
    stage of the :func:`single_bar` in force."""
    if _SHARED is not None:
        return _Stage(_SHARED, iterable, desc, total)
    return _bar(desc, unit, total, iterable)


@contextlib.contextmanager
def single_bar(desc: str, unit: str = "step") -> Iterator[tqdm]:
    """Within the block, all :func:`progress` calls advance one bar."""
    global _SHARED
    bar = _bar(desc, unit, total=0)
    _SHARED = bar
    try:
        yield bar
    finally:
        _SHARED = None
        bar.close()
