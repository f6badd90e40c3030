"""Per-layer plans under pipeline parallelism and speculative drafts; KV-connector gating.

No engine runs here: the functions are called with the parts of vLLM's config they read, and the
connector refusal goes through ``LLM(...)``'s ``create_engine_config`` (it fails before a worker
starts).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from vllm_nvfp4.integration import connectors
from vllm_nvfp4.integration.dtype import CACHE_DTYPE
from vllm_nvfp4.integration.model import DRAFT_LAYER_POLICY, layer_plan

NUM_LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16
FORMATS = [("fp8", "fp8"), ("nvfp4", "nvfp4"), ("fp8", "nvfp4"), ("nvfp4", "fp8"),
           ("nvfp4", "nvfp4"), ("fp8", "fp8")]


def _config(tmp_path: Path, speculative: Optional[Any] = None, pp: int = 1) -> SimpleNamespace:
    """The fields of a VllmConfig that layer_plan reads; the policy is a file in the model dir."""
    import json

    policy = {"format": "vllm-nvfp4-policy", "version": 1, "num_layers": NUM_LAYERS,
              "layers": [{"index": i, "k": k, "v": v} for i, (k, v) in enumerate(FORMATS)]}
    (tmp_path / "nvfp4_policy.json").write_text(json.dumps(policy))
    model = SimpleNamespace(model=str(tmp_path), get_total_num_hidden_layers=lambda: NUM_LAYERS,
                            get_total_num_kv_heads=lambda: KV_HEADS,
                            get_num_kv_heads=lambda pc: KV_HEADS, get_head_size=lambda: HEAD_DIM,
                            dtype="float32", hf_text_config=SimpleNamespace(max_position_embeddings=4096))
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=BLOCK),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
                           speculative_config=speculative)


def _layer(name: str, kv_heads: int = KV_HEADS, head_size: int = HEAD_DIM) -> SimpleNamespace:
    return SimpleNamespace(layer_name=name, num_kv_heads=kv_heads, head_size=head_size)


def test_pipeline_stage_layers_take_their_global_policy_rows(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """PP=2: the second stage builds only layers 3-5, named with their global numbers."""
    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    config = _config(tmp_path, pp=2)
    for i in (3, 4, 5):
        index, row, layout = layer_plan(config, _layer(f"model.layers.{i}.self_attn.attn"))
        assert index == i
        assert (row.k, row.v) == FORMATS[i]
        assert (layout.k_format, layout.v_format) == FORMATS[i]
        assert (layout.num_kv_heads, layout.head_dim, layout.block_size) == (KV_HEADS, HEAD_DIM, BLOCK)


@pytest.mark.parametrize("name", [
    "model.layers.6.self_attn.attn",  # EAGLE: numbered after the target's 6 layers
    "model.layers.7.self_attn.attn",
    "draft_model.model.layers.0.self_attn.attn",  # method="draft_model"
    "draft_model.model.layers.1.self_attn.attn",
])
def test_draft_layers_follow_the_draft_rule_with_their_own_head_shape(
        tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(model="draft"))
    index, row, layout = layer_plan(_config(tmp_path, spec), _layer(name, kv_heads=1, head_size=32))
    assert index is None
    assert row is DRAFT_LAYER_POLICY and (row.k, row.v) == ("fp8", "fp8")
    assert (layout.num_kv_heads, layout.head_dim) == (1, 32)
    assert layout.page_bytes == BLOCK * 1 * (32 + 32)


def test_target_layers_keep_their_rows_next_to_a_draft(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(model="draft"))
    index, row, _ = layer_plan(_config(tmp_path, spec), _layer("model.layers.1.self_attn.attn"))
    assert index == 1 and (row.k, row.v) == FORMATS[1]


def test_without_a_draft_model_an_extra_layer_is_an_error(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """ngram speculation has no draft layers: a layer past the policy is still refused."""
    from vllm_nvfp4.integration.model import Nvfp4MixedConfigError

    monkeypatch.delenv("VLLM_NVFP4_POLICY", raising=False)
    ngram = SimpleNamespace(draft_model_config=None)
    with pytest.raises(Nvfp4MixedConfigError, match="cannot map attention layer"):
        layer_plan(_config(tmp_path, ngram), _layer("model.layers.6.self_attn.attn"))


# ------------------------------------------------------------------------------- KV connectors
def _transfer(name: Optional[str], **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(kv_connector=name, kv_connector_extra_config=extra)


def test_whole_block_connectors_are_accepted() -> None:
    for name in ("ExampleConnector", "OffloadingConnector", "SimpleCPUOffloadConnector"):
        connectors.check_kv_connectors(SimpleNamespace(kv_transfer_config=_transfer(name)))
    connectors.check_kv_connectors(SimpleNamespace(kv_transfer_config=None))
    multi = _transfer("MultiConnector", connectors=[{"kv_connector": "ExampleConnector"},
                                                    {"kv_connector": "OffloadingConnector"}])
    connectors.check_kv_connectors(SimpleNamespace(kv_transfer_config=multi))


@pytest.mark.parametrize("transfer, refused", [
    (_transfer("LMCacheConnectorV1"), "LMCacheConnectorV1"),
    (_transfer("NixlConnector"), "NixlConnector"),
    (_transfer("MultiConnector", connectors=[{"kv_connector": "OffloadingConnector"},
                                             {"kv_connector": "MooncakeConnector"}]),
     "MooncakeConnector"),
])
def test_other_connectors_are_refused_by_name(transfer: Any, refused: str) -> None:
    with pytest.raises(ValueError, match=rf"KV connector {refused} cannot move .*Supported: "
                                         r"ExampleConnector, OffloadingConnector"):
        connectors.check_kv_connectors(SimpleNamespace(kv_transfer_config=transfer))


def test_llm_with_a_token_level_connector_fails_at_start_up(tiny_model_dir: Path) -> None:
    from vllm import LLM

    from vllm_nvfp4.plugin import register

    register()
    with pytest.raises(ValueError, match="KV connector NixlConnector cannot move"):
        LLM(model=str(tiny_model_dir), kv_cache_dtype=CACHE_DTYPE, enforce_eager=True,
            max_model_len=256, distributed_executor_backend="uni",
            kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"})


def test_backend_declares_block_contiguous_layouts() -> None:
    """Connectors copy a layer's page as one run only under block-contiguous layouts."""
    from vllm_nvfp4.integration.backend import Nvfp4MixedBackend

    layouts = Nvfp4MixedBackend.supported_kv_cache_layouts()
    assert layouts and all(layout.is_block_contiguous and layout.is_block_compact
                           for layout in layouts)
    assert Nvfp4MixedBackend.supports_kv_connector()
