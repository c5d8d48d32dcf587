"""`manyfold bench logprobs` on a tiny model on the CPU: every kind's log probabilities through the engine pass
vLLM's rule against transformers in fp32, and the rule itself catches tokens that leave each other's top 5."""

import torch

from serve.bench.logprobs_check import KindCheck, compare, run_logprobs_check


def test_every_kind_through_the_engine_passes_against_transformers_in_fp32(tmp_path):
    report = run_logprobs_check(tmp_path / "out.json", tmp_path / "work", "cpu", "tiny", rows=2, new_tokens=6)
    kinds = {k["model"]: k for k in report["kinds"]}
    assert set(kinds) == {"base", "lora-mixed", "pissa", "full", "emr/t0", "emr/t1", "emr/t2", "nz7", "nz3"}
    assert report["passed"], report["kinds"]
    assert all(k["positions"] == 12 for k in kinds.values())
    assert 0 < kinds["base"]["max_abs_diff_top5"] < 0.1  # bf16 rows against fp32: close, not equal
    for model in ("lora-mixed", "pissa", "full", "emr/t0", "emr/t1", "emr/t2"):  # (k=3 is meant to stay near)
        assert kinds[model]["shift"] > 5 * kinds[model]["max_abs_diff_top5"], model  # a kind not applied would show


def test_the_rule_fails_a_token_outside_the_references_top_five():
    ref = torch.log_softmax(torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 2), -1)
    near = compare("k", "m", [[0]], [([1, 0], [{1: -1.0, 0: -1.2}, {0: -0.5}])], [ref])
    assert near.mismatches == 1 and near.failures == 0 and near.passed  # token 1 is the reference's second
    far = compare("k", "m", [[0]], [([6, 0], [{6: -1.0, 0: -2.0}, {0: -0.5}])], [ref])
    assert far.failures == 1 and not far.passed
    assert not KindCheck("k", "m").passed  # nothing compared is no pass
