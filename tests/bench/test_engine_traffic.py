"""The real-traffic mode of `manyfold bench engine`: its workload plan, and a run of every mode on a tiny model."""

import json

import pytest
import torch

from serve.bench.engine_traffic import (LENGTHS_FILE, TrafficWorkload, bench_traffic, news_prompt_lengths, plan,
                                        poisson)
from tests.models import write_tiny_causal


def test_the_plan_mixes_every_kind_by_its_share_and_tenants_by_a_power_law():
    prompts = [[5] * n for n in (3, 9, 27)]
    requests = plan(TrafficWorkload(requests=2000, tenants=10, max_batch=8, full_share=0.2, emr_share=0.1), prompts)
    kinds = [r.model.split("-")[0].split("/")[0] for r in requests]
    assert 0.17 < kinds.count("full") / 2000 < 0.23 and 0.08 < kinds.count("emr") / 2000 < 0.12
    tenants = [int(r.model.split("-")[1]) for r in requests if r.model.startswith("tenant-")]
    assert tenants.count(0) > 3 * tenants.count(9)  # the first tenant is the hottest
    assert {len(r.prompt) for r in requests} == {3, 9, 27} and all(16 <= r.new_tokens <= 256 for r in requests)
    small = TrafficWorkload(requests=50, tenants=3, max_batch=8)
    assert plan(small, prompts) == plan(small, prompts)  # seeded: the same plan every run


def test_poisson_arrivals_come_at_the_rate_asked():
    times = poisson(4000, 5.0, 0)
    assert times == sorted(times) and 4000 / times[-1] == pytest.approx(5.0, rel=0.05)


@pytest.mark.slow
def test_the_lengths_file_is_what_the_packaged_articles_give():
    assert json.loads(LENGTHS_FILE.read_text()) == news_prompt_lengths()


def test_every_run_answers_every_request_with_its_tokens_and_counts_its_steps(tmp_path):
    model = write_tiny_causal(tmp_path / "m")
    workload = TrafficWorkload(requests=8, tenants=3, max_batch=4, full_share=0.3, emr_share=0.3, max_prompt=24,
                               outputs=(2, 6))
    report = bench_traffic(model, tmp_path / "work", torch.device("cpu"), workload, rates=(0.5, 0.9))
    assert set(report["runs"]) == {f"{layout} {run}" for layout in ("slots", "paged")
                                   for run in ("lockstep", "poisson 0.5x", "poisson 0.9x")}
    assert set(report["rows_by_kind"]) == {"lora", "full", "emr"} and sum(report["rows_by_kind"].values()) == 8
    for name, run in report["runs"].items():
        assert run["requests"] == 8 and run["output_tokens"] == report["output_tokens"]["total"], name
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] <= run["seconds"], name
        assert run["steps"].get("eager:cpu", 0) > 0 and run["steps_graphed"] == 0, name  # a CPU replays no graph
        assert 0 < run["rows_mean"] <= run["rows_most"] <= workload.max_batch and 0 < run["kv_live"] <= 1, name
    lockstep = report["runs"]["slots lockstep"]
    assert all(r["offered_req_s"] < lockstep["req_s"] for n, r in report["runs"].items() if "lockstep" not in n)
    # the same memory: one block of the whole context a row against blocks of 16, which hold mostly written tokens
    kv = report["kv_blocks"]
    assert kv["paged"] == kv["slots"] * 256 // 16
    assert report["runs"]["paged lockstep"]["kv_live"] > 2 * report["runs"]["slots lockstep"]["kv_live"]


def test_system_prompts_are_read_from_the_cache_by_a_models_later_requests_only_with_caching_on(tmp_path):
    model = write_tiny_causal(tmp_path / "m")
    workload = TrafficWorkload(requests=8, tenants=2, max_batch=4, full_share=0.0, emr_share=0.0, max_prompt=40,
                               outputs=(2, 4))
    report = bench_traffic(model, tmp_path / "work", torch.device("cpu"), workload, rates=(),
                           layouts=("paged", "paged-nocache"), system_prompt_tokens=48, rounds=3)
    assert report["system_prompt_tokens"] == 48 and report["prompt_tokens"]["min"] >= 48 + 32
    on, off = report["runs"]["paged lockstep"], report["runs"]["paged-nocache lockstep"]
    assert on["output_tokens"] == off["output_tokens"] == report["output_tokens"]["total"]
    assert on["prefix_hit_rate"] > 0.3 and off["prefix_hit_rate"] == 0  # 48 of about 130 tokens, for 6 of 8
    assert on["ttft_later_p50_s"] is not None and on["ttft_first_p50_s"] > 0
    for run in (on, off):  # three lockstep rounds, the layouts in turn: the median reported
        assert len(run["tok_s_rounds"]) == 3 and run["tok_s"] == sorted(run["tok_s_rounds"])[1]
