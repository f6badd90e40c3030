"""The long-context sink-key study: depths, the teacher-forced answer score against the full
logits, and every configuration scored on a tiny model whose policy flags the sink key."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from studies.sink_long_context_study import CONFIGS, answer_score, run, table
from vllm_nvfp4.calibration.hf_model import attention_modules
from vllm_nvfp4.calibration.kv_hooks import KVObserver, kv_cache_quantization
from vllm_nvfp4.calibration.scales import scaled_policy
from vllm_nvfp4.evaluation import passkey
from vllm_nvfp4.policy import KVPolicy

from tests.test_eval_accuracy import _CharTokenizer
from tests.test_kv_hooks import _ids, tiny_model


def test_spread_depths() -> None:
    assert passkey.spread_depths(3) == [0.1, 0.5, 0.9]
    assert passkey.spread_depths(5) == [0.1, 0.3, 0.5, 0.7, 0.9]  # eval_accuracy's default
    assert passkey.spread_depths(1) == [0.1]
    assert passkey.spread_depths(0) == []
    assert passkey.spread_depths(10)[1] == 0.189


def test_answer_score_is_the_full_forwards_answer_logprob() -> None:
    model = tiny_model(num_layers=2)
    ids = _ids(40)[0].tolist()
    answer = ids[-3:]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -4:-1].float(), -1)
    want = float(sum(lp[i, a] for i, a in enumerate(answer)))
    got, passes = answer_score(model, ids, answer)
    assert got == pytest.approx(want, abs=1e-4)
    assert passes == (lp.argmax(-1).tolist() == answer)
    greedy = ids[:-3]  # the model's own greedy continuation as the answer passes
    for _ in range(3):
        with torch.no_grad():
            greedy = greedy + [int(model(torch.tensor([greedy])).logits[0, -1].argmax())]
    assert answer_score(model, greedy, greedy[-3:])[1]


def _flagged_policy(model) -> KVPolicy:
    obs = KVObserver(len(attention_modules(model)))
    with torch.no_grad(), kv_cache_quantization(model, observer=obs):
        model(_ids(64), use_cache=False)
    pol = scaled_policy(KVPolicy.from_compact("*:nvfp4", obs.num_layers), obs, k_center=True)
    return replace(pol, layers=tuple(replace(lp, k_sink_uncentered=True) for lp in pol.layers))


def test_run_scores_every_configuration_and_the_sink_stores_differ() -> None:
    model = tiny_model(num_layers=2)
    tok = _CharTokenizer()
    res = run(model, tok, _flagged_policy(model), context=300, trials=2)
    assert list(res) == list(CONFIGS)
    trials = passkey.build_trials(tok, 300, passkey.spread_depths(2))
    for name, r in res.items():
        assert [t["depth"] for t in r["trials"]] == [0.1, 0.9]
        assert r["correct"] == sum(t["correct"] for t in r["trials"])
    plain = [round(answer_score(model, t.token_ids, t.answer_token_ids)[0], 4) for t in trials]
    assert [t["answer_logprob"] for t in res["unquantized"]["trials"]] == plain
    lps = {name: [t["answer_logprob"] for t in r["trials"]] for name, r in res.items()}
    assert lps["served"] != lps["centered"]  # the flagged sink key changes what is stored
    assert lps["centered + first key exact"] != lps["centered"]
    md = table(res)
    assert md.count("\n") == 2 + len(CONFIGS)
    assert "| centered | " in md and "| - |" in md


def test_bad_input_is_a_clear_error_and_a_run_is_not_overwritten(tmp_path, capsys) -> None:
    from studies.sink_long_context_study import main
    from vllm_nvfp4.testing.models import build_tiny_llama

    path = build_tiny_llama(num_layers=2)
    model = tiny_model(num_layers=2)
    pol = tmp_path / "policy.json"
    _flagged_policy(model).save(pol)
    plain = tmp_path / "plain.json"
    KVPolicy.from_compact("*:nvfp4", 2).save(plain)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sink_long_context.json").write_text("{}")
    cases = [
        (["--policy", str(pol), "--out", str(tmp_path / "out")], "exists"),
        (["--policy", str(plain), "--out", str(tmp_path / "o2")], "flags no sink key"),
        (["--policy", str(pol), "--out", str(tmp_path / "o3"), "--context", "10000000"], "--context"),
    ]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            main([str(path), *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert (tmp_path / "out" / "sink_long_context.json").read_text() == "{}"
