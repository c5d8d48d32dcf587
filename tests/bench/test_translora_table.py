"""The Trans-LoRA bench's figures over seeds: mean and spread, the verdicts drawn from them, the printed table."""

import pytest

from serve.bench.translora import choose
from serve.bench.translora_table import (ALONE, MOVED, ROWS, UNCHANGED, UNFILTERED, UPPER, cell, gap_line,
                                         gaps_recovered, init_verdicts, mean_curve, print_transfer, summarize,
                                         task_verdicts, versus)
from serve.errors import ConfigError


def test_summarize_gives_mean_min_max_over_the_seeds_that_made_an_adapter():
    s = summarize([{"loss": 2.0}, None, {"loss": 4.0}])
    assert s == {"seeds": 3, "missing": 1, "loss": {"mean": 3.0, "min": 2.0, "max": 4.0}}
    assert summarize([None, None]) == {"seeds": 2, "missing": 2}


def test_versus_needs_a_gap_beyond_the_larger_spread():
    tight = summarize([{"loss": 1.0}, {"loss": 1.2}])  # mean 1.1, spread 0.2
    wide = summarize([{"loss": 1.0}, {"loss": 2.0}])  # mean 1.5, spread 1.0
    alone = summarize([{"loss": 2.0}])  # one run: no spread
    assert versus(tight, alone, "loss", -1) == "beats"
    assert versus(alone, tight, "loss", -1) == "falls short of"
    assert versus(tight, wide, "loss", -1) == "matches"  # 0.4 apart, within wide's spread of 1.0
    acc = summarize([{"accuracy": 0.9}, {"accuracy": 0.92}])
    assert versus(acc, summarize([{"accuracy": 0.5}]), "accuracy", 1) == "beats"


def test_a_seed_without_an_adapter_beats_nothing():
    partial = summarize([{"loss": 0.1}, None])
    assert versus(partial, summarize([{"loss": 9.0}]), "loss", -1) == "no adapter"


def _rows(moved: list, unchanged: list, unfiltered: list) -> dict:
    """Each row's summary from its losses per seed (None: that seed made no adapter)."""
    losses = {ROWS[0]: [1.0], ALONE: [3.0], UNCHANGED: unchanged, MOVED: moved, UNFILTERED: unfiltered,
              UPPER: [1.5]}
    return {row: summarize([None if v is None else {"loss": v} for v in vs]) for row, vs in losses.items()}


def test_task_verdicts_judge_trans_lora_against_each_baseline():
    rows = _rows(moved=[2.0, 2.1, 2.2], unchanged=[2.1, 2.1, 2.1], unfiltered=[None, 2.5, 2.6])
    assert task_verdicts("tweets", rows) == {ALONE: "beats", UNCHANGED: "matches", UNFILTERED: "no adapter"}


def test_the_printed_table_states_each_verdict_with_its_figures(capsys):
    rows = _rows(moved=[2.0, 2.1, 2.2], unchanged=[2.1, 2.1, 2.1], unfiltered=[2.5, 2.6, 2.7])
    tasks = {"tweets": {"metric": "loss", "heldout": 100, "rows": rows,
                        "reports": {"Trans-LoRA": [{"accepted": 40, "attempts": 90}, None, None]},
                        "failures": {"Trans-LoRA": {1: "failed: no better than the target alone"}},
                        "verdicts": task_verdicts("tweets", rows)}}
    print_transfer("new-version", {"description": "a new version",
                                   "perplexity": {"before": {"news": 38.8}, "after": {"news": 40.1}}}, tasks)
    out = capsys.readouterr().out
    assert "held-out perplexity, source -> this target: news 38.80 -> 40.10" in out
    assert "2.100 (2.000..2.200)" in out and "3.000" in out
    assert "tweets (loss): Trans-LoRA beats the target base alone by more than the spread over seeds: " \
           "2.100 (2.000..2.200) against 3.000" in out
    assert "Trans-LoRA matches the source adapter applied unchanged (within the spread over seeds)" in out
    assert "tweets, Trans-LoRA: inputs kept of generated, per seed: 40/90, -, -" in out
    assert "tweets, Trans-LoRA, seed 1: no adapter: failed: no better than the target alone" in out


def test_cell_marks_seeds_that_made_no_adapter():
    assert cell(summarize([{"loss": 1.0}, None, {"loss": 2.0}]), "loss") == "1.500 (1.000..2.000) [2/3]"
    assert cell(summarize([None]), "loss") == "no adapter"


def test_init_verdicts_use_means_over_seeds():
    def run(curves, held):
        return {"curve": mean_curve(curves), "heldout": summarize([{"loss": h} for h in held])}

    runs = {"pissa": run([[1.0, 1.0, 0.5, 0.5], [1.2, 1.0, 0.5, 0.5]], [0.1, 0.12]),
            "lora": run([[2.0, 1.5, 0.5, 0.5], [2.2, 1.5, 0.5, 0.5]], [0.1, 0.5])}
    assert runs["pissa"]["curve"] == pytest.approx([1.1, 1.0, 0.5, 0.5])
    assert init_verdicts(runs, 4) == {"PiSSA's training loss over the first half against LoRA's": "below",
                                      "PiSSA's held-out loss against LoRA's": "matches"}


def test_choose_takes_a_known_subset_and_refuses_others_in_one_line():
    assert choose(None, ("spam", "tweets"), "tasks") == ("spam", "tweets")
    assert choose("tweets, spam", ("spam", "tweets"), "tasks") == ("tweets", "spam")
    with pytest.raises(ConfigError, match="^--tasks: poems not among spam, tweets$"):
        choose("spam,poems", ("spam", "tweets"), "tasks")
    with pytest.raises(ConfigError, match="nothing given"):
        choose(",", ("spam",), "tasks")


def test_the_gap_recovered_is_each_seeds_share_of_the_way_from_the_target_alone_to_its_upper_bound():
    runs = {ALONE: [{"loss": 6.0}], UPPER: [{"loss": 3.0}, {"loss": 2.0}],
            MOVED: [{"loss": 4.5}, {"loss": 2.0}], UNCHANGED: [{"loss": 3.0}, None]}
    gaps = gaps_recovered("headlines", runs)
    assert gaps[MOVED]["gap"] == {"mean": 0.75, "min": 0.5, "max": 1.0}  # 1.5 of 3, then 4 of 4
    assert gaps[UNCHANGED]["missing"] == 1 and gaps[UNCHANGED]["gap"]["mean"] == 1.0
    spam = gaps_recovered("spam", {ALONE: [{"accuracy": 0.5}], UPPER: [{"accuracy": 0.9}],
                                   MOVED: [{"accuracy": 0.8}]})
    assert spam[MOVED]["gap"]["mean"] == pytest.approx(0.75)  # accuracy: higher is better, the same share
    assert gap_line("headlines", gaps) == ("headlines: gap recovered: Trans-LoRA 75% (50%..100%), the source "
                                           "adapter unchanged 100% (100%..100%) [1/2]")
