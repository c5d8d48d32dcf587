"""The Trans-LoRA bench's plumbing, with training, transfer and evaluation stubbed: every target, task and seed
is run, the guard's choice is made on each student's figures (the source adapter unchanged kept, or the seed
refused, while its student keeps its own row), a failed transfer is a failure of its seed, and a rerun reuses what
the work dir holds."""

import json
import re
import shutil
from pathlib import Path

import pytest

import serve.bench.translora as bench
import serve.bench.translora_ablation as ablation
import serve.data.models
from serve.adapters.data import PromptExample
from serve.adapters.generation_schedule import Sampling
from serve.adapters.tasks import LABEL_TASKS
from serve.adapters.transfer_guard import TransferFailed
from serve.bench.translora_table import ALONE, FILTERED, MOVED, STUDENT, UNCHANGED, UNFILTERED


@pytest.fixture
def stubs(monkeypatch, tmp_path):
    calls = {"train": 0, "transfer": 0, "evaluate": 0}

    def train_adapter(base, examples, out, init, rank, steps, lr, seed, progress):
        calls["train"] += 1
        Path(out).mkdir()
        log = {"log": [{"loss": 3.0 - step / steps} for step in range(steps)], "seconds": 1.0, "init_seconds": 0.1}
        (Path(out) / "train_log.json").write_text(json.dumps(log))

    def transfer(source, src, base, out, samples, rank, seed, budget_min, guard, use_filter=True,
                 measure_inputs=True):
        assert guard is False  # the student always written: the bench makes the guard's choice
        calls["transfer"] += 1
        calls.setdefault("options", {})[Path(out).name] = (use_filter, measure_inputs)
        if not use_filter and seed == 1:
            raise TransferFailed("x: failed: only 3 of 90 generated inputs accepted")
        Path(out).mkdir()
        compared = ({"student": 2.9, "target_alone": 3.0, "unchanged": 2.5, "unfit": None} if seed == 0 else
                    {"student": 3.1, "target_alone": 3.0, "unchanged": None, "unfit": "shapes"})
        (Path(out) / "translora_report.json").write_text(json.dumps(
            {"accepted": 40, "attempts": 90, "seconds": {"train": 1.0}, "outcome": "unguarded", "steps": 100,
             "lr": 3.125e-4, "validation": {"best_step": 45}, "compared": compared,
             "inputs": {"chosen": "as written" if use_filter and measure_inputs else "kept by the discriminator"}}))

    def evaluate(task, base, adapter, examples):
        calls["evaluate"] += 1
        loss = 3.0 if adapter is None else 2.0 + 0.1 * int(re.search(r"-s(\d)(-|$)", Path(adapter).name)[1])
        return {"loss": loss, **({"accuracy": 1 / loss} if task in LABEL_TASKS else {})}

    def examples(task, split="train", n=None):  # the packaged data sets take seconds to read; nothing here reads them
        return [PromptExample(prompt=f"{task} {split} {i}", completion=" yes") for i in range(n or 128)]

    for module in (bench, ablation):
        monkeypatch.setattr(module, "task_examples", examples)
        monkeypatch.setattr(module, "heldout_examples", lambda task, n=None: examples(task, "test", n))
    monkeypatch.setattr(bench, "by_module_name", lambda src, base, out: src)  # the stubs write no tensors
    monkeypatch.setattr(bench, "train_adapter", train_adapter)
    monkeypatch.setattr(bench, "train_discriminator", lambda base, src, *a, **k: (Path(src) / "translora").mkdir())
    monkeypatch.setattr(bench, "transfer", transfer)
    monkeypatch.setattr(bench, "evaluate", evaluate)
    monkeypatch.setattr(bench, "target_base", lambda name, work, log: work / name)
    monkeypatch.setattr(bench, "plot", lambda *a: None)
    monkeypatch.setattr(serve.data.models, "smollm2_dir", lambda: tmp_path / "source")
    return calls


def test_every_target_task_and_seed_runs_and_a_rerun_reuses_the_work_dir(stubs, tmp_path, capsys):
    out, work = tmp_path / "r.json", tmp_path / "work"
    report = bench.run_translora_bench(out, work, seeds=2, tasks=("spam", "tweets"),
                                       targets=("neuzip-k0", "new-version"))
    assert list(report["transfer"]) == ["neuzip-k0", "new-version"]
    tweets = report["transfer"]["new-version"]["tweets"]
    assert tweets["runs"][ALONE] == [{"loss": 3.0}] and len(tweets["runs"][UNCHANGED]) == 2
    assert tweets["runs"][MOVED][1] is None and tweets["failures"][MOVED][1].startswith("no better than the target")
    assert tweets["runs"][STUDENT][1] is not None and tweets["failures"][UNFILTERED] == {
        1: "x: failed: only 3 of 90 generated inputs accepted"}  # refused by the guard, its student still measured
    reports = tweets["reports"][MOVED]
    assert reports[0]["kept"] == "unchanged" and "kept" not in reports[1]  # seed 1: refused, nothing kept
    assert tweets["verdicts"][ALONE] == "no adapter"
    assert json.loads(out.read_text())["seeds"] == [0, 1]
    printed = capsys.readouterr().out
    assert "tweets (loss): Trans-LoRA is not judged against the target base alone" in printed
    assert ("tweets, Trans-LoRA: inputs kept of generated, per seed: 40/90 (100 steps at 3.1e-04, best at step 45, "
            "0.0 min, kept: unchanged, taught on the inputs as written), 40/90 (100 steps at 3.1e-04, best at step 45, "
            "0.0 min, taught on the inputs as written)") in printed
    assert "tweets, Trans-LoRA, the filter's inputs only: inputs kept of generated, per seed: 40/90 (" in printed
    assert FILTERED in tweets["verdicts"] and "is not judged against itself taught on the filter's inputs" in printed
    assert {stubs["options"][f"new-version-tweets-s0-{d}"] for d in ("moved", "filtered", "unfiltered")} == {
        (True, True), (True, False), (False, True)}  # measured, the filter's inputs only, no filter
    assert "tweets, Trans-LoRA, no filter: inputs kept of generated, per seed: 40/90 (" in printed
    first = dict(stubs)
    bench.run_translora_bench(out, work, seeds=2, tasks=("spam", "tweets"), targets=("neuzip-k0", "new-version"))
    assert stubs == first  # nothing trained, moved or evaluated twice, refused transfers included
    assert (work / "new-version-tweets-s1-unfiltered.failed").is_file()


def test_the_ablation_changes_one_choice_at_a_time_unguarded_and_resumes(stubs, tmp_path, monkeypatch, capsys):
    seen, written = [], []

    def synthesize(source, src, base, plan, use_filter, seed):
        written.append(use_filter)
        return Sampling(plan, [f"an input, filtered={use_filter}"])

    def transfer(source, src, base, out, rank, seed, guard, inputs, distillation, **choices):
        assert inputs.accepted == [f"an input, filtered={choices['use_filter']}"]
        assert inputs.plan.samples == choices["samples"]  # the stub's source adapter has no train_log.json
        choices["kd_temperature"] = None if distillation is None else distillation.temperature
        seen.append((Path(out).name, guard, choices))
        Path(out).mkdir(parents=True)
        (Path(out) / "translora_report.json").write_text(json.dumps(
            {"accepted": 6, "steps": choices["steps"] or 24, "lr": choices["lr"] or 1e-4,
             "validation": {"best_step": 8}}))

    monkeypatch.setattr(ablation, "transfer", transfer)
    monkeypatch.setattr(ablation, "synthesize", synthesize)
    args = (tmp_path / "a.json", tmp_path / "work")
    kw = {"seeds": 1, "tasks": ("headlines",), "targets": ("new-version",), "ablation": True}
    report = bench.run_translora_bench(*args, **kw)
    runs = report["ablation"]["new-version"]["headlines"]["seeds"][0]
    assert list(runs) == list(ablation.CHANGES) and not any(guard for _, guard, _ in seen)
    given = {name: choices for name, _, choices in seen}
    for config, change in ablation.CHANGES.items():  # each is the transfer as filed with its change, no more
        assert given[f"new-version-headlines-s0-{ablation.slug(config)}"] == {**ablation.AS_FILED, **change}, config
    assert runs["early stopping"]["best_step"] == 8 and runs["as filed"]["best_step"] is None
    assert sorted(written) == [False, True, True]  # once per filter and size (48, or as many as the real set)
    assert "ablation, headlines on new-version" in capsys.readouterr().out
    bench.run_translora_bench(*args, **kw)
    assert len(seen) == len(ablation.CHANGES)  # a rerun moves nothing again
    shutil.rmtree(tmp_path / "work" / "ablation" / "new-version-headlines-s0-as-filed")
    bench.run_translora_bench(*args, **kw)  # a configuration run again (or added) trains on the inputs kept
    assert len(seen) == len(ablation.CHANGES) + 1 and sorted(written) == [False, True, True]
    seen.clear()
    bench.run_translora_bench(tmp_path / "b.json", tmp_path / "work2", configs=("issue-36-lr-5e-4",), **kw)
    assert [name for name, _, _ in seen] == ["new-version-headlines-s0-issue-36-lr-5e-4"]  # --configs: those alone


def test_without_the_unfiltered_or_filtered_transfers_their_rows_and_verdicts_are_left_out(stubs, tmp_path,
                                                                                            capsys):
    report = bench.run_translora_bench(tmp_path / "r.json", tmp_path / "work", seeds=1, tasks=("headlines",),
                                       targets=("new-version",), inits=False, unfiltered=False, filtered=False)
    headlines = report["transfer"]["new-version"]["headlines"]
    assert stubs["transfer"] == 1 and list(headlines["reports"]) == [MOVED]
    assert not {UNFILTERED, FILTERED} & set(headlines["rows"]) and list(headlines["verdicts"]) == [ALONE, UNCHANGED]
    printed = capsys.readouterr().out
    assert MOVED in printed and "no filter" not in printed and "without the discriminator's filter" not in printed
    assert "the filter's inputs only" not in printed


@pytest.mark.parametrize("argv, why", [
    (["--configs", "issue-36-defaults"], "--configs picks configurations of the ablation: add --ablation"),
    (["--ablation", "--configs", "issue-36"], "--configs: issue-36 not among as-filed, "),
])
def test_configs_outside_the_ablation_or_unknown_is_one_line_before_any_work(argv, why, stubs, tmp_path, capsys):
    from serve.cli import main

    code = main(["bench", "translora", "--work", str(tmp_path / "work"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"manyfold: error: {why}") and err.count("\n") == 1
    assert not (tmp_path / "work").exists() and stubs == {"train": 0, "transfer": 0, "evaluate": 0}


def test_seeds_run_in_parts_and_merged_give_the_report_of_one_run(stubs, tmp_path, capsys):
    """A bench longer than one machine's session: seed 0 in one session, seed 1 in another (--first-seed), then
    --merge; the merged tables are those of both seeds run at once, failures and refusals included."""
    from serve.cli import main

    kw = {"tasks": ("spam", "tweets"), "targets": ("new-version",), "inits": False}
    whole = bench.run_translora_bench(tmp_path / "whole.json", tmp_path / "w0", seeds=2, **kw)
    bench.run_translora_bench(tmp_path / "a.json", tmp_path / "w1", seeds=1, **kw)
    part = bench.run_translora_bench(tmp_path / "b.json", tmp_path / "w2", seeds=1, first_seed=1, **kw)
    assert part["seeds"] == [1] and part["transfer"]["new-version"]["tweets"]["seeds"] == [1]
    capsys.readouterr()
    assert main(["bench", "translora", "--merge", str(tmp_path / "b.json"), str(tmp_path / "a.json"),
                 "--out", str(tmp_path / "merged.json")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["transfer"] == json.loads(json.dumps(whole["transfer"])) and merged["seeds"] == [0, 1]
    assert [p["file"] for p in merged["parts"]] == ["b.json", "a.json"]
    assert "seeds 0, 1" in capsys.readouterr().out

    code = main(["bench", "translora", "--merge", str(tmp_path / "a.json"), str(tmp_path / "whole.json"),
                 "--out", str(tmp_path / "twice.json")])
    err = capsys.readouterr().err
    assert code == 2 and err == "manyfold: error: whole.json: seed 0 of spam on new-version is in a.json too\n"
    assert not (tmp_path / "twice.json").exists()


def test_held_out_tasks_are_judged_by_accuracy_in_a_table_apart(stubs, tmp_path, capsys):
    report = bench.run_translora_bench(tmp_path / "r.json", tmp_path / "work", seeds=1,
                                       tasks=("headlines", "sentiment"), targets=("wider",), inits=False)
    assert report["transfer"]["wider"]["sentiment"]["metric"] == "accuracy"
    printed = capsys.readouterr().out
    tuned, held = printed[printed.index("\ntarget wider: "):].split("target wider (tasks no default was chosen on)")
    assert "headlines loss" in tuned and "sentiment" not in tuned
    assert "sentiment accuracy" in held and "headlines" not in held


def test_the_source_adapter_by_module_name_keeps_the_modules_that_fit_and_drops_the_others(tmp_path):
    """The wider target's baseline: PEFT refuses to load an adapter whose MLP tensors are of the source's width,
    so the row loads every module that fits (attention) and none that does not (both tensors of a resized MLP)."""
    import torch
    from safetensors.torch import load_file, save_file

    from serve.variants.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    def base(root, inner):
        root.mkdir()
        save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),
                   "model.layers.0.mlp.up_proj.weight": torch.zeros(inner, 8),
                   "model.layers.0.mlp.down_proj.weight": torch.zeros(8, inner)}, root / "model.safetensors")
        return root

    src = tmp_path / "adapter"
    src.mkdir()
    p = "base_model.model.model.layers.0."
    shapes = {"self_attn.q_proj": ((2, 8), (8, 2)), "mlp.up_proj": ((2, 8), (12, 2)),
              "mlp.down_proj": ((2, 12), (8, 2))}  # (A, B) of an MLP 12 wide
    tensors = {f"{p}{m}.lora_{part}.weight": torch.ones(shape) for m, (a, b) in shapes.items()
               for part, shape in (("A", a), ("B", b))}
    save_file(tensors, src / ADAPTER_WEIGHTS)
    (src / ADAPTER_CONFIG).write_text('{"r": 2}')
    assert bench.by_module_name(src, base(tmp_path / "same", 12), tmp_path / "a") == src  # fits: itself
    out = bench.by_module_name(src, base(tmp_path / "wider", 16), tmp_path / "b")
    assert out == tmp_path / "b" and (out / ADAPTER_CONFIG).read_text() == '{"r": 2}'
    assert sorted(load_file(out / ADAPTER_WEIGHTS)) == sorted(k for k in tensors if "q_proj" in k)
