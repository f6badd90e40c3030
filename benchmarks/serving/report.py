"""Summary tables of a serving run: one row per configuration and run, ratios to the reference
(fp8 where it ran, else the first configuration), the rate search's answer per configuration,
and the markdown the run prints and writes."""

from __future__ import annotations

from typing import Any, Optional

from benchmarks.e2e.report import ratio
from benchmarks.serving import rate_search
from benchmarks.serving.workloads import rate_label, run_key

#: (record field, column title) of the per-run table
COLUMNS = (("output_throughput", "output tok/s"), ("request_throughput", "req/s"),
           ("p50_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
           ("p50_tpot_ms", "TPOT p50 ms"), ("p99_tpot_ms", "TPOT p99 ms"))
#: (ratio name, record field) against the reference at the same run
RATIOS = (("output_tok_s_vs_ref", "output_throughput"), ("ttft_p50_vs_ref", "p50_ttft_ms"),
          ("tpot_p99_vs_ref", "p99_tpot_ms"))
PREFERRED_REFERENCE = "fp8"


def merge(prior: list[dict], now: list[dict]) -> list[dict]:
    """Earlier runs' records, then this run's: a record of this run replaces the earlier ones of
    the same configuration, kind and label (a run of one concurrency level keeps the others), and
    a run's skip goes where another run measured it."""
    def key(r: dict) -> tuple:
        return r.get("config"), r["kind"], run_key(r.get("label"))

    fresh = {key(r) for r in now}
    merged = [r for r in prior if key(r) not in fresh] + now
    measured = {(r["config"], run_key(r["label"])) for r in merged if r["kind"] == "bench"}
    return [r for r in merged if r["kind"] != "skip" or (r.get("config"), run_key(r.get("label"))) not in measured]


def measured_labels(records: list[dict]) -> dict[str, set[str]]:
    """Per configuration, the labels of the runs ``records`` hold a result of (``bench`` records)."""
    out: dict[str, set[str]] = {}
    for r in records:
        if r["kind"] == "bench":
            out.setdefault(r["config"], set()).add(r["label"])
    return out


def reference(records: list[dict]) -> Optional[str]:
    names = list(dict.fromkeys(r["config"] for r in records if r["kind"] == "bench"))
    return PREFERRED_REFERENCE if PREFERRED_REFERENCE in names else (names[0] if names else None)


def rate_probes(records: list[dict]) -> dict[str, tuple[dict, dict[str, tuple[float, bool]]]]:
    """Per configuration with a rate search: the objective of its newest search (of its newest
    probe where a search was cut off before its ``rate_search`` record) and every probe under that
    objective, of this run and of merged earlier ones (label -> (rate, passed); a rate probed
    again keeps the newest result)."""
    objectives = {r["config"]: r["objective"] for r in records
                  if r["kind"] in ("rate_search", "rate_probe") and r.get("config")}
    out: dict[str, tuple[dict, dict[str, tuple[float, bool]]]] = {
        cfg: (obj, {}) for cfg, obj in objectives.items()}
    for r in records:
        if r["kind"] == "rate_probe" and r.get("config") in out and r.get("objective") == objectives[r["config"]]:
            out[r["config"]][1][run_key(r["label"])] = (r["rate"], r["passed"])
    return out


def tables(records: list[dict]) -> dict[str, Any]:
    """``reference``, ``runs`` (newest result per configuration and label, with ratios) and
    ``rate_search`` (per configuration: highest rate within the objective, vs the reference,
    and TTFT p50 at that rate)."""
    ref = reference(records)
    latest = {(r["config"], run_key(r["label"])): r for r in records if r["kind"] == "bench"}
    runs = []
    for (cfg, label), r in latest.items():
        row = dict(config=cfg, label=label, workload=r["workload"],
                   **{k: r.get(k) for k in ("concurrency", "prefix_len", "rate", "completed",
                                            "failed", "preemptions", "wall_s")},
                   **{k: r.get(k) for k, _ in COLUMNS})
        base = latest.get((ref, label))
        for name, field in RATIOS:
            row[name] = ratio(r.get(field), base.get(field)) if base else None
        runs.append(row)
    rates: dict[str, Any] = {}
    for cfg, (objective, probes) in rate_probes(records).items():
        s = rate_search.summarize({rate: ok for rate, ok in probes.values()})
        at = latest.get((cfg, rate_label(s["max_rate"]))) if s["max_rate"] else None
        rates[cfg] = dict(s, objective=objective,
                          p50_ttft_ms_at_max_rate=at.get("p50_ttft_ms") if at else None,
                          p99_tpot_ms_at_max_rate=at.get("p99_tpot_ms") if at else None)
    for cfg, row in rates.items():
        base = rates.get(ref)
        row["max_rate_vs_ref"] = ratio(row["max_rate"], base["max_rate"]) if base else None
        row["ttft_p50_vs_ref"] = ratio(row["p50_ttft_ms_at_max_rate"],
                                       base["p50_ttft_ms_at_max_rate"]) if base else None
    return dict(reference=ref, runs=runs, rate_search=rates)


def _cell(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def markdown(summary: dict) -> str:
    """The tables of :func:`tables` (and skips / errors) as markdown."""
    ref = summary.get("reference")
    head = ["run", "config"] + [t for _, t in COLUMNS] + ["preemptions"] + [
        f"{n.split('_vs_')[0]} / {ref}" for n, _ in RATIOS]
    lines = [f"Serving: `vllm bench serve` against `vllm serve` (reference {ref})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(summary["runs"], key=lambda r: (r["workload"], r["concurrency"] or 0, r["prefix_len"] or 0,
                                                    r["rate"] or 0, r["label"], r["config"] != ref)):
        cells = [r["label"], r["config"]] + [r[k] for k, _ in COLUMNS] + [r["preemptions"]] + [
            r[n] for n, _ in RATIOS]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if summary["rate_search"]:
        lines += ["", "| config | highest rate within the objective (req/s) | lowest failing | probes | "
                  f"vs {ref} | TTFT p50 ms there | TTFT p50 vs {ref} |", "|---|---|---|---|---|---|---|"]
        for cfg, s in summary["rate_search"].items():
            cells = [cfg, s["max_rate"], s["lowest_failing_rate"], s["probes"], s["max_rate_vs_ref"],
                     s["p50_ttft_ms_at_max_rate"], s["ttft_p50_vs_ref"]]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        obj = next(iter(summary["rate_search"].values()))["objective"]
        lines.append(f"\nObjective: p99 TPOT <= {obj['p99_tpot_ms']} ms"
                     + (f", p99 TTFT <= {obj['p99_ttft_ms']} ms" if obj.get("p99_ttft_ms") else ""))
    notes = [r for r in summary["records"] if r["kind"] in ("skip", "error")]
    if notes:
        lines += [""] + [f"- {r['config']} {r['kind']}: {r.get('label', r.get('what', ''))} "
                         f"{r.get('reason', r.get('error', ''))}" for r in notes]
    return "\n".join(lines) + "\n"
