"""Measurement records: one JSON object per line, appended as each measurement completes.

Every record has ``kind`` (``engine``, ``ttft``, ``decode``, ``profile``, ``bench_serve``,
``skip``, ``error``, ``killed``, ``done``, ``backend_log``), ``t`` (Unix seconds) and, where it
belongs to one engine, ``config``. A line cut by a killed process is skipped when reading.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Optional

RECORDS = "e2e_records.jsonl"


class Recorder:
    """Appends records to one file (flushed and synced at once, so a kill keeps them)."""

    def __init__(self, path: Path, **common: Any) -> None:
        self.path = Path(path)
        self.common = common

    def write(self, kind: str, **fields: Any) -> dict:
        rec = dict(kind=kind, t=round(time.time(), 3), **self.common, **fields)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return rec


def read_records(path: Path) -> list[dict]:
    """All complete records of a file (none when it does not exist)."""
    out = []
    if not Path(path).exists():
        return out
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def latest(records: list[dict], **match: Any) -> Optional[dict]:
    """The last record whose fields equal ``match``: records are in measurement order (earlier
    runs first), so this is the newest measurement."""
    for r in reversed(records):
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def prior_records(paths: Iterable[str | Path]) -> list[dict]:
    """Records of earlier runs, each tagged with ``prior`` = the file it came from."""
    return [dict(r, prior=str(p)) for p in paths for r in read_records(Path(p))]


def merge_records(prior: list[dict], now: list[dict], measured_now: Iterable[str],
                  served_now: Iterable[str] = (), contexts_now: Optional[Iterable[int]] = None
                  ) -> list[dict]:
    """Earlier runs' records, then this run's.

    An engine configuration measured again now (in ``measured_now`` or with an engine record in
    ``now``) drops its earlier engine-side records: all of them, or with ``contexts_now`` only
    those of a context measured now and those without a context (a run at 128k keeps the same
    configuration's 8k records of an earlier run). Its earlier ``bench_serve`` records stay unless
    it is served again now (``served_now``).
    """
    fresh = {r.get("config") for r in now if r["kind"] == "engine"} | set(measured_now)
    served = set(served_now)
    ctxs = None if contexts_now is None else set(contexts_now)

    def replaced(r: dict) -> bool:
        if r.get("config") not in fresh:
            return False
        return ctxs is None or "context" not in r or r["context"] in ctxs

    old = [r for r in prior
           if (r["kind"] == "bench_serve" and r.get("config") not in served)
           or (r["kind"] != "bench_serve" and not replaced(r))]
    return old + now
