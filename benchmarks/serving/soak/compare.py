"""Compare each request's greedy output under pressure / speculation with the same request served
alone, per configuration.

A request mismatches when its tokens differ from the alone pass's. For each mismatch the report
gives the first differing position and the alone pass's log-prob margin there (top-1 minus
runner-up): a margin below ``tie_nats`` is a near tie, where any change of rounding (batch shape,
chunking, cached versus recomputed prefix) may flip the choice. Bad outputs: no tokens, fewer than
``max_tokens``, a NaN / missing log-prob, or a finish other than ``length``.

Where the tokens match, the log-probs (chosen token and runner-up at every position) say how close
the two servings were: bit-identical, or apart by the largest absolute difference in nats. Batch
shape and chunking change rounding, so small differences are expected; a KV cache block read
wrong after preemption or a prefix hit would move them far more.
"""

from __future__ import annotations

from typing import Any, Optional

from benchmarks.serving.soak.requests import SoakRequest


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """Index of the first differing token (the shorter length if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def margin(out: dict, pos: int) -> Optional[float]:
    """Log-prob of the chosen token minus the runner-up's at ``pos`` (None: not recorded)."""
    if pos >= len(out["lp"]):
        return None
    own, other = out["lp"][pos]
    return None if own is None or other is None else round(own - other, 5)


def logprob_distance(a: dict, b: dict) -> float:
    """Largest absolute difference between two outputs' log-prob rows (nats; same tokens)."""
    return max((abs(x - y) for ra, rb in zip(a["lp"], b["lp"]) for x, y in zip(ra, rb)), default=0.0)


def bad_output(out: dict, req: SoakRequest) -> Optional[str]:
    """Why an output is unusable (None: it is fine)."""
    if not out["tokens"]:
        return "empty"
    if len(out["tokens"]) != req.max_tokens or out["finish"] != "length":
        return f"{len(out['tokens'])} of {req.max_tokens} tokens, finish {out['finish']}"
    if any(own is None for own, _ in out["lp"]) or len(out["lp"]) != len(out["tokens"]):
        return "NaN or missing log-prob"
    return None


def compare(reqs: list[SoakRequest], alone: dict[int, dict], tested: dict[str, dict[int, dict]],
            tie_nats: float) -> dict[str, Any]:
    """Per pass of ``tested`` (mode -> id -> output) against ``alone`` (id -> output): requests
    compared, mismatches (with position, margins, near tie, prefix / spec flags), of the matching
    ones how many have bit-identical log-probs and the largest log-prob difference, bad outputs
    (in either pass), requests still missing."""
    by_id = {r.id: r for r in reqs}
    out: dict[str, Any] = {}
    bad_alone = {i: why for i, o in alone.items() if (why := bad_output(o, by_id[i]))}
    for mode, outs in tested.items():
        mism, bad, distances = [], [], []
        compared = 0
        for i, o in sorted(outs.items()):
            why = bad_output(o, by_id[i])
            if why:
                bad.append(dict(id=i, why=why))
            if i not in alone or why or i in bad_alone:
                continue
            compared += 1
            pos = first_difference(o["tokens"], alone[i]["tokens"])
            if pos is None:
                distances.append(logprob_distance(o, alone[i]))
                continue
            m_ref = margin(alone[i], pos)
            r = by_id[i]
            mism.append(dict(id=i, position=pos, prompt_len=len(r.prompt), max_tokens=r.max_tokens,
                             shared_prefix=r.prefix >= 0, spec=r.spec, alone_margin=m_ref,
                             tested_margin=margin(o, pos),
                             near_tie=m_ref is not None and m_ref < tie_nats))
        expected = {r.id for r in reqs if (r.spec if mode == "spec" else not r.spec)}
        out[mode] = dict(compared=compared, mismatched=len(mism),
                         mismatched_near_tie=sum(m["near_tie"] for m in mism),
                         mismatched_shared_prefix=sum(m["shared_prefix"] for m in mism),
                         logprobs_identical=sum(d == 0 for d in distances),
                         max_logprob_diff=round(max(distances, default=0.0), 6),
                         bad_outputs=bad, missing=len(expected - set(outs)),
                         missing_alone=len(expected - set(alone)), mismatches=mism)
    out["alone_bad_outputs"] = [dict(id=i, why=w) for i, w in sorted(bad_alone.items())]
    return out
