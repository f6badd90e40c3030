"""Ratios against fp8, optional targets from a TOML file, and the table printed at the end.

Targets file (``--targets``; see ``targets.toml`` beside this module)::

    [[target]]
    name = "decode_32k"           # any label
    metric = "decode_vs_fp8"      # capacity_vs_fp8 | decode_vs_fp8 | ttft_vs_fp8
    config = "nvfp4-mixed"
    context = 32768               # decode: required; ttft: optional (default: the worst context)
    min = 1.3                     # and/or max = ...
    preset = "llama8b"            # optional: checked only on runs of this --preset
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from benchmarks.e2e.records import latest

METRICS = ("capacity_vs_fp8", "decode_vs_fp8", "ttft_vs_fp8")
FP8_CONFIGS = ("fp8", "fp8-triton")  # the decode comparison takes the faster of the two


def ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
    return round(x / y, 3) if x is not None and y not in (None, 0) else None


def load_targets(path: Optional[str | Path]) -> list[dict]:
    """The ``[[target]]`` tables of a TOML file, validated (``[]`` for no file)."""
    if path is None:
        return []
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomli is the same parser (setup.py installs it there)
        import tomli as tomllib
    data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    targets = data.get("target", [])
    for t in targets:
        where = f"{path}: target {t.get('name', '?')!r}"
        if t.get("metric") not in METRICS:
            raise ValueError(f"{where}: metric must be one of {METRICS}, got {t.get('metric')!r}")
        if "config" not in t or not ({"min", "max"} & set(t)):
            raise ValueError(f"{where}: needs 'config' and at least one of 'min' / 'max'")
        if t["metric"] == "decode_vs_fp8" and "context" not in t:
            raise ValueError(f"{where}: decode_vs_fp8 needs a 'context' (tokens)")
    return targets


def compute_ratios(records: list[dict], contexts: list[int]) -> dict[str, Any]:
    """Each configuration against fp8 from the newest record of each kind.

    ``capacity_vs_fp8``: KV tokens / fp8's. ``decode_vs_fp8[context]``: decode tokens/s at fp8's
    largest batch (the configuration's ``ref`` stage) / the faster fp8 configuration's, plus the
    same at the configuration's own largest batch. ``ttft_vs_fp8[context]``: TTFT / fp8's.
    """
    eng = {r["config"]: r for r in records if r["kind"] == "engine"}
    dec = [r for r in records if r["kind"] == "decode"]
    ttft = {(r["config"], r["context"]): r["ttft_s"] for r in records if r["kind"] == "ttft"}
    out: dict[str, Any] = {"capacity_vs_fp8": {}, "decode_vs_fp8": {}, "ttft_vs_fp8": {}}
    fp8_cap = eng.get("fp8", {}).get("capacity_tokens")
    for name, e in eng.items():
        out["capacity_vs_fp8"][name] = ratio(e["capacity_tokens"], fp8_cap)
    for c in contexts:
        fp8_ref = list({d["config"]: d for d in dec if d["config"] in FP8_CONFIGS
                        and "ref" in d["label"] and d["context"] == c}.values())
        if not fp8_ref:
            continue
        b = fp8_ref[0]["batch"]
        best = max(fp8_ref, key=lambda d: d["tok_per_s"] or 0)
        row: dict[str, Any] = dict(batch=b, best_fp8=best["config"], best_fp8_tok_per_s=best["tok_per_s"])
        for name in dict.fromkeys(d["config"] for d in dec if d["config"] not in FP8_CONFIGS):
            same = [d for d in dec if d["config"] == name and d["context"] == c
                    and ("ref" in d["label"] or d["batch"] == b)]
            if same:
                row[name] = ratio(same[-1]["tok_per_s"], best["tok_per_s"])
                if same[-1]["batch"] != b:  # its estimate of fp8's batch differed from fp8's own
                    row[f"{name}_batch"] = same[-1]["batch"]
            own = [d for d in dec if d["config"] == name and d["context"] == c and "max" in d["label"]]
            if own:
                row[f"{name}_at_own_max_batch"] = dict(
                    batch=own[-1]["batch"], tok_per_s=own[-1]["tok_per_s"],
                    vs_best_fp8=ratio(own[-1]["tok_per_s"], best["tok_per_s"]))
        out["decode_vs_fp8"][str(c)] = row
    for c in contexts:
        base = ttft.get(("fp8", c))
        names = dict.fromkeys(n for n, cc in ttft if cc == c)
        out["ttft_vs_fp8"][str(c)] = {n: ratio(ttft[(n, c)], base) for n in names}
    return out


def check_targets(ratios: dict[str, Any], targets: list[dict], preset: Optional[str] = None
                  ) -> dict[str, dict]:
    """name -> {value, min/max, met}; ``met`` is None when the value was not measured. Targets
    with a ``preset`` apply only to runs of that preset (``preset`` None: a ``--model`` run)."""
    out = {}
    for t in targets:
        if "preset" in t and t["preset"] != preset:
            continue
        name, cfg, m = t.get("name", t["metric"]), t["config"], t["metric"]
        if m == "capacity_vs_fp8":
            value = ratios[m].get(cfg)
        elif m == "decode_vs_fp8":
            value = ratios[m].get(str(t["context"]), {}).get(cfg)
        elif "context" in t:
            value = ratios[m].get(str(t["context"]), {}).get(cfg)
        else:  # the worst (largest) TTFT ratio over the measured contexts
            vals = [v[cfg] for v in ratios[m].values() if v.get(cfg) is not None]
            value = max(vals) if vals else None
        met = None if value is None else (value >= t.get("min", value) and value <= t.get("max", value))
        out[name] = dict({k: t[k] for k in ("min", "max") if k in t}, value=value, met=met)
    return out


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}"


def summary_table(records: list[dict], ratios: dict, targets: dict[str, dict]) -> str:
    """The short table printed last: per configuration and context, engine start, KV tokens,
    capacity vs fp8, TTFT and the decode stages (``batch:tok/s(ms/token)``), then errors,
    ``vllm bench serve`` results and targets."""
    lines = [f"{'config':12s} {'start':>6s} {'KV tokens':>10s} {'cap/fp8':>7s}  "
             f"{'ctx':>6s} {'TTFT ms':>8s}  decode batch:tok/s(ms/tok)"]
    eng = {r["config"]: r for r in records if r["kind"] == "engine"}
    for name in dict.fromkeys(r["config"] for r in records if r["kind"] in ("engine", "ttft", "decode")):
        e = eng.get(name)
        ctxs = sorted({r["context"] for r in records if r.get("config") == name and "context" in r}) or [None]
        for i, c in enumerate(ctxs):
            tt = latest(records, kind="ttft", config=name, context=c)
            decs = [r for r in records if r["kind"] == "decode" and r["config"] == name and r["context"] == c]
            d = " ".join(f"{r['batch']}:{r['tok_per_s']:.0f}({r['tpot_ms']:.1f})" for r in decs)
            if e and i == 0:
                cap = ratios["capacity_vs_fp8"].get(name) or float("nan")
                head = f"{name:12s} {e['engine_start_s']:6.0f} {e['capacity_tokens']:10d} {cap:7.3f}"
            else:
                head = f"{name if i == 0 else '':12s} {'':6s} {'':10s} {'':7s}"
            ttft_ms = 1000 * tt["ttft_s"] if tt else float("nan")
            lines.append(f"{head}  {c if c else '-':>6} {ttft_ms:8.1f}  {d}")
    for r in records:
        if r["kind"] in ("error", "killed"):
            why = str(r.get("error", r.get("reason", "")))[:150]
            lines.append(f"{r.get('config', '?'):12s} {r['kind'].upper()}: {r.get('what', '')} {why}")
        if r["kind"] == "bench_serve":
            v = {k: _num(r.get(k)) for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                              "median_tpot_ms", "median_e2el_ms")}
            lines.append(f"serve {r['config']}: {r.get('completed')} requests, "
                         f"{v['output_throughput']} output tok/s, TTFT median/p99 "
                         f"{v['median_ttft_ms']}/{v['p99_ttft_ms']} ms, TPOT median "
                         f"{v['median_tpot_ms']} ms, E2E median {v['median_e2el_ms']} ms")
    for name, t in targets.items():
        bounds = " ".join(f"{k} {t[k]}" for k in ("min", "max") if k in t)
        lines.append(f"target {name}: value {t['value']} ({bounds}) met {t['met']}")
    return "\n".join(lines)
