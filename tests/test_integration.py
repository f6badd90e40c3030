"""Registration, backend selection and start-up validation of the vLLM integration (no engine runs).

Every ``LLM(...)`` here fails in ``create_engine_config``, before an engine core starts, which is
exactly the point: bad input must be refused at start-up with a message naming the problem.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest
import torch

from conftest import vllm_subprocess_env

from vllm_nvfp4.integration.dtype import CACHE_DTYPE


@pytest.fixture(scope="module", autouse=True)
def registered():
    from vllm_nvfp4.plugin import register

    register()
    register()  # idempotent


def _llm(model_dir: Path, **kwargs):
    from vllm import LLM

    return LLM(model=str(model_dir), kv_cache_dtype=CACHE_DTYPE, enforce_eager=True,
               max_model_len=256, distributed_executor_backend="uni", **kwargs)


def _variant(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of the tiny model with ``config.json`` edited (weights untouched)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---------------------------------------------------------------------------------- registration
def test_dtype_is_valid_everywhere_vllm_checks_it():
    from vllm.config.cache import CacheConfig, CacheDType
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    assert list(get_args(CacheDType)).count(CACHE_DTYPE) == 1
    assert CacheConfig(cache_dtype=CACHE_DTYPE).cache_dtype == CACHE_DTYPE
    with pytest.raises(ValueError, match="nvfp4_mixedX"):
        CacheConfig(cache_dtype="nvfp4_mixedX")
    assert STR_DTYPE_TO_TORCH_DTYPE[CACHE_DTYPE] == torch.uint8
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--kv-cache-dtype", CACHE_DTYPE])
    assert args.kv_cache_dtype == CACHE_DTYPE


def test_every_hook_is_installed_once():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.executor.abstract import Executor

    from vllm_nvfp4.integration import hooks
    from vllm_nvfp4.integration.backend_choice import BACKEND_PATH

    for fn in (EngineArgs.create_engine_config, Attention.get_kv_cache_spec,
               selector._cached_get_attn_backend, Executor.get_kv_cache_specs,
               CpuPlatform._align_hybrid_block_size):
        assert getattr(fn, hooks._MARK)
        assert not getattr(fn.__wrapped__, hooks._MARK, False)  # not wrapped twice
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH
    from vllm import envs

    assert "VLLM_NVFP4_POLICY" in envs.environment_variables
    assert [h.name for h in hooks.HOOKS] == [
        "cache_dtype", "custom_backend", "backend_selection", "spec", "startup_check",
        "state_alignment", "env_vars", "compile_factors", "startup_calibration"]


def _selector_config(**changes):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype=CACHE_DTYPE,
                                   block_size=None)._replace(**changes)


def test_backend_selection():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_nvfp4.integration.backend_choice import BACKEND_PATH, select_backend

    assert select_backend(None, _selector_config()) == BACKEND_PATH
    assert select_backend(AttentionBackendEnum.CUSTOM, _selector_config()) == BACKEND_PATH
    for other in ("auto", "fp8", "nvfp4"):  # vLLM's own dtypes: untouched
        assert select_backend(None, _selector_config(kv_cache_dtype=other)) is None
    with pytest.raises(ValueError, match="FLASHINFER cannot serve kv_cache_dtype=nvfp4_mixed"):
        select_backend(AttentionBackendEnum.FLASHINFER, _selector_config())
    with pytest.raises(ValueError, match="does not support MLA"):
        select_backend(None, _selector_config(use_mla=True))
    with pytest.raises(ValueError, match="head_size not supported"):
        select_backend(None, _selector_config(head_size=40))


def test_rank_scales_split_and_replicate_per_head_lists():
    from vllm_nvfp4.integration.rank_params import rank_scales

    assert rank_scales(None, "fp8", 4, 2, 0, 2) == [1.0, 1.0]
    assert rank_scales(None, "nvfp4", 4, 4, 0, 1) == [pytest.approx(1 / 6)] * 4
    assert rank_scales(0.5, "fp8", 4, 2, 1, 2) == [0.5, 0.5]
    assert rank_scales((1.0, 2.0, 3.0, 4.0), "fp8", 4, 2, 1, 2) == [3.0, 4.0]
    assert rank_scales((1.0, 2.0), "nvfp4", 2, 1, 3, 4) == [2.0]  # 2 KV heads over 4 ranks


def test_rebind_after_inference_mode_updates_scales_in_place():
    """vLLM binds once inside inference mode (CUDA-graph memory sizing), then again outside it."""
    from types import SimpleNamespace

    from vllm_nvfp4.integration.backend import Nvfp4MixedImpl
    from vllm_nvfp4.layout import KVPageLayout
    from vllm_nvfp4.policy import LayerPolicy

    config = SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1),
                             cache_config=SimpleNamespace(cache_dtype="auto"))
    layout = KVPageLayout(2, 64, 16, "fp8", "nvfp4")
    impl = Nvfp4MixedImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)
    with torch.inference_mode():
        impl.bind("layers.0", 0, LayerPolicy("fp8", "nvfp4", k_scale=0.5, v_global_scale=0.25),
                  layout, config, torch.device("cpu"))
    k_scale = impl.k_scale
    impl.bind("layers.0", 0, LayerPolicy("fp8", "nvfp4", k_scale=(0.75, 1.5), v_global_scale=0.125),
              layout, config, torch.device("cpu"))
    assert impl.k_scale is k_scale  # the same storage that captured CUDA graphs point at
    assert impl.k_scale.tolist() == [0.75, 1.5] and impl.v_scale.tolist() == [0.125, 0.125]


def _impl_step(row, kf: str, vf: str, query, key, value):
    """Bind an impl to a one-layer policy row, write ``key``/``value [T, 2, 64]`` as one prefill
    of a single sequence and return its attention output for ``query [T, 4, 64]`` (CPU path)."""
    from types import SimpleNamespace

    from vllm_nvfp4.integration.backend import Nvfp4MixedImpl, Nvfp4MixedMetadata
    from vllm_nvfp4.layout import KVPageLayout

    config = SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1),
                             cache_config=SimpleNamespace(cache_dtype="auto"))
    layout = KVPageLayout(2, 64, 16, kf, vf)
    impl = Nvfp4MixedImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)
    impl.bind("layers.0", 0, row, layout, config, torch.device("cpu"))
    t = key.shape[0]
    blocks = -(-t // 16) + 1
    cache = torch.zeros(blocks, layout.page_bytes, dtype=torch.uint8).view(
        blocks, 1, 16, layout.bytes_per_token)
    slots = torch.arange(t) + 16  # block 1 onwards
    impl.do_kv_cache_update(None, key, value, cache, slots)
    meta = Nvfp4MixedMetadata(
        num_actual_tokens=t, max_query_len=t, max_seq_len=t,
        query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        seq_lens=torch.tensor([t], dtype=torch.int32),
        block_table=torch.arange(1, blocks, dtype=torch.int32)[None], slot_mapping=slots)
    return impl.forward(None, query, key, value, cache, meta, torch.empty_like(query))


@pytest.mark.parametrize("kf,vf", [("nvfp4", "nvfp4"), ("fp8", "nvfp4")])
def test_k_smoothing_cancels_in_attention(kf, vf):
    """K / lam in the cache and q * lam: with power-of-two factors constant over each 16-channel
    NVFP4 block the stored codes are the same, so the output equals the unsmoothed one; outlier
    channels that would zero their block neighbours are repaired by real factors."""
    from vllm_nvfp4.policy import LayerPolicy

    gen = torch.Generator().manual_seed(7)
    t = 37
    query = torch.randn(t, 4, 64, generator=gen)
    key = torch.randn(t, 2, 64, generator=gen)
    value = torch.randn(t, 2, 64, generator=gen)
    lam = torch.tensor([2.0 ** (c // 16 % 3) for c in range(64)]).repeat(2, 1)
    lam[1] *= 0.5
    plain = _impl_step(LayerPolicy(kf, vf), kf, vf, query, key, value)
    smooth = _impl_step(LayerPolicy(kf, vf, k_smooth=lam.tolist()), kf, vf, query, key, value)
    # (FP8 K: values in E4M3's subnormal range round on an absolute grid, so not bit-exact)
    tol = 1e-6 if kf == "nvfp4" else 2e-3
    torch.testing.assert_close(smooth, plain, rtol=tol, atol=tol)

    # outlier channels (x20) in every 16-block: smoothing them down cuts the attention error
    from vllm_nvfp4.paged_torch import attend_one_sequence

    key[:, :, ::16] *= 20.0
    exact = attend_one_sequence(query.double(), key.double(), value.double(), 0.125)
    amax = key.abs().amax(dim=0)  # [2, 64]
    lam = (amax / amax.mean(dim=1, keepdim=True)).clamp(min=1.0)
    errors = []
    for k_in, smooth in ((key, None), (key / lam, lam.tolist())):
        a = k_in.abs().amax().item()
        row = LayerPolicy(kf, "fp8", k_scale=a / 448, k_global_scale=a / 2688,
                          v_scale=value.abs().amax().item() / 448, k_smooth=smooth)
        out = _impl_step(row, kf, "fp8", query, key, value)  # V in FP8: K's error dominates
        errors.append(((out.double() - exact).norm() / exact.norm()).item())
    if kf == "nvfp4":
        assert errors[1] < 0.7 * errors[0], errors
    else:  # FP8 rounds each element on its own: smoothing neither helps nor hurts much
        assert errors[1] < 1.5 * errors[0], errors


@pytest.mark.parametrize("kf", ["fp8", "nvfp4"])
def test_k_centering_through_the_impl(kf):
    """The impl stores K - mu: keys that are a large per-channel constant plus small
    token-dependent parts lose those parts when quantized as they are; centered (scales from the
    centered amax) the attention output is far closer to float64. A model with a logits soft-cap
    refuses a centering policy at bind time."""
    from vllm_nvfp4.integration.backend import Nvfp4MixedImpl
    from vllm_nvfp4.paged_torch import attend_one_sequence
    from vllm_nvfp4.policy import LayerPolicy

    gen = torch.Generator().manual_seed(11)
    t = 45
    query = torch.randn(t, 4, 64, generator=gen)
    mu = torch.randn(2, 64, generator=gen) * 30
    key = mu + torch.randn(t, 2, 64, generator=gen)
    value = torch.randn(t, 2, 64, generator=gen)
    exact = attend_one_sequence(query.double(), key.double(), value.double(), 0.125)
    v_scale = value.abs().amax().item() / 448
    errors = []
    for center in (None, mu):
        a = (key if center is None else key - center).abs().amax().item()
        row = LayerPolicy(kf, "fp8", k_scale=a / 448, k_global_scale=a / 2688, v_scale=v_scale,
                          k_center=None if center is None else center.tolist())
        out = _impl_step(row, kf, "fp8", query, key, value)
        errors.append(((out.double() - exact).norm() / exact.norm()).item())
    assert errors[1] < 0.2 * errors[0], errors

    from types import SimpleNamespace

    from vllm_nvfp4.layout import KVPageLayout
    config = SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1),
                             cache_config=SimpleNamespace(cache_dtype="auto"))
    capped = Nvfp4MixedImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2,
                            logits_soft_cap=30.0)
    with pytest.raises(RuntimeError, match="soft-cap"):
        capped.bind("layers.0", 0, LayerPolicy(kf, "fp8", k_center=mu.tolist()),
                    KVPageLayout(2, 64, 16, kf, "fp8"), config, torch.device("cpu"))


def test_page_view_refuses_split_or_strided_blocks():
    from vllm_nvfp4.integration.backend import page_view
    from vllm_nvfp4.layout import KVPageLayout

    layout = KVPageLayout(2, 32, 16, "fp8", "nvfp4")
    per_token = layout.bytes_per_token
    raw = torch.zeros(3, 2 * layout.page_bytes, dtype=torch.uint8)  # layers interleaved
    view = raw[:, :layout.page_bytes].view(3, 1, 16, per_token)
    pages = page_view(view, layout)
    assert pages.shape == (3, layout.page_bytes) and pages.stride() == (2 * layout.page_bytes, 1)
    assert pages.data_ptr() == raw.data_ptr()
    with pytest.raises(RuntimeError, match="expected dense pages"):
        page_view(torch.zeros(6, 1, 8, per_token, dtype=torch.uint8), layout)


# ---------------------------------------------------------------------------------- bad input
def test_policy_for_another_layer_count_fails_at_start(tiny_model_dir, tmp_path, monkeypatch):
    from vllm_nvfp4.policy import KVPolicy, PolicyError

    path = KVPolicy.from_compact("*:fp8", 6).save(tmp_path / "six.json")
    monkeypatch.setenv("VLLM_NVFP4_POLICY", str(path))
    with pytest.raises(PolicyError, match="describes 6 attention layers, but the model has 4"):
        _llm(tiny_model_dir)


@pytest.mark.parametrize("where", ["env", "model_dir"])
def test_malformed_policy_file_fails_at_start_with_one_line(tiny_model_dir, tmp_path, monkeypatch, where):
    """A policy file without the header, named by $VLLM_NVFP4_POLICY or found in the model
    directory: LLM() stops before any worker with one line naming the file, the fault and where
    the format is documented."""
    from vllm_nvfp4.policy import PolicyError
    from vllm_nvfp4.policy.json_form import FORMAT_DOC

    if where == "env":
        path = tmp_path / "policy.json"
        monkeypatch.setenv("VLLM_NVFP4_POLICY", str(path))
        model = tiny_model_dir
    else:
        monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
        model = shutil.copytree(tiny_model_dir, tmp_path / "model")
        path = model / "nvfp4_policy.json"
    path.write_text('{"layers": 3}')
    with pytest.raises(PolicyError) as e:
        _llm(model)
    assert str(e.value) == (f"kv_cache_dtype=nvfp4_mixed: no usable KV policy for {model}: {path}: "
                            "not a vllm-nvfp4 policy: it has no 'format' header; a policy file "
                            'starts {"format": "vllm-nvfp4-policy", "version": 1, ...}; '
                            f"{FORMAT_DOC}")


def test_unknown_format_fails_at_start(tiny_model_dir, monkeypatch):
    from vllm_nvfp4.policy import PolicyError

    monkeypatch.setenv("VLLM_NVFP4_POLICY", "0:fp8,*:int4")
    with pytest.raises(PolicyError, match="unknown KV format 'int4'"):
        _llm(tiny_model_dir)


def test_head_dim_not_multiple_of_16_fails_at_start(tiny_model_dir, tmp_path):
    model = _variant(tiny_model_dir, tmp_path / "hd40", head_dim=40)
    with pytest.raises(ValueError, match="head_dim to be a multiple of 16.*head_dim is 40"):
        _llm(model)


def test_sliding_window_model_gets_typed_policy_rows(tiny_model_dir, tmp_path):
    """A Mistral with a window: every row sliding(64), one KV-cache group kind, vLLM's layout."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nvfp4.integration.model import model_policy
    from vllm_nvfp4.policy import LayerType

    model = _variant(tiny_model_dir, tmp_path / "swa", architectures=["MistralForCausalLM"],
                     model_type="mistral", sliding_window=64)
    config = EngineArgs(model=str(model), kv_cache_dtype=CACHE_DTYPE,
                        max_model_len=256).create_engine_config()
    assert model_policy(config).layer_types == (LayerType("sliding", 64),) * 4
    assert config.cache_config.kv_cache_layout is None


def test_sliding_layers_of_mixed_formats_next_to_full_ones_start(tmp_path, monkeypatch):
    """A Gemma 3 policy whose sliding layers mix format pairs in unequal numbers (as `select`
    may choose) passes the start-up checks with its formats and the block-outermost layout
    (the engine run: ``test_integration_hybrid.py``, case ``gemma3_swa_mix``)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nvfp4.formats import KVFormat
    from vllm_nvfp4.integration.model import model_policy
    from vllm_nvfp4.policy import POLICY_ENV
    from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid

    model = build_tiny_hybrid("gemma3", tmp_path / "gemma3")  # sliding, sliding, full, ... x4
    monkeypatch.setenv(POLICY_ENV, "0:k=fp8,v=nvfp4,*:nvfp4")
    config = EngineArgs(model=str(model), kv_cache_dtype=CACHE_DTYPE,
                        max_model_len=256).create_engine_config()
    policy = model_policy(config)
    assert [(lp.k, lp.v) for _, lp in policy.kv_layers()][:2] == [
        (KVFormat.FP8, KVFormat.NVFP4), (KVFormat.NVFP4, KVFormat.NVFP4)]
    assert config.cache_config.kv_cache_layout == "BLNHC"


def _fake_config(layer_types=None, layout=None, **text):
    from types import SimpleNamespace

    text.setdefault("num_hidden_layers", 4)
    if layer_types is not None:
        text.update(layer_types=layer_types, sliding_window=32)
    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=False, architecture="TestForCausalLM",
                                     is_hybrid="linear_attention" in (layer_types or ()),
                                     hf_text_config=SimpleNamespace(**text)),
        cache_config=SimpleNamespace(kv_cache_layout=layout, kv_cache_dtype_skip_layers=None))


@pytest.mark.parametrize("text, match", [
    (dict(num_kv_shared_layers=2), "does not support cross-layer KV sharing .*2 layers reuse"),
    (dict(layer_types=["full_attention", "mamba2_moe"] * 2), "type 'mamba2_moe'.*supported:"),
])
def test_unsupported_layers_are_refused_with_what_is_supported(text, match):
    from vllm_nvfp4.integration.model import Nvfp4MixedConfigError, check_engine_config

    with pytest.raises(Nvfp4MixedConfigError, match=match) as e:
        check_engine_config(_fake_config(**text))
    assert "It supports decoder models whose layers are full attention, sliding-window" in str(e.value)


def test_untyped_mamba_hybrid_is_refused():
    from vllm_nvfp4.integration.model import Nvfp4MixedConfigError, check_engine_config

    config = _fake_config()
    config.model_config.is_hybrid = True  # e.g. Jamba: layers_block_type, no layer_types
    with pytest.raises(Nvfp4MixedConfigError, match="hybrid model whose config has no layer_types"):
        check_engine_config(config)


def test_hybrid_models_pin_a_block_outermost_layout(monkeypatch):
    from vllm import envs

    from vllm_nvfp4.integration.model import ModelShape, Nvfp4MixedConfigError, choose_kv_cache_layout
    from vllm_nvfp4.policy import LayerType

    def shape(types):
        return ModelShape(num_layers=len(types), total_num_kv_heads=2, num_kv_heads=2, head_dim=32,
                          dtype="float32", max_positions=4096, block_size=16,
                          layer_types=tuple(types))

    swa, full, none = LayerType("sliding", 32), LayerType("full"), LayerType("none")
    monkeypatch.setattr(envs, "VLLM_KV_CACHE_LAYOUT", None, raising=False)
    config = _fake_config()
    assert choose_kv_cache_layout(config, shape([swa] * 4)) is None  # one kind: vLLM's choice
    assert choose_kv_cache_layout(config, shape([full] * 4)) is None
    assert choose_kv_cache_layout(config, shape([swa, full] * 2)) == "BLNHC"
    assert config.cache_config.kv_cache_layout == "BLNHC"
    config = _fake_config()
    assert choose_kv_cache_layout(config, shape([none, full] * 2)) == "BLNHC"
    monkeypatch.setattr(envs, "VLLM_KV_CACHE_LAYOUT", "BLHNC", raising=False)
    assert choose_kv_cache_layout(_fake_config(), shape([none, full] * 2)) == "BLHNC"
    monkeypatch.setattr(envs, "VLLM_KV_CACHE_LAYOUT", "LBNHC", raising=False)
    with pytest.raises(Nvfp4MixedConfigError, match="KV-cache layout LBNHC pads .*set it to BLNHC"):
        choose_kv_cache_layout(_fake_config(), shape([swa, full] * 2))


def test_mla_model_is_refused(tiny_model_dir, tmp_path):
    model = _variant(tiny_model_dir, tmp_path / "mla", architectures=["DeepseekV2ForCausalLM"],
                     model_type="deepseek_v2", kv_lora_rank=64, q_lora_rank=None,
                     qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                     n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                     first_k_dense_replace=4)
    with pytest.raises(ValueError, match="MLA"):
        _llm(model)


def test_explicit_other_backend_and_skip_layers_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="CPU_ATTN cannot serve kv_cache_dtype=nvfp4_mixed"):
        _llm(tiny_model_dir, attention_backend="CPU_ATTN")
    with pytest.raises(ValueError, match="skip-layers cannot be combined"):
        _llm(tiny_model_dir, kv_cache_dtype_skip_layers=["0"])


def test_other_dtypes_never_run_our_checks(tiny_model_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_NVFP4_POLICY", "not a policy")
    config = EngineArgs(model=str(tiny_model_dir), kv_cache_dtype="fp8",
                        max_model_len=256).create_engine_config()
    assert config.cache_config.cache_dtype == "fp8"


def test_vllm_plugins_without_ours_fails_clearly(tiny_model_dir):
    script = textwrap.dedent(f"""
        from vllm.engine.arg_utils import EngineArgs
        def build():
            try:
                EngineArgs(model={str(tiny_model_dir)!r}, kv_cache_dtype="nvfp4_mixed",
                           max_model_len=256).create_engine_config()
            except Exception as e:
                print("ERROR:", str(e).replace(chr(10), " ")[:600])
        if __name__ == "__main__":
            build()  # plugin not loaded: vLLM itself rejects the name
            from vllm_nvfp4.plugin import register
            register()  # imported by hand while VLLM_PLUGINS excludes it
            build()
    """)
    env = vllm_subprocess_env(VLLM_PLUGINS="lora_filesystem_resolver")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env)
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 2, out.stdout + out.stderr[-3000:]
    assert "nvfp4_mixed" in errors[0] and "cache_dtype" in errors[0]
    assert "VLLM_PLUGINS='lora_filesystem_resolver' leaves it out" in errors[1]
