"""Our environment variables are known to vLLM: no 'Unknown vLLM environment variable' for them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_nvfp4 import env_vars
from vllm_nvfp4.env_vars import ENV_VARS, register_with_vllm, unknown_variables

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bVLLM_NVFP4_[A-Z0-9_]*[A-Z0-9]\b")


def _names_in_sources() -> set[str]:
    """The names other sources spell out, and those they read through an env_vars constant."""
    files = [*(REPO / "vllm_nvfp4").rglob("*.py"), *(REPO / "scripts").rglob("*.py"),
             *(REPO / "benchmarks").rglob("*.py"), *(REPO / "benchmarks").rglob("*.sh"),
             *(REPO / "studies").rglob("*.py"),
             *(REPO / "scripts").rglob("*.sh"), *(REPO / "vllm_nvfp4").rglob("*.yaml")]
    texts = [f.read_text() for f in files if f.name != "env_vars.py"]
    constants = {c: getattr(env_vars, c) for c in dir(env_vars) if c.endswith("_ENV")}
    return ({n for text in texts for n in NAME.findall(text)}
            | {name for c, name in constants.items() if any(re.search(rf"\b{c}\b", t) for t in texts)})


def test_every_variable_the_package_reads_is_in_the_table_and_none_is_stale():
    found = _names_in_sources()
    assert found - set(ENV_VARS) == set(), "add these to vllm_nvfp4/env_vars.py ENV_VARS"
    assert set(ENV_VARS) - found == set(), "ENV_VARS lists variables nothing reads"


def test_registered_variables_pass_vllms_strict_environment_check(monkeypatch):
    from vllm import envs
    from vllm.platforms import current_platform

    for name in ENV_VARS:
        monkeypatch.setenv(name, f"value of {name}")
    register_with_vllm()
    register_with_vllm()  # idempotent
    current_platform.validate_environ(hard_fail=True)  # raises on any unknown VLLM_* name
    assert envs.VLLM_NVFP4_POLICY == "value of VLLM_NVFP4_POLICY"
    monkeypatch.setenv("VLLM_NVFP4_POLICYY", "typo")  # the check is live: a typo still fails
    with pytest.raises(ValueError, match="Unknown vLLM environment variable detected: VLLM_NVFP4_POLICYY"):
        current_platform.validate_environ(hard_fail=True)
    assert unknown_variables({"VLLM_NVFP4_POLICYY": "", "VLLM_NVFP4_POLICY": "", "HOME": ""}) == [
        "VLLM_NVFP4_POLICYY"]


def test_engine_config_with_policy_variable_passes_strict_validation(tiny_model_dir, tmp_path, monkeypatch):
    """Through vLLM: EngineArgs loads the plugin, then create_engine_config validates the
    environment (strictly here) and runs our start-up check; a missing policy file is named."""
    from vllm.engine.arg_utils import EngineArgs

    def config(**kw):
        return EngineArgs(model=str(tiny_model_dir), kv_cache_dtype="nvfp4_mixed", max_model_len=256,
                          fail_on_environ_validation=True, **kw).create_engine_config()

    monkeypatch.setenv("VLLM_NVFP4_POLICY", "0:fp8,*:nvfp4")
    assert config().cache_config.cache_dtype == "nvfp4_mixed"
    monkeypatch.setenv("VLLM_NVFP4_POLICY", str(tmp_path / "typo.json"))
    with pytest.raises(ValueError, match=r"no usable KV policy for \S+: policy file \S+typo.json "
                                         r"\(from \$VLLM_NVFP4_POLICY\) does not exist$"):
        config()


def test_our_variables_do_not_change_vllms_compile_cache_key(monkeypatch):
    """vLLM hashes its variable table into the torch.compile cache key: ours must not enter it
    (a policy or start-up calibration switched off would recompile the model), vLLM's still do."""
    from vllm import envs

    from vllm_nvfp4.integration.hooks import install

    install()
    for name in ENV_VARS:
        monkeypatch.setenv(name, "1")
    first = envs.compile_factors()
    for name in ENV_VARS:
        monkeypatch.setenv(name, "0")
    assert envs.compile_factors() == first
    assert not set(first) & set(ENV_VARS)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # a vLLM variable still counts
    assert envs.compile_factors()["VLLM_BATCH_INVARIANT"] != first["VLLM_BATCH_INVARIANT"]


def test_env_vars_is_a_leaf_and_its_constants_are_the_ones_read():
    """env_vars.py imports no product module (hooks.py and the readers import it); the torch-path
    switch that ops.py names itself is the same string."""
    from vllm_nvfp4 import ops

    source = (REPO / "vllm_nvfp4" / "env_vars.py").read_text()
    assert not re.search(r"^\s*(from|import) vllm_nvfp4", source, re.M)
    assert ops.FORCE_TORCH_ENV == env_vars.FORCE_TORCH_ENV
    for c in ("POLICY_ENV", "FORCE_TORCH_ENV", "FUSED_PREFILL_ENV", "STARTUP_CALIBRATION_ENV", "CACHE_ENV"):
        assert getattr(env_vars, c) in ENV_VARS
