"""The fairness scenario's report math on synthetic records (percentiles, service per second, the ratios), its
arrival plan and its stream reading; no server, no timing."""

import asyncio
import importlib.util
import json
import math
from collections import Counter

import httpx
import pytest

from loadtests.fairness import server_turns, unstolen
from loadtests.fairness_load import Caller, plan_arrivals, probe_rate, stream_one
from loadtests.fairness_report import (
    ALL,
    HEAVY,
    LIGHT,
    Record,
    checks,
    finite,
    main,
    repeat_checks,
    run_summary,
    served_tokens,
    service_bins,
    summarize,
    write_report,
)


def answered(tenant: str, sent_s: float, ttft_s: float, tokens: int = 4, gap_s: float = 0.5, prompt: int = 0,
             cached: int = 0) -> Record:
    """A request streamed to its end: `tokens` text chunks gap_s apart from its first one, after a prompt of
    `prompt` tokens (`cached` of them read from the prefix cache)."""
    first = sent_s + ttft_s
    return Record(tenant, sent_s, "200", ttft_s, tokens, [first + i * gap_s for i in range(tokens)], cached, prompt)


def test_ttft_percentiles_count_a_wait_that_never_saw_a_token_as_infinite_and_leave_refusals_out():
    records = [answered("a", i, 0.1 * (i + 1)) for i in range(98)]
    records += [Record("a", 99, "429"), Record("a", 99, "503")]
    s = summarize(records, 100)
    assert s["ttft_p50_s"] == pytest.approx(5.0) and s["ttft_p99_s"] == pytest.approx(9.8)
    assert (s["ok"], s["429"], s["errors"], s["timeouts"]) == (98, 1, 1, 0)
    s = summarize(records + [Record("a", 99, "timeout"), Record("a", 99, "timeout")], 100)
    assert s["ttft_p99_s"] == math.inf and s["timeouts"] == 2 and s["no_first_token"] == 2


def test_a_request_cut_after_its_first_token_keeps_its_ttft():
    r = Record("a", 0, "timeout", 0.4, 2, [0.4, 0.9])
    s = summarize([r], 10)
    assert s["ttft_p50_s"] == 0.4 and s["timeouts"] == 1 and s["no_first_token"] == 0


def test_service_bins_sum_to_the_tokens_served_and_place_each_chunk_in_its_second():
    r = Record("a", 0, "200", 0.2, 6, [0.2, 0.7, 1.1, 2.5])  # 4 text chunks, 6 tokens by usage
    bins = service_bins([r], 3)
    assert bins == pytest.approx([3.0, 1.5, 1.5])
    assert sum(bins) == pytest.approx(r.tokens)
    assert service_bins([r], 2) == pytest.approx([3.0, 1.5])  # chunks past the horizon are left out
    assert service_bins([r], 3, bin_s=0.5) == pytest.approx([1.5, 1.5, 1.5, 0, 0, 1.5])


def test_served_tokens_count_only_the_window():
    records = [answered("a", 0, 0.5, tokens=4, gap_s=1.0)]  # chunks at 0.5, 1.5, 2.5, 3.5
    assert served_tokens(records, 2.0) == 2
    assert summarize(records, 2.0)["tokens_per_s"] == 1.0


def test_a_runs_total_tokens_count_the_prompts_written_where_their_first_token_came():
    """A prompt is written before its first token: counted in the window if that token came in it, less what the
    prefix cache gave; the generated tokens as their chunks came."""
    inside = answered("a", 0, 1.0, tokens=4, gap_s=1.0, prompt=30, cached=16)  # chunks at 1, 2, 3, 4
    late = answered("a", 2, 2.5, tokens=2, prompt=500)  # first token at 4.5
    s = summarize([inside, late, Record("a", 0, "timeout")], 3.0)
    assert s["tokens"] == 2 and s["prompt_tokens"] == 14
    assert s["tokens_per_s"] == pytest.approx(2 / 3) and s["total_tokens_per_s"] == pytest.approx(16 / 3)


def test_run_summary_pools_the_light_tenants_apart_from_the_heavy_one():
    records = [answered("light1", 0, 0.2), answered("light2", 1, 0.4), answered(HEAVY, 0, 3.0),
               answered(HEAVY, 1, 4.0)]
    run = run_summary(records, 10, 10)
    assert list(run["tenants"]) == ["light1", "light2", HEAVY]
    assert run[LIGHT]["sent"] == 2 and run[LIGHT]["ttft_p99_s"] == pytest.approx(0.4)
    assert run[ALL]["sent"] == 4 and run[ALL]["ttft_p99_s"] == pytest.approx(4.0)
    assert run[ALL]["tokens_per_s"] == pytest.approx(1.6)
    assert set(run["service_per_s"]) == {"light1", "light2", HEAVY}
    assert all(len(b) == 10 for b in run["service_per_s"].values())


def test_checks_divide_vtc_by_the_baseline_and_by_fcfs():
    base = run_summary([answered("light1", i, 0.5) for i in range(10)], 10, 10)
    fcfs = run_summary([answered("light1", i, 8.0, prompt=40) for i in range(10)]
                       + [answered(HEAVY, i, 0.5, tokens=16, gap_s=0.1) for i in range(20)], 40, 40)
    vtc = run_summary([answered("light1", i, 0.75, prompt=40) for i in range(10)]
                      + [answered(HEAVY, i, 2.0, tokens=16, gap_s=0.1) for i in range(18)], 40, 40)
    c = checks({"baseline": base, "fcfs": fcfs, "vtc": vtc})
    assert c["vtc_light_p99_over_baseline"] == pytest.approx(1.5) and c["light_p99_ok"] is True
    assert c["fcfs_light_p99_over_baseline"] == pytest.approx(16.0)
    # the light prompts (400 tokens) written in both, two heavy completions (32 tokens) fewer under VTC
    assert c["vtc_total_over_fcfs"] == pytest.approx((400 + 40 + 288) / (400 + 40 + 320)) and c["total_ok"] is True
    assert c["vtc_output_over_fcfs"] == pytest.approx((40 + 288) / (40 + 320))
    missing = checks({"vtc": vtc})
    assert math.isnan(missing["vtc_light_p99_over_baseline"]) and missing["light_p99_ok"] is None


def test_an_infinite_vtc_p99_misses_the_goal():
    base = run_summary([answered("light1", 0, 0.5)], 10, 10)
    vtc = run_summary([Record("light1", 0, "timeout")], 10, 10)
    c = checks({"baseline": base, "vtc": vtc})
    assert c["vtc_light_p99_over_baseline"] == math.inf and c["light_p99_ok"] is False


def test_a_run_that_lost_its_cpu_to_other_guests_or_answered_no_light_request_alone_is_not_judged():
    """The light tenants alone, on a virtual machine whose hypervisor gave a third of its CPU to other guests, ran
    2.3x slower a step than VTC's run and timed out: VTC / alone came out 0 and the check said met. A run that lost
    more than STOLEN_LIMIT, or an alone run with an infinite p99, gives no ratio and no verdict."""
    base = run_summary([answered("light1", i, 0.5) for i in range(10)], 10, 10)
    vtc = run_summary([answered("light1", i, 0.75) for i in range(10)], 10, 10)
    assert checks({"baseline": {**base, "cpu_stolen": 0.01}, "vtc": vtc})["light_p99_ok"] is True
    c = checks({"baseline": {**base, "cpu_stolen": 0.34}, "vtc": {**vtc, "cpu_stolen": 0.04}})
    assert math.isnan(c["vtc_light_p99_over_baseline"]) and c["light_p99_ok"] is None
    assert c["stolen_runs"] == ["baseline"]
    timed_out = run_summary([Record("light1", 0, "timeout")], 10, 10)
    c = checks({"baseline": timed_out, "vtc": vtc})
    assert math.isnan(c["vtc_light_p99_over_baseline"]) and c["light_p99_ok"] is None
    assert repeat_checks([c, checks({"baseline": base, "vtc": vtc})])["light_p99_ok"] is None


def test_finite_makes_strict_json():
    out = finite({"a": math.inf, "b": [math.nan, 1.0], "c": {"d": 2}})
    assert out == {"a": None, "b": [None, 1.0], "c": {"d": 2}}
    json.dumps(out, allow_nan=False)


def test_the_probe_rate_counts_the_tokens_streamed_in_its_window_not_whole_completions():
    """A wave of requests ending just past the window's start adds its tokens inside the window only, so the rate
    does not move by a wave with where the window falls."""
    straddling = [answered("light1", 0.0, 9.5, tokens=4, gap_s=0.25) for _ in range(8)]  # 2 of 4 tokens in [10, 20]
    inside = [answered("light2", 11.0, 1.0, tokens=4) for _ in range(4)]
    refused = Record("heavy", 12.0, "429")
    rate = probe_rate([*straddling, *inside, refused], 10.0, 20.0)
    assert rate["tokens_per_request"] == 4
    assert rate["tokens_per_s"] == pytest.approx((8 * 2 + 4 * 4) / 10)
    assert rate["completed_rps"] == pytest.approx(rate["tokens_per_s"] / 4)
    assert rate["requests"] == 13 and rate["not_ok"] == 1


def test_a_light_tenants_arrivals_are_the_same_with_or_without_the_heavy_one():
    light, heavy = Caller("light1", "k1", "light1-lora"), Caller(HEAVY, "k2", "heavy-lora")
    alone = plan_arrivals({light: 0.5}, ["p", "q", "r"], 60, seed=3)
    beside = plan_arrivals({light: 0.5, heavy: 5.0}, ["p", "q", "r"], 60, seed=3)
    assert [(p.at_s, p.prompt) for p in beside if p.caller == light] == [(p.at_s, p.prompt) for p in alone]
    assert sum(p.caller == heavy for p in beside) > 100
    assert [p.at_s for p in beside] == sorted(p.at_s for p in beside)
    assert plan_arrivals({light: 0.5}, ["p", "q", "r"], 60, seed=4) != alone


def test_a_shape_changes_the_flood_and_a_burst_keeps_a_tenants_share():
    """light1 in bursts of 5 sends about its rate's requests, five at a time; the heavy tenants draw from their own
    prompts and ask their own tokens; the other light tenant's arrivals stay those of the plain flood."""
    light1, light2 = Caller("light1", "k1", "light1-lora"), Caller("light2", "k2", "light2-lora")
    heavy, heavy2 = Caller(HEAVY, "k3", "heavy-lora"), Caller("heavy2", "k4", "heavy2-lora")
    rates = {light1: 0.5, light2: 0.5, heavy: 5.0, heavy2: 5.0}
    plain = plan_arrivals(rates, ["p", "q"], 600, seed=3)
    shaped = plan_arrivals(rates, ["p", "q"], 600, seed=3, own_prompts={heavy: ["LONG"], heavy2: ["LONG"]},
                           max_tokens={heavy: 256, heavy2: 256}, bursts={light1: 5})
    bursts = Counter(p.at_s for p in shaped if p.caller == light1)
    assert set(bursts.values()) == {5} and 150 <= 5 * len(bursts) <= 450  # 0.5 req/s over 600 s in fives: 300 +-4 sd
    assert {(p.prompt, p.max_tokens) for p in shaped if p.caller in (heavy, heavy2)} == {("LONG", 256)}
    assert {p.max_tokens for p in shaped if p.caller in (light1, light2)} == {None}  # the run's
    assert [p for p in shaped if p.caller == light2] == [p for p in plain if p.caller == light2]


def test_repeats_are_judged_at_their_median_and_their_worst():
    def run(ratio: float, total: float) -> dict:
        return {"vtc_light_p99_over_baseline": ratio, "vtc_total_over_fcfs": total}

    c = repeat_checks([run(1.5, 0.97), run(2.9, 0.96), run(1.9, 1.0)])
    assert (c["light_p99_median"], c["light_p99_worst"], c["total_median"]) == (1.9, 2.9, 0.97)
    assert c["light_p99_ok"] and c["total_ok"]
    assert not repeat_checks([run(1.5, 0.97), run(3.1, 0.96), run(1.9, 1.0)])["light_p99_ok"]  # the worst, over 3
    assert not repeat_checks([run(2.1, 0.97), run(2.2, 0.96), run(1.9, 1.0)])["light_p99_ok"]  # the median, over 2
    assert repeat_checks([run(1.5, 0.97), run(math.nan, 1.0)])["light_p99_ok"] is None  # a run missing
    no_fcfs = repeat_checks([run(1.5, math.nan), run(2.5, math.nan)])  # --runs baseline,vtc
    assert (no_fcfs["light_p99_median"], no_fcfs["light_p99_worst"], no_fcfs["light_p99_ok"]) == (2.0, 2.5, True)
    assert math.isnan(no_fcfs["total_median"]) and no_fcfs["total_ok"] is None


def test_each_run_has_a_fresh_server_and_a_repeats_vtc_run_comes_next_to_its_baseline_under_vtc():
    turns = server_turns(["baseline", "fcfs", "vtc"], 3)
    assert turns == [(k, name, policy) for k in range(3)
                     for name, policy in (("vtc", "vtc"), ("baseline", "vtc"), ("fcfs", "fcfs"))]
    assert server_turns(["vtc"], 2) == [(0, "vtc", "vtc"), (1, "vtc", "vtc")]


def test_a_run_that_lost_its_cpu_is_measured_again_a_bounded_number_of_times_and_its_discards_kept():
    def measurements(*stolen):
        runs = iter([{"cpu_stolen": s, "at": i, "requests": [["light1", 0.0, "200", 0.1, 16]]}
                     for i, s in enumerate(stolen)])
        return lambda: next(runs)

    run = unstolen("vtc", measurements(0.12, None, 0.3), retries=2)  # no /proc/stat reading counts as none stolen
    assert run["at"] == 1 and [d["at"] for d in run["discarded"]] == [0]
    assert "requests" not in run["discarded"][0] and run["requests"]
    run = unstolen("vtc", measurements(0.12, 0.3, 0.2, 0.0), retries=2)  # the last try is kept, whatever it lost
    assert run["at"] == 2 and [d["cpu_stolen"] for d in run["discarded"]] == [0.12, 0.3]
    assert unstolen("vtc", measurements(0.3), retries=0)["discarded"] == []
    assert unstolen("vtc", measurements(0.05, 0.3), retries=2)["at"] == 0  # at the limit: judged


def test_every_tenant_named_heavy_is_pooled_apart_from_the_light_ones():
    records = [answered("light1", 0, 0.5), answered(HEAVY, 0, 5.0), answered("heavy2", 0, 9.0)]
    run = run_summary(records, 10, 10, heavy=(HEAVY, "heavy2"))
    assert run[LIGHT]["ttft_p99_s"] == 0.5 and list(run["tenants"]) == ["light1", HEAVY, "heavy2"]


def _sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def _stream(handler) -> Record:
    async def go() -> Record:
        rec = Record("light1", 0)
        async with httpx.AsyncClient(base_url="http://127.0.0.1", transport=httpx.MockTransport(handler)) as c:
            await stream_one(c, Caller("light1", "key", "light1-lora"), "hi", 16, rec, 0.0, 5)
        return rec

    return asyncio.run(go())


def test_stream_reading_takes_text_chunks_and_the_usage_count():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and request.headers["authorization"] == "Bearer key"
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        chunks = [{"choices": [{"text": t}], "usage": {"completion_tokens": n, "prompt_tokens": 40}}
                  for n, t in enumerate(("", "Hello", " wor", "ld"))]
        usage = {"completion_tokens": 4, "prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
        return httpx.Response(200, content=_sse(*chunks, {"choices": [], "usage": usage}, "[DONE]"))

    rec = _stream(handler)
    assert rec.outcome == "200" and rec.tokens == 4 and len(rec.chunk_s) == 3 and rec.ttft_s is not None
    assert rec.cached_tokens == 32 and rec.prompt_tokens == 40


def test_an_answer_without_text_has_its_first_token_when_it_ends_not_never():
    def handler(request: httpx.Request) -> httpx.Response:  # the model's first token ends the text: no text chunk
        end = {"choices": [{"text": "", "finish_reason": "stop"}],
               "usage": {"completion_tokens": 1, "prompt_tokens": 9}}
        return httpx.Response(200, content=_sse(end, "[DONE]"))

    rec = _stream(handler)
    assert rec.outcome == "200" and rec.tokens == 1 and rec.chunk_s == [] and rec.ttft_s is not None
    assert summarize([rec], 1.0)["ttft_p99_s"] == rec.ttft_s  # not an infinite wait


def test_stream_reading_counts_refusals_errors_and_streams_cut_short():
    assert _stream(lambda r: httpx.Response(429, json={"error": {}})).outcome == "429"
    error = _stream(lambda r: httpx.Response(200, content=_sse({"error": {"code": "x"}}, "[DONE]")))
    assert error.outcome == "stream-error"
    cut = _stream(lambda r: httpx.Response(200, content=_sse({"choices": [{"text": "a"}]})))
    assert cut.outcome == "incomplete" and cut.tokens == 1
    so_far = {"choices": [{"text": "a"}], "usage": {"completion_tokens": 2, "prompt_tokens": 7}}
    cut = _stream(lambda r: httpx.Response(200, content=_sse(so_far)))  # the counts so far, from its last chunk
    assert (cut.outcome, cut.tokens, cut.prompt_tokens) == ("incomplete", 2, 7)


def test_the_report_prints_and_writes_json_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the PNG needs the loadtest extra")
    base = run_summary([answered("light1", i, 0.5) for i in range(5)], 10, 10)
    vtc = run_summary([answered("light1", i, 0.6) for i in range(5)] + [Record(HEAVY, 1, "timeout")], 10, 10)
    report = {"machine": "test", "spec": {"rank": 8, "max_tokens": 16, "probe_concurrency": 16, "duration": 10,
                                          "seed": 0, "timeout": 60},
              "saturation": {"completed_rps": 3.0}, "rates_rps": {LIGHT: 0.3, HEAVY: 3.0},
              "runs": {"baseline": base, "vtc": vtc}}
    report["checks"] = checks(report["runs"])
    write_report(report, tmp_path / "fairness")
    out = capsys.readouterr().out
    assert "light*" in out and "never" in out and "not measured" in out
    assert json.loads((tmp_path / "fairness.json").read_text())["runs"]["vtc"][ALL]["ttft_p99_s"] is None
    assert (tmp_path / "fairness.png").stat().st_size > 0


def test_where_rows_waited_pools_each_groups_requests_over_the_run():
    """Per-tenant sums before and after a run (the server's per-tenant waits): each group's mean wait to join and to
    its first token over the run's requests alone, a tenant first seen after the run's start counted whole."""
    from loadtests.fairness import where_rows_waited

    before = {("queue", "light1"): (2, 1.0), ("first_token", "light1"): (2, 2.0), ("queue", HEAVY): (1, 5.0)}
    after = {("queue", "light1"): (6, 9.0), ("first_token", "light1"): (5, 11.0), ("queue", "light2"): (2, 2.0),
             ("first_token", "light2"): (2, 3.0), ("queue", HEAVY): (3, 15.0), ("first_token", HEAVY): (1, 4.0)}
    got = where_rows_waited(before, after, (HEAVY,))
    assert got[LIGHT]["rows"] == 6 and got[LIGHT]["queue_mean_s"] == pytest.approx(10 / 6)
    assert got[LIGHT]["first_token_mean_s"] == pytest.approx(12 / 5)
    assert (got[HEAVY]["rows"], got[HEAVY]["queue_mean_s"], got[HEAVY]["first_token_mean_s"]) == (2, 5.0, 4.0)


def test_the_shapes_table_reads_each_shapes_report_and_judges_its_runs(tmp_path, capsys):
    """Two shapes' reports of three runs: the table gives each run's light p99 alone and under VTC, their ratio,
    the median and the worst, and says met where both hold; a run whose light request never saw a token is never,
    and its shape not met. The rows go to OUT.json (and the plot to OUT.png, with the loadtest extra)."""
    def repeat(vtc_ttft: float | None) -> dict:
        vtc = [answered("light1", i, vtc_ttft) if vtc_ttft else Record("light1", i, "timeout") for i in range(5)]
        runs = {"baseline": run_summary([answered("light1", i, 0.5) for i in range(5)], 10, 10),
                "fcfs": run_summary([answered("light1", i, 4.0) for i in range(5)], 10, 10),
                "vtc": run_summary(vtc, 10, 10)}
        return {"runs": runs, "checks": checks(runs)}

    paths = []
    for shape, ttfts in (("flood", (0.6, 0.9, 1.2)), ("long-prompts", (0.6, None, 1.2)), ("old", (0.6, 0.6, 0.6))):
        reps = [repeat(t) for t in ttfts]
        report = {"spec": {"shape": shape}, "repeats": reps, "checks": repeat_checks([r["checks"] for r in reps])}
        if shape == "old":  # before prompt tokens were counted: its throughput ratios are of generated tokens
            report["checks"]["total_ratios"] = report["checks"].pop("output_ratios")
        paths.append(tmp_path / f"fairness-{shape}.json")
        paths[-1].write_text(json.dumps(finite(report)))
    assert main([*map(str, paths), "--out", str(tmp_path / "shapes")]) == 0
    lines = {line.split(" | ")[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert lines["| flood"].endswith("| 0.50, 0.50, 0.50 | 0.60, 0.90, 1.20 | 1.20, 1.80, 2.40 | 1.80 | 2.40 "
                                     "| 4.00, 4.00, 4.00 | 1.00, 1.00, 1.00 | 1.00, 1.00, 1.00 | met |")
    assert "| 0.60, never, 1.20 | 1.20, never, 2.40 |" in lines["| long-prompts"]
    assert lines["| long-prompts"].endswith("| not met |")
    assert lines["| old"].endswith("| - | 1.00, 1.00, 1.00 | met |")
    rows = json.loads((tmp_path / "shapes.json").read_text())
    assert [(r["shape"], r["met"]) for r in rows] == [("flood", True), ("long-prompts", False), ("old", True)]
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "shapes.png").stat().st_size > 0
    single = tmp_path / "single.json"
    single.write_text(json.dumps({"spec": {}, "runs": {}, "checks": {}}))
    assert main([str(single)]) == 1
    assert capsys.readouterr().out == f"error: not a report of repeated runs (--repeats N): {single}\n"
