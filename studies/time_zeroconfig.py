#!/usr/bin/env python
"""Time the zero-config start and the offline analysis at a real model size (GPU).

    python -m studies.time_zeroconfig startup --out OUT [--preset llama8b]
    python -m studies.time_zeroconfig analyze --out OUT [--preset llama8b] [--device cuda]

``startup``: a weight-less Llama-3.1-8B-shaped model (:func:`vllm_nvfp4.testing.weightless.
build_weightless_model`, ``load_format="dummy"``) is started with ``kv_cache_dtype="nvfp4_mixed"``
and no policy, each start in a fresh process, ``--repeats`` rounds of: start-up calibration off,
on with an empty cache (it calibrates), on again (it reuses the cache). ``--warm-ups N`` adds N
first starts that calibrate, so that vLLM's compile cache and Triton's cache hold every kernel the
timed starts use (the selected policy may mix K/V formats the default rule never uses). Use 2: the
first start on a machine runs Inductor, which points ``TRITON_CACHE_DIR`` at its own folder, so the
second start (model loaded from vLLM's compile cache, Triton at ``~/.triton/cache``) compiles the
Triton kernels again (H200: 53 kernels, ~50 s; ``--log-compiles`` shows each). Writes
``OUT/startup.json`` (after every start): each ``LLM()`` wall time with the calibration's own
logged time, greedy tokens and KV-cache capacity (each start's own log lines: ``OUT/KIND_ROUND.log``), the median of each kind, ``added_s`` (the
medians' differences) and ``calibrating_vs_cached`` (a calibrating start serves the same tokens
with the same KV capacity as the cached start of the same policy).

``analyze``: the same shape with random bf16 weights saved as safetensors (``OUT/model``, 16 GB
for the 8B preset), then ``vllm-nvfp4 analyze`` on the built-in text with its default windows
(2 x 2048 scored, 1 calibration window; ``--windows`` fewer, with the default's wall time
extrapolated from the scored forwards' time) on ``--device``. Writes ``OUT/analyze.json`` (wall time,
the report's own time), the command's output in ``OUT/analyze_cli.log`` and the report in
``OUT/analysis``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from vllm_nvfp4.testing.weightless import PRESETS

DEFAULT_WINDOWS = 2  # `vllm-nvfp4 analyze --windows` default
CALIBRATED = re.compile(r"calibrated at start-up on (\d+) tokens in ([\d.]+) s")
#: the lines of an engine's log kept per start: ours, and vLLM's start-up phases
TIMING_LINE = re.compile(r"vllm-nvfp4|compil|graph|profil|KV cache|memory|took|seconds|Error")
REUSED = re.compile(r"start-up calibration reused from \S+ \((\d+) tokens; ([\d.]+) s\)")


def log(msg: str) -> None:
    print(f"[time_zeroconfig {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- start-up
def startup_child(model: str, max_model_len: int) -> None:
    """One engine start (runs in its own process); prints ``RESULT {json}``."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, kv_cache_dtype="nvfp4_mixed", load_format="dummy",
              max_model_len=max_model_len, seed=0)
    start = time.perf_counter() - t0
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    cc = llm.llm_engine.vllm_config.cache_config
    print("RESULT " + json.dumps({"llm_start_s": round(start, 2),
                                  "token_ids": list(out[0].outputs[0].token_ids),
                                  "kv_tokens": int(cc.num_gpu_blocks) * int(cc.block_size)}),
          flush=True)


#: a ``sitecustomize`` that logs every Triton kernel compile (cache hit or not) of every process
COMPILE_LOGGER = """
import sys, time
try:
    from triton import knobs
except ImportError:
    knobs = None

def _log(*, src, metadata, metadata_group, times, cache_hit):
    names = getattr(getattr(src, "fn", None), "arg_names", None) or []
    small = {}
    for key, value in (getattr(src, "constants", {}) or {}).items():
        i = key[0] if isinstance(key, tuple) else key
        if isinstance(value, (int, bool)) and isinstance(i, int) and i < len(names):
            small[names[i]] = int(value)
    where = next(iter(metadata_group.values()), "?").rsplit("/", 2)[0]
    print(f"triton-compile {time.strftime('%H:%M:%S')} {metadata.get('name', '?')} "
          f"hit={int(cache_hit)} ms={times.total / 1e3:.0f} warps={metadata.get('num_warps')} "
          f"dir={where} const={small}"[:400], file=sys.stderr, flush=True)

if knobs is not None:
    knobs.compilation.listener = _log
"""


def _start_once(model: Path, cache: Path, calibrate: bool, max_model_len: int, name: str,
                log_dir: Path, log_compiles: bool = False) -> dict[str, Any]:
    """One engine start in a fresh process; its timing lines go to ``log_dir/NAME.log``
    (``log_compiles``: with a line per Triton kernel compile, from ``COMPILE_LOGGER``)."""
    env = dict(os.environ, VLLM_NVFP4_CACHE=str(cache),
               VLLM_NVFP4_STARTUP_CALIBRATION="1" if calibrate else "0")
    if log_compiles:
        hook = log_dir / "compile-logger"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(COMPILE_LOGGER)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
    env.pop("VLLM_NVFP4_POLICY", None)
    run = subprocess.run([sys.executable, "-m", "studies.time_zeroconfig", "startup-child", "--model", str(model),
                          "--max-model-len", str(max_model_len)],
                         env=env, capture_output=True, text=True, timeout=1800)
    text = run.stdout + run.stderr
    (log_dir / f"{name}.log").write_text("\n".join(
        ln for ln in text.splitlines() if TIMING_LINE.search(ln)) + "\n")
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    if run.returncode or not lines:
        raise SystemExit(f"engine start failed (exit {run.returncode}):\n{text[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    for kind, pattern in (("calibrated", CALIBRATED), ("reused", REUSED)):
        m = pattern.search(text)
        if m:
            result.update(calibration=kind, tokens=int(m.group(1)), calibration_s=float(m.group(2)))
    return result


def _medians(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Median ``LLM()`` wall time of each start kind (run names are ``kind#round``)."""
    kinds: dict[str, list[float]] = {}
    for name, run in runs.items():
        kinds.setdefault(name.split("#")[0], []).append(run["llm_start_s"])
    return {kind: statistics.median(times) for kind, times in kinds.items() if kind != "warm-up"}


START_KINDS = ("off", "calibrating", "cached")


def run_startup(out: Path, preset: str, max_model_len: int, warm_ups: int,
                repeats: int = 1, kinds: Sequence[str] = START_KINDS,
                log_compiles: bool = False) -> dict[str, Any]:
    from vllm_nvfp4.testing.weightless import build_weightless_model

    model = build_weightless_model(out / f"{preset}-weightless", preset)
    cache = out / "cache"
    result: dict[str, Any] = {"preset": preset, "model": str(model), "max_model_len": max_model_len,
                              "warm_ups": warm_ups, "repeats": repeats, "runs": {}}
    rounds = [f"{kind}#{r}" for r in range(1, repeats + 1) for kind in kinds]
    for name in [f"warm-up#{w}" for w in range(1, warm_ups + 1)] + rounds:
        kind = name.split("#")[0]
        if kind in ("calibrating", "warm-up"):
            shutil.rmtree(cache, ignore_errors=True)  # an empty cache: this start calibrates
        log(f"engine start: {name}")
        run = result["runs"][name] = _start_once(model, cache, kind != "off",
                                                 max_model_len, name.replace("#", "_"), out,
                                                 log_compiles)
        log(f"  {run}")
        med = result["median_s"] = _medians(result["runs"])
        result["added_s"] = {f"{k}_vs_{base}": round(med[k] - med[base], 2)
                             for k, base in (("calibrating", "off"), ("cached", "off"),
                                             ("calibrating", "cached")) if k in med and base in med}
        result["calibrating_vs_cached"] = _same_engine(result["runs"])
        (out / "startup.json").write_text(json.dumps(result, indent=2) + "\n")  # after every start
    return result


def _same_engine(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Whether each round's calibrating start (calibration forwards before vLLM's memory profiling)
    serves exactly like the cached start that binds the same policy without them: the same greedy
    tokens and the same KV-cache capacity (tokens)."""
    out: dict[str, Any] = {}
    for name, run in runs.items():
        twin = runs.get(name.replace("calibrating", "cached"))
        if name.startswith("calibrating") and twin:
            out[name] = {"same_tokens": run["token_ids"] == twin["token_ids"],
                         "kv_tokens": [run["kv_tokens"], twin["kv_tokens"]]}
    return out


def random_weight_model(out: Path, preset: str, shard_bytes: int = 4 << 30) -> Path:
    """The preset's config with random bf16 weights (normal, std 0.02; norms 1), saved as
    safetensors shards of about ``shard_bytes``: made on the GPU when there is one, with the
    parameter names and shapes transformers expects (its model built on the meta device)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_nvfp4.testing.weightless import build_weightless_model

    model_dir = out / "model"
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        return model_dir
    shell = build_weightless_model(out / f"{preset}-weightless", preset)
    shutil.copytree(shell, model_dir, dirs_exist_ok=True)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    del meta
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                t = torch.ones(shapes[name], dtype=torch.bfloat16, device=device)
            else:
                t = torch.randn(shapes[name], generator=gen, dtype=torch.bfloat16, device=device) * 0.02
            tensors[name] = t.cpu()
            weight_map[name] = file
        save_file(tensors, str(model_dir / file), metadata={"format": "pt"})
        del tensors
    total = sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                     indent=2))
    log(f"random {preset} weights ({total / 1e9:.1f} GB, {len(shards)} shards) in "
        f"{time.perf_counter() - t0:.0f} s -> {model_dir}")
    return model_dir


def run_analyze(out: Path, preset: str, device: str, windows: int) -> dict[str, Any]:
    from vllm_nvfp4.calibration.builtin_text import BUILTIN_TEXT

    model_dir = random_weight_model(out, preset)
    report = out / "analysis"
    cmd = [sys.executable, "-m", "vllm_nvfp4.cli", "analyze", str(model_dir), "--data", str(BUILTIN_TEXT),
           "--out", str(report), "--device", device, "--windows", str(windows), "--force"]
    log("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    run = subprocess.run(cmd, text=True, capture_output=True)
    wall = time.perf_counter() - t0
    (out / "analyze_cli.log").write_text(run.stdout + run.stderr)  # gpu_zeroconfig.sh tees analyze.log
    if run.returncode:
        raise SystemExit(f"analyze failed (exit {run.returncode}):\n{(run.stdout + run.stderr)[-4000:]}")
    rep = json.loads((report / "sensitivity.json").read_text())
    # time in the scored forwards (every configuration's own seconds): linear in the windows;
    # loading, calibration and start-up are not
    forward_s = sum(c["seconds"] for c in rep["configs"].values()) + sum(
        entry[kv]["seconds"] for entry in rep["layers"] for kv in ("k", "v"))
    result = {"preset": preset, "device": device, "command": cmd, "wall_s": round(wall, 1),
              "report_seconds": rep["seconds"], "forward_s": round(forward_s, 1),
              "forwards": rep["settings"]["forwards"],
              "prefix_reuse": rep["settings"]["prefix_reuse"], "window": rep["settings"]["window"],
              "windows": rep["settings"]["windows"], "stdout": run.stdout.strip().splitlines()[-2:]}
    if windows != DEFAULT_WINDOWS:
        result[f"wall_s_at_{DEFAULT_WINDOWS}_windows_extrapolated"] = round(
            wall + forward_s * (DEFAULT_WINDOWS / windows - 1), 1)
    (out / "analyze.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("startup", "analyze"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--preset", default="llama8b")
        p.add_argument("--max-model-len", type=int, default=None,
                       help="engine context (default: 8192, at most the preset's positions)")
        p.add_argument("--device", default="cuda")
        p.add_argument("--windows", type=int, default=DEFAULT_WINDOWS,
                       help=f"analyze: scored windows (default {DEFAULT_WINDOWS}, analyze's own; fewer: the "
                            "wall time at the default is extrapolated from the forwards' time)")
        p.add_argument("--warm-ups", type=int, default=0,
                       help="startup: starts (calibrating) before the timed ones, which fill vLLM's "
                            "compile cache and Triton's kernel cache (2 recommended, see above)")
        p.add_argument("--repeats", type=int, default=1,
                       help="startup: rounds of off / calibrating / cached starts (medians reported)")
        p.add_argument("--kinds", nargs="+", choices=START_KINDS, default=list(START_KINDS),
                       help="startup: the starts of a round (default all three; 'calibrating "
                            "cached' times the calibration alone: same policy, same engine)")
        p.add_argument("--log-compiles", action="store_true",
                       help="startup: log every Triton kernel compile of each start (name, cache "
                            "hit, milliseconds, cache dir) into its log, through a sitecustomize "
                            "module put first on PYTHONPATH (it hides any other sitecustomize)")
    p = sub.add_parser("startup-child")
    p.add_argument("--model", required=True)
    p.add_argument("--max-model-len", type=int, default=8192)
    a = ap.parse_args(argv)
    if a.mode == "startup-child":
        startup_child(a.model, a.max_model_len)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if a.mode == "startup" and (a.warm_ups < 0 or a.repeats < 1):
        ap.error(f"--warm-ups must be >= 0 and --repeats >= 1, got {a.warm_ups} and {a.repeats}")
    if a.preset not in PRESETS:
        ap.error(f"--preset must be one of {', '.join(PRESETS)}, got {a.preset!r}")
    max_model_len = a.max_model_len or min(8192, PRESETS[a.preset]["max_pos"])
    result = run_startup(a.out, a.preset, max_model_len, a.warm_ups, a.repeats, a.kinds,
                         a.log_compiles) if a.mode == "startup" else \
        run_analyze(a.out, a.preset, a.device, a.windows)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
