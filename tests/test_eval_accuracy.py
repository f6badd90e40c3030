"""Pieces of the accuracy evaluation (vllm_nvfp4.evaluation): statistics, prompt log-prob
parsing, passkey prompts, KV configurations, lm-eval command and result parsing, reports.

Fast: no vLLM engine here (see ``test_eval_accuracy_engine.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_nvfp4.evaluation import gsm8k, passkey
from vllm_nvfp4.calibration.selection import count_fp8_slots
from vllm_nvfp4.evaluation.kv_configs import ConfigError, KVConfig, build_configs
from vllm_nvfp4.evaluation.logprobs import WindowScores, compare, ratio_to, scores_from_prompt_logprobs
from vllm_nvfp4.evaluation.report import check_targets, markdown_table, plot
from vllm_nvfp4.evaluation.stats import bootstrap_ratio, mean_interval, t975
from vllm_nvfp4.evaluation.windows import tail_windows
from vllm_nvfp4.model_shape import ModelShape
from vllm_nvfp4.policy import KVPolicy, default_policy

SHAPE = ModelShape(num_layers=6, total_num_kv_heads=2, num_kv_heads=2, head_dim=64, max_positions=4096,
                   dtype="bfloat16")


# ----------------------------------------------------------------------------- stats
def test_t_interval_matches_hand_computation() -> None:
    iv = mean_interval([1.0, 2.0, 3.0, 4.0])
    se = math.sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3 / 4)
    assert iv.mean == 2.5 and iv.n == 4
    assert iv.se == pytest.approx(se)
    assert iv.hi - iv.mean == pytest.approx(3.182 * se)
    assert mean_interval([0.7]).lo == mean_interval([0.7]).hi == 0.7
    assert t975(1) == 12.706 and 1.96 < t975(100) < 1.99


def test_bootstrap_ratio_brackets_the_point() -> None:
    num = [0.1, 0.12, 0.09, 0.11, 0.1, 0.13]
    den = [0.5, 0.55, 0.45, 0.5, 0.52, 0.6]
    point, lo, hi = bootstrap_ratio(num, den, reps=500)
    assert point == pytest.approx(sum(num) / sum(den))
    assert lo <= point <= hi and hi - lo < 0.05


# ----------------------------------------------------------------------------- log-probs
def _lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_scores_from_prompt_logprobs() -> None:
    ids = [5, 7, 9]
    plp = [None, {7: _lp(-0.5, 1)}, {9: _lp(-2.0, 3), 4: _lp(-0.1, 1)}]
    s = scores_from_prompt_logprobs(ids, plp)
    assert s.nll == (0.5, 2.0) and s.top1 == (7, 4)
    with pytest.raises(ValueError, match="no log-prob for the prompt token"):
        scores_from_prompt_logprobs(ids, [None, {3: _lp(-1, 1)}, {9: _lp(-1, 1)}])
    with pytest.raises(ValueError, match="entries"):
        scores_from_prompt_logprobs(ids, plp[:2])


def test_compare_paired_delta_nll_and_top1() -> None:
    ref = [WindowScores((1.0, 2.0), (3, 4)), WindowScores((1.0, 1.0), (5, 6))]
    oth = [WindowScores((1.5, 2.5), (3, 9)), WindowScores((1.0, 2.0), (5, 6))]
    c = compare(ref, oth)
    assert c.window_delta_nll == (0.5, 0.5) and c.delta_nll.mean == 0.5
    assert c.top1_agreement == 0.75 and c.tokens == 4
    assert c.nll == pytest.approx(7.0 / 4)
    same = compare(ref, ref)
    assert same.delta_nll.mean == 0 and same.top1_agreement == 1
    r = ratio_to(c, compare(ref, [WindowScores((2.0, 3.0), (3, 4)), WindowScores((2.0, 2.0), (5, 6))]))
    assert r["ratio"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- passkey
class _CharTokenizer:
    """One token per character: lengths are easy to reason about."""

    def __call__(self, text: str, add_special_tokens: bool = False, verbose: bool = True) -> dict:
        return {"input_ids": [ord(c) % 256 for c in text]}


class _BosCharTokenizer(_CharTokenizer):
    """One token per character, and BOS id 300 first when special tokens are added (as Gemma's)."""

    BOS = 300

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict:
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": [self.BOS, *ids] if add_special_tokens else ids}


class _ChatCharTokenizer(_CharTokenizer):
    """One token per character, no BOS, and a ChatML-like template whose first character is
    ``\x01`` (token 1), as SmolLM2's and Qwen2.5's templates start with ``<|im_start|>``."""

    chat_template = "\x01{{ role }}"

    def apply_chat_template(self, messages: list, tokenize: bool, add_generation_prompt: bool) -> str:
        assert not tokenize
        return "".join(f"\x01{m['role']}\n{m['content']}\n" for m in messages) + "\x01assistant\n"


def test_passkey_trials_fit_and_hold_the_key() -> None:
    trials = passkey.build_trials(_CharTokenizer(), 2000, [0.1, 0.5, 0.9], seed=1)
    assert len({t.key for t in trials}) == 3
    for t in trials:
        assert 1800 < len(t.token_ids) <= 2000
        text = "".join(chr(i) for i in t.prompt_token_ids)
        assert f"The pass key is {t.key}." in text and text.endswith("The pass key is")
        assert "".join(chr(i) for i in t.answer_token_ids) == " " + t.key
        assert abs(text.index(t.key) / len(text) - t.depth) < 0.15
    with pytest.raises(ValueError):
        passkey.build_trials(_CharTokenizer(), 2000, [1.5])


def test_passkey_score_is_greedy_equivalent() -> None:
    t = passkey.PasskeyTrial(key="42", depth=0.5, prompt_token_ids=(1, 2, 3), answer_token_ids=(8, 9))
    # positions 1..4 predict tokens 2, 3, 8, 9; only the last two (the answer) count
    hit = WindowScores(nll=(5.0, 5.0, 0.1, 0.2), top1=(0, 0, 8, 9))
    miss = WindowScores(nll=(0.0, 0.0, 0.1, 2.0), top1=(2, 3, 8, 7))
    res = passkey.score([t, t], [hit, miss])
    assert res["correct"] == 1 and res["accuracy"] == 0.5
    assert res["trials"][0]["answer_logprob"] == pytest.approx(-0.3)
    assert res["trials"][1]["answer_tokens_top1"] == 1
    assert res["mean_answer_logprob"] == pytest.approx((-0.3 - 2.1) / 2)
    with pytest.raises(ValueError, match="positions"):
        passkey.score([t], [WindowScores(nll=(1.0,), top1=(8,))])


# ----------------------------------------------------------------------------- configurations
def _calibrated(tmp_path: Path) -> Path:
    pol = KVPolicy.from_compact("0:fp8,1:nvfp4,2:k=fp8,v=nvfp4,3:fp8,4-5:nvfp4", 6)
    layers = [{"index": i, "k": lp.k, "v": lp.v, "k_scale": 0.01 * (i + 1), "v_scale": 0.02,
               "k_global_scale": 0.002, "v_global_scale": 0.003 * (i + 1)} for i, lp in enumerate(pol.layers)]
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"format": "vllm-nvfp4-policy", "version": 1, "num_layers": 6, "layers": layers}))
    return path


def test_build_configs_with_policy(tmp_path: Path) -> None:
    path = _calibrated(tmp_path)
    cfgs = {c.name: c for c in build_configs(
        ["auto", "fp8", "ours_fp8", "nvfp4_all", "mixed_calibrated", "mixed_naive"], SHAPE, path)}
    assert cfgs["auto"].expected_bytes_per_token(SHAPE) == 2 * 6 * 2 * 64 * 2
    assert cfgs["fp8"].expected_bytes_per_token(SHAPE) == 6 * 2 * 2 * 64
    assert cfgs["nvfp4_all"].fraction_of_fp8(SHAPE) == pytest.approx(0.5625)
    assert cfgs["ours_fp8"].fraction_of_fp8(SHAPE) == 1.0
    mixed, naive = cfgs["mixed_calibrated"].policy, cfgs["mixed_naive"].policy
    assert count_fp8_slots(mixed) == count_fp8_slots(naive) == 5  # same budget
    assert naive.to_compact() == "0:fp8,1:k=fp8,v=nvfp4,2-4:nvfp4,5:fp8" != mixed.to_compact()
    assert cfgs["mixed_naive"].expected_bytes_per_token(SHAPE) == cfgs["mixed_calibrated"].expected_bytes_per_token(SHAPE)
    for c in ("nvfp4_all", "mixed_naive", "ours_fp8"):  # calibrated scales carried over, layer by layer
        assert [lp.k_scale for lp in cfgs[c].policy.layers] == [lp.k_scale for lp in mixed.layers]
        assert [lp.v_global_scale for lp in cfgs[c].policy.layers] == [lp.v_global_scale for lp in mixed.layers]
    written = cfgs["mixed_naive"].write_policy(tmp_path / "pol")
    assert KVPolicy.load(written).to_compact() == naive.to_compact()
    assert cfgs["mixed_naive"].env(written) == {"VLLM_NVFP4_POLICY": str(written.resolve())}
    assert cfgs["auto"].write_policy(tmp_path / "pol") is None and cfgs["auto"].env(None) == {}


def test_build_configs_keep_the_models_sliding_layers(tmp_path: Path) -> None:
    """On a model with sliding-window layers every derived policy has the model's layer types, so a
    policy calibrated for that model lends its scales (it was refused before: types differ)."""
    from vllm_nvfp4.policy import LayerType

    types = (LayerType("sliding", 512),) * 2 + (LayerType("full"),) + (LayerType("sliding", 512),) * 2 + (LayerType("full"),)
    shape = replace(SHAPE, layer_types=types, model_dir=str(tmp_path))
    pol = KVPolicy.load(_calibrated(tmp_path))
    typed = KVPolicy(tuple(replace(lp, layer_type=t) for lp, t in zip(pol.layers, types)), source="typed")
    typed.save(tmp_path / "typed.json")
    cfgs = {c.name: c for c in build_configs(["ours_fp8", "nvfp4_all", "mixed_calibrated", "mixed_naive", "flag_only"],
                                             shape, tmp_path / "typed.json")}
    for name, c in cfgs.items():
        assert c.policy.layer_types == types, name
    for name in ("ours_fp8", "nvfp4_all", "mixed_naive"):
        assert [lp.k_scale for lp in cfgs[name].policy.layers] == [0.01 * (i + 1) for i in range(6)]
    assert cfgs["flag_only"].policy.to_compact() == default_policy(6, types).to_compact()
    assert build_configs(["nvfp4_all"], shape)[0].policy.layer_types == types  # no --policy: no scales, same types


def test_ours_fp8_from_an_all_fp8_policy(tmp_path: Path) -> None:
    """``--fp8-policy``: ours_fp8 is that policy as is (its own scales and K smoothing), the other
    configurations keep ``--policy``'s scales; a policy with NVFP4 slots is refused."""
    smooth = [[1.0] * 63 + [4.0], [2.0] + [1.0] * 63]
    layers = [{"index": i, "k": "fp8", "v": "fp8", "k_scale": 0.5, "v_scale": 0.25, "k_smooth": smooth}
              for i in range(6)]
    fp8 = tmp_path / "fp8.json"
    fp8.write_text(json.dumps({"format": "vllm-nvfp4-policy", "version": 1, "num_layers": 6, "layers": layers}))
    cfgs = {c.name: c for c in build_configs(["ours_fp8", "nvfp4_all"], SHAPE, _calibrated(tmp_path), fp8_policy_path=fp8)}
    ours = cfgs["ours_fp8"].policy
    assert ours == KVPolicy.load(fp8) and ours.layers[3].k_smooth[0][-1] == 4.0
    assert cfgs["ours_fp8"].fraction_of_fp8(SHAPE) == 1.0 and "fp8.json" in cfgs["ours_fp8"].description
    assert cfgs["nvfp4_all"].policy.layers[0].k_scale == 0.01
    with pytest.raises(ConfigError, match="not every layer is FP8"):
        build_configs(["ours_fp8"], SHAPE, fp8_policy_path=_calibrated(tmp_path))


def test_build_configs_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown configuration"):
        build_configs(["bf16"], SHAPE)
    with pytest.raises(ConfigError, match="needs --policy"):
        build_configs(["mixed_calibrated"], SHAPE)
    with pytest.raises(ConfigError, match="--budget"):
        build_configs(["mixed_naive"], SHAPE)
    naive = build_configs(["mixed_naive"], SHAPE, budget=0.62)[0]
    assert naive.fraction_of_fp8(SHAPE) <= 0.62 and naive.policy.layers[0].k_scale is None
    other = ModelShape(num_layers=4, total_num_kv_heads=2, num_kv_heads=2, head_dim=64, max_positions=1,
                       dtype="bfloat16")
    with pytest.raises(ValueError, match="4"):
        build_configs(["mixed_calibrated"], other, _calibrated(tmp_path))


def test_flag_only_is_the_zero_config_start(tmp_path: Path) -> None:
    """No policy file, VLLM_NVFP4_POLICY emptied (= unset), start-up calibration on; the default
    rule's bytes; refused when the model directory holds a policy the engine would serve."""
    shape = replace(SHAPE, model_dir=str(tmp_path))
    cfg = build_configs(["flag_only"], shape)[0]
    assert cfg.kv_cache_dtype == "nvfp4_mixed" and cfg.policy.to_compact() == "0:fp8,1-4:nvfp4,5:fp8"
    assert cfg.fraction_of_fp8(shape) == pytest.approx((4 + 8 * 0.5625) / 12)
    assert cfg.write_policy(tmp_path / "pol") is None and not (tmp_path / "pol").exists()
    assert cfg.env(None) == {"VLLM_NVFP4_POLICY": "", "VLLM_NVFP4_STARTUP_CALIBRATION": "1"}
    (tmp_path / "nvfp4_policy.json").write_text("{}")
    with pytest.raises(ConfigError, match="nvfp4_policy.json exists"):
        build_configs(["flag_only"], shape)


# ----------------------------------------------------------------------------- lm-eval glue
def test_lm_eval_command_is_copyable(tmp_path: Path) -> None:
    cmd = gsm8k.lm_eval_command("/m", "nvfp4_mixed", tmp_path / "o", 50, data_path=Path("/d/test.jsonl"))
    i = cmd.index("--model_args")
    assert cmd[cmd.index("--model") + 1] == "vllm"
    assert cmd[i + 1].startswith("pretrained=/m,kv_cache_dtype=nvfp4_mixed,")
    assert "enable_prefix_caching=True" in cmd[i + 1].split(",")
    assert cmd[cmd.index("--tasks") + 1] == gsm8k.TASK and cmd[cmd.index("--limit") + 1] == "50"
    assert (Path(cmd[cmd.index("--include_path") + 1]) / "gsm8k_nvfp4" / "gsm8k_nvfp4.yaml").is_file()
    line = gsm8k.printable(cmd, {"VLLM_NVFP4_POLICY": "/p q.json"})
    assert line.startswith("VLLM_NVFP4_POLICY='/p q.json' lm_eval --model vllm ")
    assert "--limit" not in gsm8k.lm_eval_command("/m", "fp8", tmp_path, None)
    assert "dtype=bfloat16" in cmd[i + 1].split(",")
    fp32 = gsm8k.lm_eval_command("/m", "fp8", tmp_path, None, dtype="float32")
    assert "dtype=float32" in fp32[fp32.index("--model_args") + 1].split(",")


def test_parse_lm_eval_outputs(tmp_path: Path) -> None:
    d = tmp_path / "out" / "model_dir"
    d.mkdir(parents=True)
    (d / "results_2026-01-01T00-00-00.json").write_text(json.dumps({
        "results": {gsm8k.TASK: {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1,
                                 "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": 0.12}},
        "n-samples": {gsm8k.TASK: {"original": 1319, "effective": 4}}}))
    rows = [{"doc_id": i, "filter": f, "exact_match": v}
            for f, vals in (("strict-match", [1, 0, 0, 0]), ("flexible-extract", [1, 1, 0, 0])) for i, v in enumerate(vals)]
    (d / f"samples_{gsm8k.TASK}_2026-01-01T00-00-00.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    res = gsm8k.parse_results(tmp_path / "out")
    assert res["n"] == 4 and res["strict-match"] == {"acc": 0.25, "stderr": 0.1}
    per = gsm8k.per_question(tmp_path / "out")
    assert per["flexible-extract"] == {0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0}
    pd = gsm8k.paired_difference(per["strict-match"], per["flexible-extract"])
    assert pd["diff"] == -0.25 and pd["n"] == 4 and pd["questions_differing"] == 1


def test_local_task_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm8k_task_utils", gsm8k.TASKS_DIR / "gsm8k_nvfp4" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"question": "1+1?", "answer": "2\n#### 2"}) + "\n\n")
    assert utils.read_items(f) == [{"question": "1+1?", "answer": "2\n#### 2"}]
    monkeypatch.setenv("VLLM_NVFP4_GSM8K", str(f))
    assert utils.gsm8k_path() == f and utils.gsm8k_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="prepare_assets"):
        utils.read_items(tmp_path / "missing.jsonl")


def test_gsm8k_task_has_one_fixed_fewshot_prefix(tmp_path: Path) -> None:
    """Every question from the 6th on gets the same 5 examples (vLLM's prefix cache shares them);
    questions 0-4 get the first 6 minus themselves, so no prompt contains its own answer."""
    from lm_eval.tasks import TaskManager

    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"})
                           for i in range(9)))
    task = TaskManager(include_path=str(gsm8k.TASKS_DIR), metadata={"data_path": str(f)}).load([gsm8k.TASK])[
        "tasks"][gsm8k.TASK]
    docs = list(task.test_docs())
    prompts = [task.fewshot_context(doc, task.config.num_fewshot) for doc in docs]
    shots = [p.split("\n\n")[:-1] for p in prompts]
    assert all(len(s) == 5 for s in shots)
    assert all(s == shots[5] for s in shots[5:]) and shots[5] == [f"Question: What is {i} + 1?\nAnswer: {i} + 1 = "
                                                                 f"{i + 1}\n#### {i + 1}" for i in range(5)]
    for i in range(5):
        assert not any(f"What is {i} + 1?" in s for s in shots[i]) and len(set(shots[i])) == 5
        assert prompts[i].endswith(f"Question: What is {i} + 1?\nAnswer:")


# ----------------------------------------------------------------------------- windows, reports
def test_tail_windows_come_from_the_end(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("a" * 5000 + "\n" + "b" * 3000)
    w = tail_windows(f, _CharTokenizer(), 3, 1000)
    assert [len(x) for x in w] == [1000, 1000, 1000]
    assert all(t == ord("b") for t in w[-1]) and w[0][0] == ord("b")
    with pytest.raises(ValueError, match="need"):
        tail_windows(f, _CharTokenizer(), 10, 1000)


def test_windows_and_passkey_prompts_start_with_the_tokenizers_bos(tmp_path: Path) -> None:
    from vllm_nvfp4.calibration.data import load_windows, text_prefix

    bos = _BosCharTokenizer.BOS
    assert text_prefix(_BosCharTokenizer()) == [bos] and text_prefix(_CharTokenizer()) == []
    f = tmp_path / "t.txt"
    text = "".join(chr(97 + i % 26) for i in range(5000))
    f.write_text(text)
    tail = tail_windows(f, _BosCharTokenizer(), 2, 100)
    assert [w[0] for w in tail] == [bos, bos] and [len(w) for w in tail] == [100, 100]
    assert "".join(chr(t) for w in tail for t in w[1:]) == text[-198:]  # 99 text tokens each, consecutive
    lw = load_windows([f], _BosCharTokenizer(), 50, count=2, calib=1)
    assert lw.calib.shape == (1, 50) and lw.eval.shape == (2, 50)
    rows = [lw.calib[0].tolist(), *lw.eval.tolist()]
    assert [r[0] for r in rows] == [bos] * 3
    assert "".join(chr(t) for r in rows for t in r[1:]) == text[:147]
    for t in passkey.build_trials(_BosCharTokenizer(), 2000, [0.1, 0.9], seed=1):
        assert t.prompt_token_ids[0] == bos and bos not in t.prompt_token_ids[1:]
        assert 1800 < len(t.token_ids) <= 2000


def test_bos_less_chat_tokenizers_calibrate_both_first_tokens(tmp_path: Path) -> None:
    """A tokenizer that adds no BOS but has a chat template: completions start with text, chat
    requests with the template's first token, so windows and passkey prompts take the two in turn
    (consecutive text after each); a template starting with the BOS adds nothing."""
    from vllm_nvfp4.calibration.data import load_windows, served_prefixes

    assert served_prefixes(_ChatCharTokenizer()) == ((), (1,))
    assert served_prefixes(_CharTokenizer()) == ((),)
    assert served_prefixes(_BosCharTokenizer()) == ((_BosCharTokenizer.BOS,),)
    f = tmp_path / "t.txt"
    text = "".join(chr(97 + i % 26) for i in range(5000))
    f.write_text(text)
    lw = load_windows([f], _ChatCharTokenizer(), 50, count=2, calib=2)
    rows = [*lw.calib.tolist(), *lw.eval.tolist()]
    assert [len(r) for r in rows] == [50] * 4 and [r[0] == 1 for r in rows] == [False, True] * 2
    assert "".join(chr(t) for r in rows for t in (r if r[0] != 1 else r[1:])) == text[:198]
    assert lw.describe()["prefixes"] == [[], [1]]
    tail = tail_windows(f, _ChatCharTokenizer(), 3, 100)
    assert [w[0] == 1 for w in tail] == [False, True, False]
    assert "".join(chr(t) for w in tail for t in (w if w[0] != 1 else w[1:])) == text[-299:]
    trials = passkey.build_trials(_ChatCharTokenizer(), 2000, [0.1, 0.5, 0.9], seed=1)
    assert [t.prompt_token_ids[0] == 1 for t in trials] == [False, True, False]
    assert all(1 not in t.prompt_token_ids[1:] and len(t.token_ids) <= 2000 for t in trials)


def _results(mixed_dnll: float, mixed_pk: int) -> dict:
    def cfg(frac: float, dnll: float, pk: int, acc: float) -> dict:
        return {"fraction_of_fp8": frac, "kv_bytes": {"expected": int(frac * 1000), "measured": frac * 1000},
                "nll": {"delta_nll": {"mean": dnll, "lo": dnll - 0.01, "hi": dnll + 0.01}, "top1_agreement": 0.9},
                "passkey": {"correct": pk, "trials": [{}] * 5, "mean_answer_logprob": -0.5},
                "gsm8k": {"n": 10, "strict-match": {"acc": acc, "stderr": 0.05},
                          "flexible-extract": {"acc": acc, "stderr": 0.05}}}
    return {"model_name": "m", "configs": {
        "auto": {**cfg(2.0, 0, 5, 0.4), "nll": {"nll": 2.0}},
        "fp8": cfg(1.0, 0.001, 5, 0.4), "nvfp4_all": cfg(0.5625, 0.1, 4, 0.3),
        "mixed_calibrated": cfg(0.6, mixed_dnll, mixed_pk, 0.39)},
        "dnll_ratio_mixed_over_nvfp4_all": {"ratio": mixed_dnll / 0.1, "lo": 0.0, "hi": 1.0},
        "noise_floor": {"delta_nll": {"mean": 0.0, "lo": 0.0, "hi": 0.0}, "top1_agreement": 1.0}}


def test_targets_and_table(tmp_path: Path) -> None:
    good = {c["target"]: c["status"] for c in check_targets(_results(0.02, 5))}
    assert set(good.values()) == {"pass"}
    bad = {c["target"]: c["status"] for c in check_targets(_results(0.05, 4))}
    assert bad["ΔNLL <= 30% of all-NVFP4"] == "FAIL" and bad["passkey equal to FP8 (fp8)"] == "FAIL"
    both = _results(0.02, 5)
    both["configs"]["ours_fp8"] = {**both["configs"]["fp8"], "passkey": {"correct": 6, "trials": [{}] * 6}}
    two = {c["target"]: c["status"] for c in check_targets(both)}
    assert two["passkey equal to FP8 (fp8)"] == "pass" and two["passkey equal to FP8 (ours_fp8)"] == "FAIL"
    assert two["GSM8K strict-match within max(1 pt, stderr) of FP8 (ours_fp8)"] == "pass"
    del both["configs"]["fp8"], both["configs"]["ours_fp8"]
    none = {c["target"]: c["status"] for c in check_targets(both)}
    assert none["GSM8K and passkey vs FP8"] == "n/a" and not any(t.endswith("fp8)") for t in none)
    weak = _results(0.02, 5)
    for c in weak["configs"].values():
        c["gsm8k"]["flexible-extract"]["acc"] = c["gsm8k"]["strict-match"]["acc"] = 0.02
    assert all(c["status"].startswith("n/a") for c in check_targets(weak) if "GSM8K" in c["target"])
    res = _results(0.02, 5)
    res["configs"]["mixed_calibrated"]["gsm8k"]["paired_vs"] = {
        "ours_fp8": {"flexible-extract": {"diff": 0.01, "stderr": 0.005}}}
    table = markdown_table(res)
    assert table.count("\n") == 5 and "| mixed_calibrated | 600.0 | 600 | 0.600 | +0.0200" in table
    assert table.splitlines()[-1].endswith("| ours_fp8 +1.0 ± 0.5 |")
    pytest.importorskip("matplotlib")
    assert plot(_results(0.02, 5), tmp_path / "a.png").stat().st_size > 1000


def test_gsm8k_configs_must_be_a_subset_of_configs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vllm_nvfp4.evaluation.accuracy_args import parse_args

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "g.jsonl").write_text("{}\n")
    base = [str(tmp_path), "--out", str(tmp_path / "o"), "--nll-windows", "0", "--gsm8k-n", "2",
            "--gsm8k-data", str(tmp_path / "g.jsonl"), "--configs", "auto,fp8,mixed_calibrated"]
    assert parse_args(base).gsm8k_configs == ["auto", "fp8", "mixed_calibrated"]
    assert parse_args(base + ["--gsm8k-configs", "fp8, mixed_calibrated"]).gsm8k_configs == [
        "fp8", "mixed_calibrated"]
    with pytest.raises(SystemExit) as e:
        parse_args(base + ["--gsm8k-configs", "fp8,nvfp4_all"])
    assert e.value.code == 2 and "--gsm8k-configs nvfp4_all: not in --configs" in capsys.readouterr().err
