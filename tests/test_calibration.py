"""Calibration, sensitivity analysis and selection on a tiny model with a planted outlier layer."""

from __future__ import annotations

import itertools
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from vllm_nvfp4.calibration.commands import run_calibrate, run_select
from vllm_nvfp4.calibration.data import DataError, load_windows, read_text
from vllm_nvfp4.calibration.evaluator import Evaluator
from vllm_nvfp4.calibration.modeling import load_model
from vllm_nvfp4.calibration.scales import observe_amax, scaled_policy
from vllm_nvfp4.calibration.selection import (
    count_fp8_slots,
    fp8_slots_for_budget,
    fraction_for_slots,
    naive_formats,
    predict,
    predicted_curve,
    select_formats,
)
from vllm_nvfp4.calibration.sensitivity import all_format, analyze, downgrade, load_report
from vllm_nvfp4.policy import KVPolicy
from vllm_nvfp4.testing.models import build_tiny_llama

OUTLIER_LAYER = 2
WINDOW = 128


def make_text(path: Path, kb: int = 120) -> Path:
    """Real text without downloads: Python standard library sources."""
    chunks, size = [], 0
    for name in ("argparse.py", "textwrap.py", "string.py", "difflib.py", "calendar.py"):
        t = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")
        chunks.append(t)
        size += len(t)
        if size > kb * 1000:
            break
    path.write_text("\n\n".join(chunks), encoding="utf-8")
    return path


def inject_k_outliers(model: torch.nn.Module, layer: int, factor: float) -> None:
    """Give ``layer``'s keys an outlier channel pair without changing the BF16 model's function.

    Channels ``c`` and ``c + D/2`` (a RoPE pair) of every KV head's key are multiplied by
    ``factor`` and the matching query channels divided by it: q.k is unchanged (RoPE rotates the
    pair as a whole), but every 16-block holding the outlier loses resolution in NVFP4.
    """
    attn = model.model.layers[layer].self_attn
    d = attn.head_dim
    group = attn.num_key_value_groups
    kv_heads = attn.k_proj.out_features // d
    with torch.no_grad():
        for h in range(kv_heads):
            for c in (3, 3 + d // 2):
                attn.k_proj.weight[h * d + c] *= factor
                for g in range(group):
                    attn.q_proj.weight[(h * group + g) * d + c] /= factor


@pytest.fixture(scope="module")
def outlier_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer tiny Llama whose layer-2 keys carry a 64x outlier channel pair (float32 weights)."""
    from transformers import AutoModelForCausalLM

    src = build_tiny_llama(num_layers=4, dtype="float32")
    out = tmp_path_factory.mktemp("outlier") / "model"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    inject_k_outliers(model, OUTLIER_LAYER, 64.0)
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_text(tmp_path_factory.mktemp("data") / "stdlib.txt")


@pytest.fixture(scope="module")
def report_dir(outlier_model_dir: Path, text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    analyze(outlier_model_dir, [text_file], out, window=WINDOW, windows=3, calib_windows=1, dtype="float32")
    return out


@pytest.fixture(scope="module")
def report_dir_nvfp4(outlier_model_dir: Path, text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report_nvfp4")
    analyze(outlier_model_dir, [text_file], out, window=WINDOW, windows=3, calib_windows=1, dtype="float32",
            base="nvfp4")
    return out


# ---------------------------------------------------------------------------- analysis
@pytest.mark.parametrize("base", ["fp8", "nvfp4"])
def test_outlier_keys_are_found_most_sensitive(base: str, report_dir: Path, report_dir_nvfp4: Path):
    """Swept from all-FP8 (the default) or all-NVFP4, the outlier layer's K is the slot whose
    NVFP4 costs most, by KL and by top-1 agreement."""
    report, scales = load_report(report_dir if base == "fp8" else report_dir_nvfp4)
    assert report["settings"]["base"] == base
    top1 = max((e[kv]["top1_marginal"], e["index"], kv) for e in report["layers"] for kv in ("k", "v"))
    assert top1[1:] == (OUTLIER_LAYER, "k") and top1[0] > 0
    slots = sorted(((e[kv]["kl_marginal"], e["index"], kv) for e in report["layers"] for kv in ("k", "v")),
                   reverse=True)
    assert (slots[0][1], slots[0][2]) == (OUTLIER_LAYER, "k"), slots
    assert slots[0][0] > 1.5 * slots[1][0]  # clearly, not by a hair
    cfg = report["configs"]
    assert cfg["reference_repeat"]["kl"] == 0 and cfg["reference_repeat"]["dnll"] == 0  # CPU is deterministic
    assert 0 < cfg["all_fp8"]["kl"] < cfg["all_nvfp4"]["kl"]
    # damage as KL (above) and top-1 agreement; delta NLL on this random-weight model's text is
    # noise of either sign (-0.15 nats/token for all-NVFP4 with the searched block scales)
    assert cfg["all_nvfp4"]["top1"] < cfg["all_fp8"]["top1"]
    assert report["settings"]["prefix_reuse"] is True
    assert scales.to_compact() == "0-3:fp8"
    assert report["data"]["eval_windows"] == 3 and cfg["reference"]["tokens"] == 3 * (WINDOW - 1)


def test_prefix_reuse_gives_identical_numbers(outlier_model_dir: Path, text_file: Path):
    model, tok, info = load_model(outlier_model_dir, "float32")
    toks = load_windows([text_file], tok, WINDOW, count=2, calib=1)
    scaled = scaled_policy(KVPolicy.from_compact("*:fp8", 4), observe_amax(model, toks.calib, 4))
    base = all_format(scaled, "fp8")
    fast, slow = Evaluator(model, toks.eval), Evaluator(model, toks.eval, reuse_prefix=False)
    for ev in (fast, slow):
        ev.reference()
        ev.set_baseline(base)
    assert fast.layers is not None and slow.layers is None
    policy = downgrade(base, 3, "v")
    assert fast.first_difference(policy) == 3
    n0 = fast.forwards
    a, b = fast.measure(policy), slow.measure(policy)
    assert (a.kl, a.dnll, a.nll, a.top1) == (b.kl, b.dnll, b.nll, b.top1)
    assert fast.forwards - n0 == 2  # one (partial) forward per window


def test_damage_metrics_against_hand_computed_values():
    """KL, NLL and top-1 agreement of 3 scored positions (the last logit row predicts nothing)."""
    from vllm_nvfp4.calibration.metrics import per_token_damage, reference_from_logits, summarize

    ref_logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [9.0, 9.0, 9.0]])
    ids = torch.tensor([0, 1, 1, 2])  # targets 1, 1, 2
    q_logits = torch.tensor([[2.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    ref = reference_from_logits(ref_logits, ids)
    kl, nll, top1 = per_token_damage(q_logits, ref)
    assert top1.tolist() == [True, False, False]
    lq = q_logits[:3].log_softmax(-1)
    lr = ref_logits[:3].log_softmax(-1)
    torch.testing.assert_close(kl, (lr.exp() * (lr - lq)).sum(-1))
    torch.testing.assert_close(nll, -lq[[0, 1, 2], [1, 1, 2]])
    m = summarize([kl], [nll], [top1], [ref])
    assert m.top1 == pytest.approx(1 / 3) and m.tokens == 3
    assert m.dnll == pytest.approx(float((nll - ref.nll).mean()))


def test_calibrated_scales_follow_the_conventions(outlier_model_dir: Path, text_file: Path):
    per_layer = run_calibrate(outlier_model_dir, [text_file], None, WINDOW, 2, dtype="float32")
    per_head = run_calibrate(outlier_model_dir, [text_file], "*:nvfp4", WINDOW, 2, per_head=True, dtype="float32")
    assert per_layer.to_compact() == "0:fp8,1-2:nvfp4,3:fp8"  # the default rule
    assert per_head.to_compact() == "0-3:nvfp4"
    for lp, lh in zip(per_layer.layers, per_head.layers):
        assert len(lh.k_scale) == 2 and len(lh.v_global_scale) == 2  # tiny model: 2 KV heads
        assert lp.k_scale == pytest.approx(max(lh.k_scale), rel=1e-6)
        assert lp.k_scale * 448 == pytest.approx(lp.k_global_scale * 2688, rel=1e-6)
        assert lp.v_scale * 448 == pytest.approx(lp.v_global_scale * 2688, rel=1e-6)
    # the planted outlier shows up in the amax of layer 2's keys
    k_amax = [lp.k_scale * 448 for lp in per_layer.layers]
    assert k_amax[OUTLIER_LAYER] > 5 * max(a for i, a in enumerate(k_amax) if i != OUTLIER_LAYER)
    prov = per_layer.provenance
    assert prov["tool"]["command"] == "calibrate" and prov["data"]["calib_windows"] == 2
    assert len(prov["model"]["config_sha256"]) == 64


# ---------------------------------------------------------------------------- selection
def _synthetic_report(damages: dict[tuple[int, str], float], base: float = 0.01) -> dict:
    """A report swept from all-FP8 (the sweep's default before ``base`` existed: no setting)."""
    layers = sorted({i for i, _ in damages})
    return {"configs": {"all_fp8": {"kl": base, "dnll": base}},
            "layers": [{"index": i, **{kv: {"kl": base + damages[(i, kv)], "dnll": base + damages[(i, kv)],
                                            "kl_marginal": damages[(i, kv)],
                                            "dnll_marginal": damages[(i, kv)]}
                                        for kv in ("k", "v")}} for i in layers]}


@pytest.mark.parametrize("num_layers", [1, 3, 5, 30, 64])
def test_budget_maps_to_the_most_fp8_slots_that_fit(num_layers: int):
    for budget in (0.5625, 0.58, 0.6, 0.62, 0.7, 0.8111, 0.99, 1.0):
        n = fp8_slots_for_budget(num_layers, budget)
        assert fraction_for_slots(num_layers, n) <= budget + 1e-12
        if n < 2 * num_layers:
            assert fraction_for_slots(num_layers, n + 1) > budget
    assert fp8_slots_for_budget(30, 0.62) == 7  # (0.62 - 0.5625) * 60 / 0.4375 = 7.89
    for bad in (0.5, 1.01, float("nan")):
        with pytest.raises(ValueError, match="budget"):
            fp8_slots_for_budget(30, bad)


def test_selector_is_exact_against_brute_force():
    g = torch.Generator().manual_seed(3)
    num_layers = 4
    damages = {(i, kv): float(torch.rand(1, generator=g)) for i in range(num_layers) for kv in ("k", "v")}
    report = _synthetic_report(damages)
    slots = list(damages)
    for n in range(2 * num_layers + 1):
        chosen = select_formats(report, n, "kl")
        fp8 = [(i, kv) for i, lp in enumerate(chosen.layers) for kv in ("k", "v") if lp.format_of(kv) == "fp8"]
        assert len(fp8) == n
        assert chosen.fraction_of_fp8() == pytest.approx(fraction_for_slots(num_layers, n))
        best = min(sum(damages[s] for s in slots if s not in keep) for keep in itertools.combinations(slots, n))
        assert predict(report, chosen, "kl") - 0.01 == pytest.approx(best)


def test_selector_from_an_all_nvfp4_sweep_is_exact_against_brute_force():
    """Swept from all-NVFP4, a slot's marginal is what FP8 there gains: the prediction starts at
    all-NVFP4 and subtracts the gains of the FP8 slots (top-1: adds the agreement they win)."""
    g = torch.Generator().manual_seed(4)
    num_layers, nv_kl, nv_top1 = 3, 0.2, 0.8
    gains = {(i, kv): float(torch.rand(1, generator=g)) / 100 for i in range(num_layers) for kv in ("k", "v")}
    report = {"settings": {"base": "nvfp4"},
              "configs": {"all_fp8": {"kl": 0.01, "top1": 0.95}, "all_nvfp4": {"kl": nv_kl, "top1": nv_top1}},
              "layers": [{"index": i, **{kv: {"kl": nv_kl - gains[(i, kv)], "kl_marginal": gains[(i, kv)],
                                              "top1": nv_top1 + 2 * gains[(i, kv)],
                                              "top1_marginal": 2 * gains[(i, kv)]}
                                         for kv in ("k", "v")}} for i in range(num_layers)]}
    slots = list(gains)
    for n in range(2 * num_layers + 1):
        chosen = select_formats(report, n, "kl")
        assert count_fp8_slots(chosen) == n
        best = max(sum(gains[s] for s in keep) for keep in itertools.combinations(slots, n))
        assert predict(report, chosen, "kl") == pytest.approx(nv_kl - best)
        by_top1 = select_formats(report, n, "top1")
        assert by_top1.layers == chosen.layers
        assert predict(report, by_top1, "top1") == pytest.approx(nv_top1 + 2 * best)
    with pytest.raises(ValueError, match="no dnll_marginal"):
        select_formats(report, 1, "dnll")


def test_selector_never_spends_budget_on_slots_where_fp8_is_worse():
    """Slots whose NVFP4 measured better than FP8 (negative marginal damage) stay NVFP4 even
    when the budget allows more FP8: fewer FP8 slots, lower predicted damage, smaller cache."""
    damages = {(0, "k"): 0.3, (0, "v"): -0.02, (1, "k"): 0.0, (1, "v"): 0.1, (2, "k"): -0.1,
               (2, "v"): 0.05}
    report = _synthetic_report(damages)
    chosen = select_formats(report, 5, "kl")
    assert chosen.to_compact() == "0:k=fp8,v=nvfp4,1-2:k=nvfp4,v=fp8"
    assert count_fp8_slots(chosen) == 3
    slots = list(damages)
    best = min(sum(damages[s] for s in slots if s not in keep)
               for n in range(6) for keep in itertools.combinations(slots, n))
    assert predict(report, chosen, "kl") - 0.01 == pytest.approx(best)
    curve = predicted_curve(report, "kl")
    assert len(curve) == 4 and curve[-1][0] == pytest.approx(fraction_for_slots(3, 3))


def test_naive_rule_keeps_first_and_last_layers():
    assert naive_formats(6, 0).to_compact() == "0-5:nvfp4"
    assert naive_formats(6, 2).to_compact() == "0:fp8,1-5:nvfp4"
    assert naive_formats(6, 4).to_compact() == "0:fp8,1-4:nvfp4,5:fp8"
    assert naive_formats(6, 5).to_compact() == "0:fp8,1:k=fp8,v=nvfp4,2-4:nvfp4,5:fp8"
    assert naive_formats(30, 7).to_compact() == "0-1:fp8,2:k=fp8,v=nvfp4,3-28:nvfp4,29:fp8"
    assert naive_formats(6, 12).to_compact() == "0-5:fp8"
    for n in range(13):
        assert naive_formats(6, n).fraction_of_fp8() == pytest.approx(fraction_for_slots(6, n))


def test_selection_beats_naive_on_measured_damage(report_dir: Path):
    policy, summary = run_select(report_dir, fp8_slots=2, metric="kl")
    assert policy.layers[OUTLIER_LAYER].k == "fp8"
    assert sum(lp.format_of(kv) == "fp8" for lp in policy.layers for kv in ("k", "v")) == 2
    sel, naive = summary["selected"]["measured"], summary["naive"]["measured"]
    assert summary["naive"]["policy"] == "0:fp8,1-3:nvfp4"
    # KL is the damage measure here: a random-weight model predicts text worse than uniform, so
    # any perturbation may lower its NLL and delta NLL carries no signal on it
    assert sel["kl"] < 0.5 * naive["kl"]
    # additivity is reported, and holds roughly on this model
    assert 0.5 < summary["selected"]["measured_over_predicted"]["kl"] < 2.0
    # the policy carries its scales and provenance
    report, scales = load_report(report_dir)
    assert policy.layers[0].k_scale == scales.layers[0].k_scale
    assert policy.provenance["model"]["config_sha256"] == report["model"]["config_sha256"]
    assert policy.provenance["selection"]["fp8_slots"] == 2
    assert policy.provenance["tool"]["name"] == "vllm-nvfp4"
    assert json.loads((report_dir / "selection-2.json").read_text())["fp8_slots"] == 2
    KVPolicy.from_dict(policy.to_dict())  # valid policy file content


def test_select_measures_on_more_windows(report_dir: Path):
    _, summary = run_select(report_dir, fp8_slots=1, metric="dnll", measure_windows=4)
    assert summary["measured_on"] == {"windows": 4, "window_tokens": WINDOW, "same_windows_as_analysis": False}
    assert summary["all_nvfp4"]["tokens"] == 4 * (WINDOW - 1)  # re-measured on the same 4 windows


# ---------------------------------------------------------------------------- data
def test_data_formats_and_errors(tmp_path: Path, tiny_model_dir: Path):
    from transformers import AutoTokenizer

    jl = tmp_path / "gsm.jsonl"
    jl.write_text('{"question": "1+1?", "answer": "2"}\n\n{"text": "plain"}\n')
    assert read_text(jl) == "Question: 1+1?\nAnswer: 2\n\nplain"
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        read_text(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    small = tmp_path / "small.txt"
    small.write_text("a few words only")
    with pytest.raises(DataError, match="need 255 after their prefixes"):
        load_windows([small], tok, 128, count=1, calib=1)
    w = load_windows([make_text(tmp_path / "t.txt", kb=20)], tok, 64, count=2, calib=1)
    assert w.calib.shape == (1, 64) and w.eval.shape == (2, 64)
    assert w.describe()["files"][0]["sha256"]


@pytest.mark.parametrize("k_smooth,k_center,k_permute", [(None, None, None), (0.5, None, None),
                                                        (None, True, True), (0.5, False, False)])
def test_report_commands_repeat_k_smoothing(k_smooth, k_center, k_permute):
    """The analyze command rebuilt from a report repeats --k-smooth / --k-center / --k-permute
    exactly when they were used (reports written before the flags existed have no such settings)."""
    from vllm_nvfp4.calibration.report import commands

    settings = {"window": 256, "windows": 2, "calib_windows": 1, "per_head": False}
    if k_smooth is not None:
        settings["k_smooth"] = k_smooth
    if k_center is not None:
        settings["k_center"] = k_center
    if k_permute is not None:
        settings["k_permute"] = k_permute
    report = {"settings": settings, "model": {"path": "M", "dtype": "bfloat16"},
              "data": {"files": [{"path": "d.txt"}]}}
    analyze = commands(report, [])[0]
    assert ("--k-smooth 0.5" in analyze) == (k_smooth is not None)
    assert ("--k-center" in analyze) == bool(k_center)
    assert ("--k-permute" in analyze) == bool(k_permute)
