"""Trans-LoRA end to end on tiny random models of two architectures and tokenizers: a discriminator trained
beside an adapter, a transfer to another base, the attempt cap, and a store-wide transfer that resumes."""

import json
import shutil

import pytest
import torch

from serve.adapters import candidates, translora, translora_store
from serve.adapters.train import train_adapter
from serve.adapters.validation import read_validation
from serve.errors import ConfigError
from serve.store.store import Store
from serve.variants import variant_kind
from serve.variants.lora import TRANSLORA_DIR
from tests.adapters import VOCAB, toy_task
from tests.models import WORDS, write_tiny_causal

def test_discriminator_keeps_seeds_a_validation_set_and_task_beside_the_adapter(source_adapter):
    task, seeds, disc = translora.read_assets(source_adapter)
    assert task.name == "toy" and task.form == "prompt" and seeds == toy_task()[:5]
    assert read_validation(source_adapter) == toy_task()[5:14]
    assert (disc / "adapter_model.safetensors").is_file()


def test_transfer_across_architectures_and_tokenizers(bases, source_adapter, tmp_path, any_student_passes):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = translora.transfer(bases[0], source_adapter, bases[1], tmp_path / "moved", samples=4, max_attempts=48,
                                steps=3)  # the default student: PiSSA
    assert 1 <= report.accepted <= 4 and report.attempts <= 48 and len(report.losses) == 3
    assert report.accepted + report.rejected + report.dropped + report.surplus == report.attempts
    gen = report.generation  # the real discriminator's verdicts, batch by batch
    assert gen["min_accepted"] == 1 and gen["max_attempts"] == 48 and report.attempts <= gen["planned_attempts"]
    assert sum(b["attempts"] for b in gen["batches"]) == report.attempts
    assert sum(b["accepted"] for b in gen["batches"]) == report.accepted
    assert gen["acceptance_rate"] == round((report.accepted + report.surplus) / report.attempts, 4)
    assert gen["temperatures"] == sorted({b["temperature"] for b in gen["batches"]})
    assert report.rank == 4  # the source's rank as trained; its converted PiSSA form stores 2r
    assert report.validation["examples"] == 9 and report.compared["unchanged"] is None
    assert report.compared["unfit"] == "the two bases' tokenizers differ"  # no unchanged adapter to compare with
    assert json.loads((tmp_path / "moved" / "adapter_config.json").read_text())["r"] == 8
    written = json.loads((tmp_path / "moved" / translora.REPORT_FILE).read_text())
    assert written["accepted"] == report.accepted and written["task"] == "toy"
    assert written["generation"] == report.generation
    target = AutoModelForCausalLM.from_pretrained(bases[1])
    before = target.lm_head.weight.clone()
    model = PeftModel.from_pretrained(target, tmp_path / "moved").eval()
    ids = AutoTokenizer.from_pretrained(bases[1])("the cat sat", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape[-1] == len(WORDS)
    assert torch.equal(target.lm_head.weight, before)


def test_a_generator_that_never_passes_stops_at_the_cap(bases, source_adapter, tmp_path, monkeypatch):
    written = []
    real = candidates.generate_candidates

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        written.extend(out)
        return out

    monkeypatch.setattr(candidates, "generate_candidates", counting)
    monkeypatch.setattr(translora.Discriminator, "accepts", lambda self, xs: [False] * len(xs))
    short = (r"only 0 of 20 generated inputs accepted \(0.0%\), short of the 1 a student needs \(--min-accepted\), "
             r"after ")
    with pytest.raises(translora.TransferFailed, match=short + "--max-attempts 20"):
        translora.transfer(bases[0], source_adapter, bases[1], tmp_path / "never", samples=4, max_attempts=20)
    assert len(written) == 20 and not (tmp_path / "never").exists()


def test_generation_varies_temperature_and_the_seeds_shown_and_a_seed_repeats_it(bases, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    calls = []
    real = candidates.generate

    def spying(model, tok, prompts, max_new_tokens, temperature, seed, stop=None):
        calls.append((temperature, prompts))
        return real(model, tok, prompts, max_new_tokens, temperature, seed, stop)

    monkeypatch.setattr(candidates, "generate", spying)
    tok = AutoTokenizer.from_pretrained(bases[0])
    model = AutoModelForCausalLM.from_pretrained(bases[0]).eval()
    seeds = [" ".join(VOCAB[i:i + 3]) for i in range(0, 15, 3)]
    first = candidates.generate_candidates(model, tok, seeds, "toy", 24, seed=3, batch=8)
    assert [t for t, _ in calls] == [0.7, 1.0, 1.3]
    prompts = [p for _, batch in calls for p in batch]
    assert len(set(prompts)) > 12  # each row its own subset and order of the seeds
    assert candidates.generate_candidates(model, tok, seeds, "toy", 24, seed=3, batch=8) == first


def test_a_transfer_short_of_the_floor_fails_in_one_line_with_its_figures(bases, source_adapter, tmp_path, capsys,
                                                                          monkeypatch):
    from serve.cli import main

    shown = iter(range(1000))
    monkeypatch.setattr(translora.Discriminator, "accepts", lambda self, xs: [next(shown) == 0 for _ in xs])
    code = main(["translora", "--source-base", str(bases[0]), "--adapter", str(source_adapter), "--target-base",
                 str(bases[1]), "--out", str(tmp_path / "moved"), "--samples", "8", "--max-attempts", "16",
                 "--min-accepted", "3"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and not (tmp_path / "moved").exists()
    assert err.startswith(f"manyfold: error: {source_adapter}: failed: only 1 of 16 generated inputs accepted "
                          f"(6.2%), short of the 3 a student needs (--min-accepted), after --max-attempts 16: add seed "
                          f"examples")
    assert err.rstrip().endswith(f"or lower --min-accepted; nothing written to {tmp_path / 'moved'}")


@pytest.mark.parametrize("flags, message", [
    (["--min-accepted", "0"], "min_accepted must be between 1 and samples (24); got 0"),  # its training examples
    (["--samples", "8", "--max-attempts", "1"], "max_attempts (1) must be >= min_accepted (2)")])
def test_a_floor_or_cap_that_cannot_work_is_refused_in_one_line(bases, source_adapter, tmp_path, capsys, flags,
                                                                 message):
    from serve.cli import main

    code = main(["translora", "--source-base", str(bases[0]), "--adapter", str(source_adapter), "--target-base",
                 str(bases[1]), "--out", str(tmp_path / "moved"), *flags])
    assert code == 2 and capsys.readouterr().err == f"manyfold: error: {message}\n"


def test_store_transfer_skips_adapters_without_a_discriminator_and_resumes(bases, source_adapter, tmp_path,
                                                                         monkeypatch, any_student_passes):
    store = Store(tmp_path / "store", create=True)
    store.add_base("llama", bases[0])
    store.add_base("llama2", write_tiny_causal(tmp_path / "llama2", seed=7, hidden=48))
    for name in ("a", "b"):
        variant_kind("pissa").add(store, name, "llama", source_adapter)
    train_adapter(bases[0], toy_task(), tmp_path / "plain", init="lora", rank=4, steps=2, progress=lambda *_: None)
    variant_kind("lora").add(store, "plain", "llama", tmp_path / "plain")

    calls = []
    real = translora.transfer

    def failing_second(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the operator stops it half way
        return real(*args, **kwargs)

    monkeypatch.setattr(translora, "transfer", failing_second)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        for _, line in translora_store.transfer_store(store, "llama", "llama2", samples=2, max_attempts=48, steps=2):
            lines.append(line)
    assert lines == ["a: moved to 'a.llama2' (" + lines[0].split(" (", 1)[1]]
    store.reload()
    assert "a.llama2" in store.manifest.variants and "b.llama2" not in store.manifest.variants
    lines = [line for _, line in translora_store.transfer_store(store, "llama", "llama2", samples=2, max_attempts=48,
                                                          steps=2)]
    assert lines[0] == "a: done before, as 'a.llama2'" and lines[1].startswith("b: moved to 'b.llama2'")
    assert lines[2] == "plain: skipped: no discriminator beside it (trained without --discriminator)"
    assert len(calls) == 3  # a once, b twice (interrupted, then done): nothing finished was redone
    assert store.variant("b.llama2").kind == "pissa" and store.variant("b.llama2").base == "llama2"


@pytest.mark.parametrize("case", ["no discriminator", "malformed seeds"])
def test_the_cli_refuses_an_adapter_it_cannot_move_in_one_line(bases, source_adapter, tmp_path, capsys, case):
    from serve.cli import main

    adapter = tmp_path / "adapter"
    if case == "no discriminator":
        train_adapter(bases[0], toy_task(), adapter, init="lora", rank=4, steps=1, progress=lambda *_: None)
    else:
        shutil.copytree(source_adapter, adapter)
        (adapter / TRANSLORA_DIR / translora.SEEDS_FILE).write_text("{not json\n")
    code = main(["translora", "--source-base", str(bases[0]), "--adapter", str(adapter),
                 "--target-base", str(bases[1]), "--out", str(tmp_path / "moved")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("manyfold: error: ") and err.count("\n") == 1
    assert str(adapter) in err and not (tmp_path / "moved").exists()


def test_one_adapter_that_cannot_move_does_not_stop_the_others(bases, source_adapter, tmp_path, monkeypatch,
                                                              any_student_passes):
    store = Store(tmp_path / "store", create=True)
    store.add_base("llama", bases[0])
    store.add_base("llama2", write_tiny_causal(tmp_path / "llama2", seed=7, hidden=48))
    for name in ("a", "b"):
        variant_kind("pissa").add(store, name, "llama", source_adapter)
    real = translora.transfer

    def a_fails(*args, **kwargs):
        if args[1] == store.variant_dir("a"):
            raise translora.TransferFailed("no generated input passed the discriminator")
        return real(*args, **kwargs)

    monkeypatch.setattr(translora, "transfer", a_fails)
    out = list(translora_store.transfer_store(store, "llama", "llama2", samples=2, max_attempts=48, steps=2))
    assert [o for o, _ in out] == ["failed", "moved"]
    assert out[0][1] == "a: failed: no generated input passed the discriminator"
    store.reload()
    assert "a.llama2" not in store.manifest.variants and "b.llama2" in store.manifest.variants


def test_store_transfer_names_an_adapter_short_of_the_floor_and_registers_nothing(bases, source_adapter, tmp_path,
                                                                                 monkeypatch, capsys):
    from serve.cli import main

    store = Store(tmp_path / "store", create=True)
    store.add_base("llama", bases[0])
    store.add_base("llama2", write_tiny_causal(tmp_path / "llama2", seed=7, hidden=48))
    variant_kind("pissa").add(store, "a", "llama", source_adapter)
    monkeypatch.setattr(translora.Discriminator, "accepts", lambda self, xs: [False] * len(xs))
    args = ["store", "translora", "--store", str(store.root), "--from", "llama", "--to", "llama2", "--samples", "4"]
    assert main([*args, "--min-accepted", "5"]) == 2  # refused once, before any adapter is tried
    assert capsys.readouterr() == ("", "manyfold: error: min_accepted must be between 1 and samples (4); got 5\n")
    assert main([*args, "--max-attempts", "8"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("a: failed: only 0 of 8 generated inputs accepted (0.0%), short of the 1 a student needs "
                          "(--min-accepted), after --max-attempts 8: ")
    store.reload()
    assert "a.llama2" not in store.manifest.variants


def test_a_name_too_long_once_moved_fails_before_any_work(bases, source_adapter, tmp_path, monkeypatch):
    store = Store(tmp_path / "store", create=True)
    store.add_base("llama", bases[0])
    store.add_base("b" * 60, write_tiny_causal(tmp_path / "llama2", seed=7, hidden=48))
    variant_kind("pissa").add(store, "adapter", "llama", source_adapter)
    monkeypatch.setattr(translora, "transfer", lambda *a, **k: pytest.fail("transferred"))
    [(outcome, line)] = translora_store.transfer_store(store, "llama", "b" * 60)
    assert outcome == "failed" and "is no valid variant name" in line


def test_a_lora_source_moves_at_its_own_rank(bases, tmp_path, any_student_passes):
    src = tmp_path / "lora"
    train_adapter(bases[0], toy_task(), src, init="lora", rank=4, steps=2, progress=lambda *_: None)
    translora.train_discriminator(bases[0], src, toy_task(), "toy", steps=2)
    report = translora.transfer(bases[0], src, bases[1], tmp_path / "moved", samples=2, max_attempts=48, steps=1,
                                use_filter=False)
    assert report.rank == 4  # the old rule halved any source for a PiSSA student


def test_a_tokenizer_without_single_answer_tokens_is_refused_in_one_line():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "cat": 1}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    with pytest.raises(ConfigError, match="needs each to be one token of its own"):
        translora.answer_tokens(tok)


def test_a_verdict_does_not_depend_on_the_other_inputs_of_its_batch(bases, tmp_path):
    """GPT-2 has absolute positions: left padding must not shift a short input's positions."""
    src = tmp_path / "gpt2-adapter"
    train_adapter(bases[1], toy_task(), src, init="lora", rank=4, steps=1, progress=lambda *_: None)
    translora.train_discriminator(bases[1], src, toy_task(), "toy", steps=2)
    disc = translora.Discriminator(bases[1], src / TRANSLORA_DIR / translora.DISC_DIR, "toy")
    short, long = "the cat", "the cat sat on the mat and the dog ran to the big red house"
    alone = disc.margins([short])
    together = disc.margins([short, long])
    assert torch.allclose(alone[0], together[0], atol=1e-5)


def test_candidates_keep_the_seeds_frame():
    seeds = ["Is this message spam? Win a prize now\nAnswer:", "Is this message spam? See you at six\nAnswer:",
             "Is this message spam? Sorry, running late\nAnswer:"]
    assert candidates.input_frame(seeds) == ("Is this message spam? ", "\nAnswer:")
    shared_by_chance = ["Article: Then the bank rose.\nHeadline:", "Article: The team won.\nHeadline:"]
    assert candidates.input_frame(shared_by_chance) == ("Article: ", "\nHeadline:")
    assert candidates.input_frame(["one two", "three four"]) == ("", "")


def test_generated_candidates_come_back_in_the_frame(bases):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bases[0])
    model = AutoModelForCausalLM.from_pretrained(bases[0]).eval()
    seeds = [f"{a} {b} {c} yes" for a, b, c in zip(VOCAB[:4], VOCAB[4:8], VOCAB[8:12])]
    out = candidates.generate_candidates(model, tok, seeds, "toy", 5, seed=0)
    assert len(out) == 5 and all(c == "" or (c.endswith(" yes") and c != " yes") for c in out)


def test_adapter_train_with_a_discriminator_holds_out_the_validation_set_and_says_what_it_kept(bases, tmp_path,
                                                                                           capsys):
    from serve.cli import main

    data = tmp_path / "toy.jsonl"
    data.write_text("".join(e.model_dump_json() + "\n" for e in toy_task()))
    code = main(["adapter", "train", "--base", str(bases[0]), "--data", str(data), "--init", "lora", "--rank", "4",
                 "--steps", "1", "--out", str(tmp_path / "a"), "--discriminator"])
    out = capsys.readouterr().out
    assert code == 0 and "kept beside it: 5 seed examples and 9 validation examples" in out
    assert json.loads((tmp_path / "a" / "train_log.json").read_text())["examples"] == 15  # 24 less the 9 held out
    assert read_validation(tmp_path / "a") == toy_task()[5:14]


def test_an_unguarded_transfer_writes_the_student_the_guard_refuses(bases, source_adapter, tmp_path, monkeypatch):
    """For the ablation bench: guard=False keeps a student the guard would refuse (outcome "unguarded"),
    early_stop=False trains every step, teacher_length sets how long the teacher may write."""
    def refuse(comparison, keep_unchanged):
        raise translora.TransferFailed("no better than the target alone")

    lengths = []
    generate = translora.generate

    def recording(model, tok, prompts, max_new_tokens, temperature, seed, stop=None):
        if temperature is None:  # the teacher decodes greedily
            lengths.append(max_new_tokens)
        return generate(model, tok, prompts, max_new_tokens, temperature, seed, stop)

    monkeypatch.setattr(translora, "choose", refuse)
    monkeypatch.setattr(translora, "generate", recording)
    with pytest.raises(translora.TransferFailed):
        translora.transfer(bases[0], source_adapter, bases[0], tmp_path / "guarded", samples=4, max_attempts=48,
                           steps=3)
    assert not (tmp_path / "guarded").exists()
    report = translora.transfer(bases[0], source_adapter, bases[0], tmp_path / "unguarded", samples=4,
                                max_attempts=48, steps=3, guard=False, early_stop=False, teacher_length=3.0)
    assert report.outcome == "unguarded" and (tmp_path / "unguarded" / "adapter_config.json").is_file()
    assert len(report.losses) == 3 and report.validation["curve"] == []
    assert (lengths[0], lengths[-1]) == (4, 6)  # one-word outputs: max(4, 1.5 x 2 tokens), then 3 x 2 tokens


def test_transfers_given_the_same_inputs_train_on_them_without_writing_more(bases, source_adapter, tmp_path,
                                                                            monkeypatch, any_student_passes):
    """For the ablation bench: inputs written once by synthesize() serve several transfers, and inputs written for
    another plan are refused."""
    plan = translora.AttemptPlan.build(4, 48)
    inputs = translora.synthesize(bases[0], source_adapter, bases[0], plan, seed=0)
    assert inputs.accepted and len(inputs.accepted) <= 4

    def no_more(*args, **kwargs):
        raise AssertionError("a transfer given inputs wrote more")

    monkeypatch.setattr(translora, "synthetic_inputs", no_more)
    for lr in (1e-3, 1e-2):
        report = translora.transfer(bases[0], source_adapter, bases[0], tmp_path / f"lr{lr}", samples=4,
                                    max_attempts=48, steps=2, lr=lr, inputs=inputs)
        assert report.accepted == len(inputs.accepted) and report.attempts == inputs.attempts
    with pytest.raises(ValueError, match="written for"):
        translora.transfer(bases[0], source_adapter, bases[0], tmp_path / "other", samples=8, inputs=inputs)


def test_a_label_tasks_prompts_show_one_labels_seeds_the_labels_in_turn(bases, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shown = []
    real = candidates.generate

    def spying(model, tok, prompts, max_new_tokens, temperature, seed, stop=None):
        shown.extend(prompts)
        return real(model, tok, prompts, max_new_tokens, temperature, seed, stop)

    monkeypatch.setattr(candidates, "generate", spying)
    tok = AutoTokenizer.from_pretrained(bases[0])
    model = AutoModelForCausalLM.from_pretrained(bases[0]).eval()
    seeds = [" ".join(VOCAB[i:i + 3]) for i in range(0, 15, 3)]
    groups = [[0, 2, 4], [1, 3]]
    candidates.generate_candidates(model, tok, seeds, "toy", 8, seed=0, batch=4, groups=groups)
    lines = [{line for line in p.splitlines() if line in seeds} for p in shown]
    of = [next(g for g, members in enumerate(groups) if ls <= {seeds[i] for i in members}) for ls in lines]
    assert all(lines) and of == [0, 1] * 4  # every prompt one label's seeds only, the labels in turn
