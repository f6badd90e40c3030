"""``vllm-nvfp4``: calibrate KV scales, analyze layer-wise KV sensitivity, select a policy.

    vllm-nvfp4 calibrate MODEL --data FILE... --out POLICY.json [--policy COMPACT] [--per-head]
    vllm-nvfp4 analyze   MODEL --data FILE... --out REPORT_DIR [--window 2048 --windows 2]
    vllm-nvfp4 select    REPORT_DIR (--budget 0.62 | --fp8-slots N) [--out POLICY.json]
                         [--write-to-model DIR] [--force] [--no-measure]
    vllm-nvfp4 tune      MODEL --data FILE... [--budget 0.62] [--force]
                         (= analyze with calibration + select; writes MODEL/nvfp4_policy.json)
    vllm-nvfp4 doctor    [MODEL]    what is installed, whether vLLM loads the plugin and accepts
                                    nvfp4_mixed, the policy MODEL would get or why it is refused

``calibrate``, ``analyze``, ``select`` and ``tune`` run the model on ``--device`` (default: every
visible GPU when CUDA is available, else the CPU; see :mod:`vllm_nvfp4.calibration.modeling`).

Exit status: 0 success, 2 bad arguments / inputs (one line on stderr), 1 unexpected failure,
3 ``doctor`` found something that blocks ``nvfp4_mixed`` (its FAIL lines say what).
Nothing a user wrote is overwritten without ``--force``; output paths are checked before any
model is loaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from vllm_nvfp4 import __version__
from vllm_nvfp4.calibration.data import add_text_arguments
from vllm_nvfp4.calibration.selection import BASES, DEFAULT_BASE, DEFAULT_BUDGET, METRICS
from vllm_nvfp4.formats import KVFormat
from vllm_nvfp4.policy import POLICY_FILENAME, KVPolicy, PolicyError


class UsageError(Exception):
    """Bad arguments or inputs: reported as ``vllm-nvfp4 CMD: error: ...``, exit status 2."""


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` accepting only values > 0 of ``kind`` (int or float)."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {getattr(kind, '__name__', 'number')}, got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    return parse


def _non_negative_int(text: str) -> int:
    """An argparse ``type`` accepting integers >= 0."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", metavar="DEVICE",
                   help="cpu, cuda (every visible GPU, the model split across them: "
                        "device_map=auto), cuda:N, or auto (default: cuda when available, else cpu)")


def _base_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", choices=BASES, default=DEFAULT_BASE,
                   help="the policy each slot is moved away from alone: fp8 (default: the NVFP4 "
                        "damage of each slot next to all-FP8) or nvfp4 (the FP8 value of each slot "
                        "among NVFP4 neighbours)")


def _model_args(p: argparse.ArgumentParser, default_windows: int, k_center_default: bool = False) -> None:
    add_text_arguments(p, 2048, default_windows, _positive(int))
    p.add_argument("--per-head", action="store_true", help="one scale per KV head instead of per layer")
    p.add_argument("--k-smooth", type=_positive(float), default=None, metavar="ALPHA",
                   help="K smoothing: divide each K channel by max(1, (amax_c / mean amax)^ALPHA) "
                        "and multiply queries back (try 1.0 for models with outlier K channels, "
                        "e.g. Qwen2.5)")
    if k_center_default:
        p.add_argument("--no-k-center", dest="k_center", action="store_false",
                       help="no K centering (default: centering, except for models with a logits "
                            "soft-cap)")
    else:
        p.add_argument("--k-center", action="store_true",
                       help="K centering: store K minus each channel's calibration mean (exact for "
                            "attention without a logits soft-cap; for models whose keys carry a large "
                            "constant part, e.g. Qwen2.5's K bias)")
    p.add_argument("--k-sink-uncentered", action=argparse.BooleanOptionalAction, default=None,
                   help="with K centering, store the first key of every sequence (the attention "
                        "sink) uncentered in the layers where the calibration text's first key "
                        "fits the K range: no extra bytes, the readers correct its logit "
                        "(default: " + ("with centering, the selected policy is measured with "
                                        "and without it and the better kept" if k_center_default
                                        else "off") + ")")
    p.add_argument("--k-permute", action="store_true",
                   help="K channel permutation: store each KV head's K channels in order of their "
                        "calibration RMS, so each NVFP4 block holds channels of similar magnitude "
                        "(exact: the queries are permuted alike; measured gains depend on the "
                        "model and text, see docs/CALIBRATION.md)")
    p.add_argument("--k-rot-pairs", type=_non_negative_int, default=0, metavar="K",
                   help="with K centering, center K on the mean pre-RoPE key rotated to each "
                        "key's position on the K RoPE pairs of each KV head where that mean is "
                        "largest (the constant offset on the others; 1 .. head_dim/2, e.g. "
                        "head_dim/8; not with --k-smooth or --k-permute; models whose RoPE is not "
                        "rotate-half over the whole head, or is M-RoPE, keep the constant offset; "
                        "docs/design/rotating_centering.md). Default 0: off")
    p.add_argument("--max-model-len", type=_non_negative_int, default=None, metavar="N",
                   help="the longest sequence (tokens) served with the policy: every calibration "
                        "window also runs at position offsets up to N (RoPE keys rotate further "
                        "at later positions and would outgrow a K range calibrated on the "
                        "windows' own positions); only the K/V range takes them in, the K "
                        "centering offsets come from the windows as they are (default: the "
                        "model's max_position_embeddings, which is vLLM's default "
                        "--max-model-len; give vLLM's --max-model-len where you serve less; "
                        "0: off)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="model dtype (default bfloat16, the reference for all damages)")
    _device_arg(p)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vllm-nvfp4", description="Per-layer FP8/NVFP4 KV-cache policies for vLLM.")
    ap.add_argument("--version", action="version", version=f"vllm-nvfp4 {__version__}")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("calibrate", help="K/V amax -> FP8 scales and NVFP4 global scales; writes a policy")
    _model_args(p, default_windows=4)
    p.add_argument("--out", type=Path, required=True, help="policy JSON to write")
    p.add_argument("--policy", default=None, metavar="COMPACT",
                   help="formats, e.g. '0-1:fp8,2-27:nvfp4,28-29:fp8' (default: first/last layer FP8)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")

    p = sub.add_parser("analyze", help="layer-wise K/V sensitivity against the unquantized model")
    _model_args(p, default_windows=2)
    p.add_argument("--out", type=Path, required=True, help="report directory to create")
    p.add_argument("--calib-windows", type=_positive(int), default=1,
                   help="windows before the scored ones used to calibrate scales (default 1)")
    p.add_argument("--scales", type=Path, default=None,
                   help="use the scales of this calibrated policy instead of calibrating")
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="run every configuration from layer 0 (slower; same numbers)")
    _base_arg(p)
    p.add_argument("--force", action="store_true", help="overwrite an existing report in --out")

    p = sub.add_parser("select", help="pick FP8/NVFP4 per layer under a KV-bytes budget; writes the policy")
    p.add_argument("report", type=Path, help="report directory written by analyze")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--budget", type=float, help=f"KV bytes as a fraction of all-FP8 ({KVFormat.NVFP4.bytes_per_element} .. 1.0), e.g. 0.62")
    g.add_argument("--fp8-slots", type=int, help="number of K/V layer slots kept in FP8")
    p.add_argument("--metric", choices=METRICS, default="kl",
                   help="single-slot damage to minimise (default kl: non-negative, less noisy; "
                        "top1: next-token argmax flips)")
    p.add_argument("--out", type=Path, default=None, help="policy JSON to write")
    p.add_argument("--write-to-model", type=Path, default=None, metavar="DIR",
                   help=f"also write DIR/{POLICY_FILENAME}, where `vllm serve DIR` finds it")
    p.add_argument("--no-measure", action="store_true",
                   help="skip measuring the chosen and the naive policy (no model run)")
    p.add_argument("--measure-windows", type=_positive(int), default=None, metavar="N",
                   help="measure on N windows from the analysis' first held-out window "
                        "(default: the analysis' windows; more = partly fresh text)")
    p.add_argument("--force", action="store_true", help="overwrite existing policy files")
    _device_arg(p)

    p = sub.add_parser("tune", help="calibrate + analyze + select in one run; writes MODEL/"
                                    f"{POLICY_FILENAME}")
    _model_args(p, default_windows=2, k_center_default=True)
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help=f"KV bytes as a fraction of all-FP8 (0.5625 .. 1.0; default {DEFAULT_BUDGET})")
    p.add_argument("--calib-windows", type=_positive(int), default=1,
                   help="windows before the scored ones that calibrate the scales (default 1)")
    p.add_argument("--metric", choices=METRICS, default="kl",
                   help="single-slot damage to minimise (default kl; top1: next-token argmax flips)")
    _base_arg(p)
    p.add_argument("--measure-windows", type=_positive(int), default=None, metavar="N",
                   help="measure the selection on N windows (default: the analysis' windows)")
    p.add_argument("--no-measure", action="store_true",
                   help="skip measuring the selected and the naive policy (one model run less, "
                        "unless the sink key is left to measurement)")
    p.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="where the analysis report goes (default MODEL/nvfp4_report)")
    p.add_argument("--force", action="store_true",
                   help=f"overwrite MODEL/{POLICY_FILENAME} and an existing report")

    p = sub.add_parser("doctor", help="why --kv-cache-dtype nvfp4_mixed works here, or not "
                                      "(exit status 3 when something blocks it)")
    p.add_argument("model", type=Path, nargs="?", default=None,
                   help="local model directory: also build its engine config (no weights) and "
                        "show the policy it would get")
    return ap


def _check_writable_file(path: Path, force: bool, what: str) -> None:
    if path.exists() and path.is_dir():
        raise UsageError(f"{what} {path} is a directory; give a file name")
    if path.exists() and not force:
        raise UsageError(f"{what} {path} exists; refusing to overwrite it (use --force)")
    if not path.parent.exists():
        raise UsageError(f"{what} {path}: directory {path.parent} does not exist")


def _check_model_dir(path: Path, window: Optional[int] = None, formats: Optional[str] = None,
                     max_model_len: Optional[int] = None) -> int:
    """Fail before loading weights: no model, window or served length beyond its positions, bad
    --policy. Returns the model's number of layers (from ``config.json``)."""
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not a model directory (no config.json); "
                         "for SmolLM2 run: python scripts/prepare_assets.py smollm2")
    from vllm_nvfp4.calibration.modeling import config_shape

    layers, positions = config_shape(path)
    if layers is None:
        raise UsageError(f"{path}/config.json has no integer num_hidden_layers; is it complete?")
    if window is not None and positions is not None and window > positions:
        raise UsageError(f"--window {window} exceeds the model's {positions} positions")
    if max_model_len is not None and positions is not None and max_model_len > positions:
        raise UsageError(f"--max-model-len {max_model_len} exceeds the model's {positions} "
                         "positions (max_position_embeddings); give at most that")
    if formats is not None:
        KVPolicy.from_compact(formats, layers, source="--policy")  # raises PolicyError
    return layers


def _check_data(paths: Sequence[Path]) -> None:
    """Fail before loading weights: a data file missing, a directory, unreadable or malformed."""
    from vllm_nvfp4.calibration.data import read_text

    for p in paths:
        if p.is_dir():
            raise UsageError(f"data file {p} is a directory; name the files in it")
        if not p.is_file():
            raise UsageError(f"data file {p} does not exist")
        read_text(p)  # raises DataError naming the file and the line


def _sink_key(a: argparse.Namespace) -> Optional[bool]:
    """``--k-sink-uncentered`` as given; not given: None with K centering in ``tune`` (chosen by
    measurement, :func:`~vllm_nvfp4.calibration.commands.run_tune`), else off; asked for
    without centering is an error."""
    if a.k_sink_uncentered and not a.k_center:
        raise UsageError("--k-sink-uncentered stores the sink key without the K centering offsets; "
                         "it needs K centering (--k-center, on by default in tune)")
    if a.k_sink_uncentered is None and a.command == "tune" and a.k_center:
        return None
    return bool(a.k_sink_uncentered)


def _k_rot_pairs(a: argparse.Namespace) -> int:
    """``--k-rot-pairs`` checked before loading weights: with K centering, without smoothing or
    a permutation, at most ``head_dim / 2`` (from ``config.json``)."""
    from vllm_nvfp4.calibration.commands import check_k_rot_args
    from vllm_nvfp4.calibration.modeling import read_text_config
    from vllm_nvfp4.calibration.rot_center import check_pairs

    try:
        check_k_rot_args(a.k_rot_pairs, a.k_center, a.k_smooth, a.k_permute)
        cfg = read_text_config(a.model)
        heads = cfg.get("num_attention_heads")
        head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else None)
        if a.k_rot_pairs and isinstance(head_dim, int):
            check_pairs(a.k_rot_pairs, head_dim)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return a.k_rot_pairs


def cmd_calibrate(a: argparse.Namespace) -> int:
    from vllm_nvfp4.calibration.commands import run_calibrate

    _check_model_dir(a.model, a.window, a.policy, a.max_model_len)
    _check_data(a.data)
    _check_writable_file(a.out, a.force, "--out")
    policy = run_calibrate(a.model, a.data, a.policy, a.window, a.windows, a.per_head, a.dtype,
                           a.k_smooth, a.k_center, a.device, a.k_permute, bool(_sink_key(a)),
                           a.max_model_len, _k_rot_pairs(a))
    policy.save(a.out, overwrite=a.force)
    print(f"wrote {a.out}: {policy.to_compact()} ({policy.fraction_of_fp8():.4f}x FP8 bytes)")
    return 0


def cmd_analyze(a: argparse.Namespace) -> int:
    from vllm_nvfp4.calibration.report import render
    from vllm_nvfp4.calibration.sensitivity import REPORT_FILE, analyze

    num_layers = _check_model_dir(a.model, a.window, max_model_len=a.max_model_len)
    _check_data(a.data)
    if a.out.exists() and not a.out.is_dir():
        raise UsageError(f"--out {a.out} exists and is not a directory")
    if (a.out / REPORT_FILE).exists() and not a.force:
        raise UsageError(f"--out {a.out} already holds a report; refusing to overwrite it (use --force)")
    given = [flag for flag, on in (("--per-head", a.per_head), ("--k-smooth", a.k_smooth),
                                   ("--k-center", a.k_center), ("--k-permute", a.k_permute),
                                   ("--k-sink-uncentered", a.k_sink_uncentered),
                                   ("--k-rot-pairs", a.k_rot_pairs),
                                   ("--max-model-len", a.max_model_len is not None)) if on]
    if a.scales is not None and given:
        raise UsageError(f"{' '.join(given)} shape the calibration, which --scales replaces: pass "
                         f"them to `vllm-nvfp4 calibrate` instead (the policy carries them)")
    scales = KVPolicy.load(a.scales) if a.scales is not None else None
    if scales is not None:
        scales.check_model(num_layers)  # KV heads and head_dim are checked once the model is loaded
    report = analyze(a.model, a.data, a.out, a.window, a.windows, a.calib_windows, scales,
                     a.per_head, a.dtype, reuse_prefix=not a.no_prefix_reuse, k_smooth=a.k_smooth,
                     k_center=a.k_center, device=a.device, base=a.base, k_permute=a.k_permute,
                     k_sink_uncentered=bool(_sink_key(a)), max_model_len=a.max_model_len,
                     k_rot_pairs=_k_rot_pairs(a) if a.scales is None else 0)
    for stale in a.out.glob("selection-*.json"):  # belong to the previous analysis
        stale.unlink()
    paths = render(a.out)
    c = report["configs"]
    print(f"analyzed {report['model']['num_layers']} layers in {report['seconds']:.0f} s: "
          f"delta NLL all-FP8 {c['all_fp8']['dnll']:.5f}, all-NVFP4 {c['all_nvfp4']['dnll']:.5f} nats/token")
    print("wrote " + ", ".join(str(p) for p in [a.out / REPORT_FILE, *paths]))
    return 0


def cmd_select(a: argparse.Namespace) -> int:
    from vllm_nvfp4.calibration.commands import run_select
    from vllm_nvfp4.calibration.report import load_selections, render
    from vllm_nvfp4.calibration.selection import check_slots, fp8_slots_for_budget
    from vllm_nvfp4.calibration.sensitivity import load_report

    if a.out is None and a.write_to_model is None:
        raise UsageError("say where the policy goes: --out POLICY.json and/or --write-to-model DIR")
    targets = []
    if a.out is not None:
        _check_writable_file(a.out, a.force, "--out")
        targets.append(a.out)
    if a.write_to_model is not None:
        _check_model_dir(a.write_to_model)
        _check_writable_file(a.write_to_model / POLICY_FILENAME, a.force, "--write-to-model")
        targets.append(a.write_to_model / POLICY_FILENAME)
    report, _ = load_report(a.report)
    load_selections(a.report)  # earlier selections go into the report: fail before measuring
    num_layers = len(report["layers"])
    try:
        slots = (fp8_slots_for_budget(num_layers, a.budget) if a.budget is not None
                 else check_slots(num_layers, a.fp8_slots))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if a.write_to_model is not None:
        from vllm_nvfp4.calibration.modeling import config_sha256

        if config_sha256(a.write_to_model) != report["model"]["config_sha256"]:
            raise UsageError(f"{a.write_to_model} is not the model that was analyzed (config.json differs)")
    policy, summary = run_select(a.report, slots, a.metric, measure=not a.no_measure, budget=a.budget,
                                 measure_windows=a.measure_windows, device=a.device)
    for t in targets:
        policy.save(t, overwrite=a.force)
    render(a.report)
    used = summary["fp8_slots"]
    unspent = (f"; {slots - used} of the {slots} allowed slots measured no worse in NVFP4 than in "
               f"FP8 ({a.metric}) and stay NVFP4" if used < slots else "")
    print(f"selected {policy.to_compact()} ({policy.fraction_of_fp8():.4f}x FP8 bytes, {used} FP8 "
          f"slots{unspent})")
    if "measured" in summary["selected"]:
        s, n, nv = summary["selected"]["measured"], summary["naive"]["measured"], summary["all_nvfp4"]
        print(f"measured delta NLL (nats/token): selected {s['dnll']:.5f}, naive first/last {n['dnll']:.5f}, "
              f"all-NVFP4 {nv['dnll']:.5f}; KL: {s['kl']:.5f}, {n['kl']:.5f}, {nv['kl']:.5f}")
    print("wrote " + ", ".join(str(t) for t in targets))
    return 0


def cmd_tune(a: argparse.Namespace) -> int:
    from vllm_nvfp4.calibration.commands import run_tune

    _check_model_dir(a.model, a.window, max_model_len=a.max_model_len)
    _check_data(a.data)
    target = a.model / POLICY_FILENAME
    _check_writable_file(target, a.force, "policy")
    report_dir = a.report if a.report is not None else a.model / "nvfp4_report"
    if report_dir.exists() and not report_dir.is_dir():
        raise UsageError(f"--report {report_dir} exists and is not a directory")
    from vllm_nvfp4.calibration.sensitivity import REPORT_FILE

    if (report_dir / REPORT_FILE).exists() and not a.force:
        raise UsageError(f"{report_dir} already holds a report; refusing to overwrite it (use --force)")
    from vllm_nvfp4.calibration.modeling import config_shape
    from vllm_nvfp4.calibration.selection import fp8_slots_for_budget

    try:
        slots = fp8_slots_for_budget(config_shape(a.model)[0] or 0, a.budget)
    except ValueError as e:
        raise UsageError(str(e)) from None
    result = run_tune(a.model, a.data, report_dir, slots, budget=a.budget, window=a.window,
                      windows=a.windows, calib_windows=a.calib_windows, per_head=a.per_head,
                      dtype=a.dtype, k_smooth=a.k_smooth, k_center=a.k_center,
                      k_sink_uncentered=_sink_key(a),
                      k_permute=a.k_permute, metric=a.metric,
                      base=a.base,
                      measure=not a.no_measure, measure_windows=a.measure_windows, device=a.device,
                      max_model_len=a.max_model_len, k_rot_pairs=_k_rot_pairs(a))
    result.policy.save(target, overwrite=a.force)
    print("\n".join(result.lines()))
    print(f"wrote {target} (vllm serve {a.model} --kv-cache-dtype nvfp4_mixed finds it) and the "
          f"report {report_dir / 'REPORT.md'}")
    return 0


#: exit status of ``doctor`` when a check fails
DOCTOR_BLOCKED = 3


def cmd_doctor(a: argparse.Namespace) -> int:
    from vllm_nvfp4.doctor import diagnose, report

    if a.model is not None and not (a.model / "config.json").is_file():
        raise UsageError(f"{a.model} is not a model directory (no config.json)")
    quiet = "VLLM_LOGGING_LEVEL" not in os.environ
    if quiet:  # vLLM's INFO lines would bury the report
        os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    try:
        text, blocking = report(diagnose(a.model))
    finally:
        if quiet:
            del os.environ["VLLM_LOGGING_LEVEL"]
    print(text)
    return DOCTOR_BLOCKED if blocking else 0


COMMANDS = {"calibrate": cmd_calibrate, "analyze": cmd_analyze, "select": cmd_select,
            "tune": cmd_tune, "doctor": cmd_doctor}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``vllm-nvfp4`` console script; returns the exit status."""
    ap = build_parser()
    a = ap.parse_args(argv)
    handler = logging.StreamHandler()  # our loggers only: other libraries' lines keep their own form
    handler.setFormatter(logging.Formatter("vllm-nvfp4: %(levelname)s: %(message)s"))
    ours = logging.getLogger("vllm_nvfp4")
    if not ours.handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.WARNING)
    from vllm_nvfp4.calibration.progress import set_quiet

    set_quiet(a.quiet)
    from vllm_nvfp4.calibration.data import DataError
    from vllm_nvfp4.calibration.modeling import ModelError
    from vllm_nvfp4.calibration.report_files import ReportError

    if a.command != "doctor":  # doctor reports it among its findings
        from vllm_nvfp4.doctor import vllm_plugins_hint

        hint = vllm_plugins_hint()
        if hint is not None:
            print(f"vllm-nvfp4 {a.command}: warning: {hint}", file=sys.stderr)
    try:
        return COMMANDS[a.command](a)
    except (UsageError, PolicyError, DataError, ModelError, ReportError, FileExistsError) as e:
        print(f"vllm-nvfp4 {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
