#!/usr/bin/env python
"""Does a Hadamard rotation along head_dim before quantization make NVFP4 K/V more accurate (CPU)?

    python -m studies.rotation_study STEP MODEL TEXT --out DIR [--window 512]
        [--analysis-windows 2] [--heldout-windows 4] [--budget 0.62] [--dtype float32]
        [--heldout-skip 0] [--kinds hadamard,hadamard16,random_hadamard] [--sweep-kind hadamard]
        [--sweep-rotate k]

STEP ``heldout``: on held-out windows, against the unquantized cache: calibrated all-FP8,
calibrated all-NVFP4, and for each rotation kind all-NVFP4 with K rotated and with K and V
rotated (:mod:`studies.rotation`; scales and K centering calibrated on the rotated vectors),
plus all-FP8 with K and V rotated; writes ``DIR/heldout.json`` (``heldout_skipN.json``).
STEP ``sweep``: ``analyze``'s default sweep (from all-FP8, each K/V slot alone to NVFP4) with
every layer's K (``--sweep-rotate k``) or K and V (``kv``) rotated by ``--sweep-kind``, on the
analysis windows; ``DIR/sweep_<kind>_<k|kv>.json``.
STEP ``perlayer`` (after ``sweep``, K rotated): K rotated only in the layers where the sweep's
marginal KL of that K slot in NVFP4 is below the unrotated sweep's, all-NVFP4 and at
``--budget`` (FP8 slots ranked by the marginal of each slot's chosen variant);
``DIR/perlayer_<kind>_k.json`` (``..._skipN.json``).
STEP ``mix`` (after both): the ``--budget`` selection by KL from that sweep (the slots ``select``
keeps in FP8) with the same slots rotated, and the selection from the unrotated sweep
``--plain-sweep`` (``analyze``'s sweep_fp8.json) rotated alike and unrotated; each with its top-1
gap recovery ``(x - all-NVFP4) / (all-FP8 - all-NVFP4)`` against the *unrotated* all-NVFP4 and
all-FP8 of the held-out step's JSON; writes ``DIR/mix_<kind>_<k|kv>.json`` (``..._skipN.json``).

Windows as ``studies/sweep_base_study.py``: calibration = the first window of TEXT, analysis =
the next ``--analysis-windows``, held-out = the last ``--heldout-windows`` windows of TEXT's
final 50,000 characters (``--heldout-skip`` windows before the end: another held-out set).
Transformers with the cache fake-quantized
(:mod:`vllm_nvfp4.calibration.kv_hooks`), K centering on, one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

from studies.common import load_study, recovery, row, study_parser, with_fp8_slots

REPO = Path(__file__).resolve().parents[1]  # for the default --plain-sweep


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from vllm_nvfp4.calibration.evaluator import Evaluator
    from studies.kv_options import KVRotation
    from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy
    from vllm_nvfp4.calibration.selection import fp8_slots_for_budget
    from vllm_nvfp4.calibration.sensitivity import all_format, downgrade
    from vllm_nvfp4.policy import KVPolicy
    from studies.rotation import ROTATIONS

    ap = study_parser(__doc__, ("heldout", "sweep", "mix", "perlayer"))
    ap.add_argument("--heldout-skip", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(ROTATIONS))
    ap.add_argument("--sweep-kind", default="hadamard", choices=ROTATIONS)
    ap.add_argument("--sweep-rotate", default="k", choices=("k", "kv"))
    ap.add_argument("--plain-sweep", type=Path,
                    default=REPO / "results/2026-12-01-sweep-base-smollm2-cpu/sweep_fp8.json")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    w = a.window
    model, info, head, tail = load_study(a.model, a.text, a.dtype)
    calib = torch.tensor(head[:w]).view(1, w)
    layers = info.num_layers
    end = len(tail) - w * a.heldout_skip
    heldout = torch.tensor(tail[end - w * a.heldout_windows:end]).view(a.heldout_windows, w)
    skip = f"_skip{a.heldout_skip}" if a.heldout_skip else ""
    heldout_file = a.out / f"heldout{skip}.json"
    fp8_formats = KVPolicy.from_compact("*:fp8", layers, layer_types=info.layer_types)

    def calibrated(rotation: Optional[KVRotation]) -> KVPolicy:
        """All-FP8 with scales and K centering calibrated on the (rotated) K/V."""
        obs = observe_amax(model, calib, layers, kv_layers=info.kv_layers,
                           options=() if rotation is None else (rotation,))
        return scaled_policy(fp8_formats, obs, False, {}, None, True)

    plain = calibrated(None)

    def rotated(kind: str, v: bool) -> tuple[KVRotation, KVPolicy]:
        """Every layer's K (and V when ``v``) rotated, with its scales from the rotated vectors."""
        rot = KVRotation.every_layer(kind, layers, k=True, v=v)
        scaled = calibrated(rot)
        if not v:  # V unrotated: its scales from the plain calibration
            scaled = KVPolicy(tuple(replace(r, v_scale=p.v_scale, v_global_scale=p.v_global_scale)
                                    for r, p in zip(scaled.layers, plain.layers)),
                              source="calibration")
        return rot, scaled

    if a.step == "heldout":
        ev = Evaluator(model, heldout, reuse_prefix=False)
        ev.reference()
        out: dict[str, Any] = {"all_fp8": ev.measure(all_format(plain, "fp8")).to_dict(),
                               "all_nvfp4": ev.measure(all_format(plain, "nvfp4")).to_dict()}
        for name in ("all_fp8", "all_nvfp4"):
            print(row(name, out[name]), flush=True)
        for kind in a.kinds.split(","):
            for v, fmts in ((False, ("nvfp4",)), (True, ("nvfp4", "fp8"))):
                rot, scaled = rotated(kind, v)
                ev.options = (rot,)
                for fmt in fmts:
                    name = f"all_{fmt}_{kind}_{'kv' if v else 'k'}"
                    m = ev.measure(all_format(scaled, fmt)).to_dict()
                    m.update(recovery(m, out["all_fp8"], out["all_nvfp4"]))
                    out[name] = m
                    print(row(name, m) + f"  gap recovery {m['top1_gap_recovery']:.0%}", flush=True)
                ev.options = ()
        summary = {"model": str(a.model), "text": str(a.text), "window": w,
                   "heldout_windows": a.heldout_windows, "heldout_skip": a.heldout_skip,
                   "k_center": True, "configs": out}
        heldout_file.write_text(json.dumps(summary, indent=1) + "\n")
        return 0

    rot, scaled = rotated(a.sweep_kind, a.sweep_rotate == "kv")
    tag = f"{a.sweep_kind}_{a.sweep_rotate}"
    if a.step == "sweep":
        windows = torch.tensor(head[w:w * (1 + a.analysis_windows)]).view(a.analysis_windows, w)
        ev = Evaluator(model, windows, options=(rot,))
        ev.reference()
        base = all_format(scaled, "fp8")
        result: dict[str, Any] = {"kind": a.sweep_kind, "rotated": a.sweep_rotate, "base": ev.set_baseline(base).to_dict(),
                                  "slots": {}}
        t0 = time.time()
        for i in info.kv_layers:
            for kv in ("k", "v"):
                result["slots"][f"{i}{kv}"] = ev.measure(downgrade(base, i, kv)).to_dict()
            print(f"  layer {i} done, {time.time() - t0:.0f} s", flush=True)
        (a.out / f"sweep_{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
        return 0

    n = fp8_slots_for_budget(layers, a.budget)

    def by_kl(sweep: dict[str, Any]) -> list[str]:
        """The at most ``n`` slots whose NVFP4 raises KL most above the all-FP8 base."""
        b = sweep["base"]["kl"]
        score = {s: m["kl"] - b for s, m in sweep["slots"].items()}
        return [s for s in sorted(score, key=lambda s: -score[s])[:n] if score[s] > 0]

    held = json.loads(heldout_file.read_text())["configs"]
    f8, n4 = held["all_fp8"], held["all_nvfp4"]
    ev = Evaluator(model, heldout, reuse_prefix=False)
    ev.reference()
    out = {}
    if a.step == "perlayer":
        return _per_layer(a, ev, plain, scaled, n, f8, n4, tag, skip)
    for name, sweep_file, rotation in (("rotated_sweep", a.out / f"sweep_{tag}.json", rot),
                                       ("plain_sweep", a.plain_sweep, rot),
                                       ("plain_sweep_unrotated", a.plain_sweep, None)):
        slots = by_kl(json.loads(sweep_file.read_text()))
        p = with_fp8_slots(all_format(plain if rotation is None else scaled, "nvfp4"), slots)
        ev.options = () if rotation is None else (rotation,)
        m = ev.measure(p).to_dict()
        m.update(recovery(m, f8, n4), slots=slots, policy=p.to_compact(),
                 fraction_of_fp8=round(p.fraction_of_fp8(), 6))
        out[f"mix_{tag}_{name}"] = m
        print(row(name, m) + f"  gap recovery {m['top1_gap_recovery']:.0%}  slots {slots}", flush=True)
    summary = {"model": str(a.model), "text": str(a.text), "window": w, "budget": a.budget,
               "fp8_slots": n, "heldout_skip": a.heldout_skip, "rotation": a.sweep_kind, "rotated": a.sweep_rotate, "configs": out}
    (a.out / f"mix_{tag}{skip}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def _per_layer(a: argparse.Namespace, ev: Any, plain: Any, scaled: Any, n: int, f8: dict[str, Any],
               n4: dict[str, Any], tag: str, skip: str) -> int:
    """The ``perlayer`` step (module doc): per-layer choice of K rotation from the two sweeps."""
    from studies.kv_options import KVRotation
    from vllm_nvfp4.calibration.sensitivity import all_format
    from vllm_nvfp4.policy import KVPolicy

    if a.sweep_rotate != "k":
        raise SystemExit("perlayer chooses K rotation per layer: use --sweep-rotate k")
    rot_sweep = json.loads((a.out / f"sweep_{tag}.json").read_text())
    plain_sweep = json.loads(a.plain_sweep.read_text())

    def marginal(sweep: dict[str, Any], slot: str) -> float:
        return sweep["slots"][slot]["kl"] - sweep["base"]["kl"]

    chosen = sorted(int(s[:-1]) for s in plain_sweep["slots"]
                    if s.endswith("k") and marginal(rot_sweep, s) < marginal(plain_sweep, s))
    score = {s: marginal(rot_sweep if s.endswith("k") and int(s[:-1]) in chosen else plain_sweep, s)
             for s in plain_sweep["slots"]}
    fp8_slots = [s for s in sorted(score, key=lambda s: -score[s])[:n] if score[s] > 0]
    mixed = KVPolicy(tuple(r if i in chosen else p for i, (r, p) in
                           enumerate(zip(scaled.layers, plain.layers))), source="calibration")
    ev.options = (KVRotation(a.sweep_kind, frozenset(chosen), frozenset()),)
    out: dict[str, Any] = {}
    nv = all_format(mixed, "nvfp4")
    mix = with_fp8_slots(nv, fp8_slots)
    for name, p in (("all_nvfp4", nv), ("mix", mix)):
        m = ev.measure(p).to_dict()
        m.update(recovery(m, f8, n4), policy=p.to_compact(), fraction_of_fp8=round(p.fraction_of_fp8(), 6))
        out[f"perlayer_{tag}_{name}"] = m
        print(row(name, m) + f"  gap recovery {m['top1_gap_recovery']:.0%}", flush=True)
    summary = {"model": str(a.model), "text": str(a.text), "window": a.window, "budget": a.budget,
               "heldout_skip": a.heldout_skip, "rotation": a.sweep_kind, "k_rotated_layers": chosen,
               "fp8_slots": fp8_slots, "configs": out}
    print(f"K rotated in layers {chosen}; FP8 slots {fp8_slots}", flush=True)
    (a.out / f"perlayer_{tag}{skip}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
