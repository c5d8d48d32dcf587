"""The bench's trained targets: built once by their recipe, rebuilt when the recipe changes, their perplexity
shift printed (training and perplexities stubbed); the deeper target's growth computes what its source does."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import serve.bench.translora_targets as targets
import serve.data.models
from serve.errors import ConfigError
from tests.models import write_tiny_causal


@pytest.fixture
def builds(monkeypatch, tmp_path):
    done = []

    def finetune(source, texts, out, task, log):
        done.append(task)
        (Path(out) / "config.json").write_text("{}")
        return 3.5

    monkeypatch.setattr(targets, "finetune_lm_top_layers", finetune)
    monkeypatch.setattr(targets, "perplexities", lambda d: {"news": 40.0 if Path(d) == tmp_path / "source" else 44.0})
    monkeypatch.setattr(serve.data.models, "smollm2_dir", lambda: tmp_path / "source")
    monkeypatch.setattr("serve.data.datasets.fortunes", lambda split: ["a quote"])
    return done


def test_the_new_version_is_built_once_per_recipe(builds, tmp_path, monkeypatch, capsys):
    base = targets.new_version_base(tmp_path / "work", log=lambda m: None)
    assert targets.new_version_base(tmp_path / "work", log=lambda m: None) == base and len(builds) == 1
    info = json.loads((base / targets.TARGET_FILE).read_text())
    assert info["perplexity"] == {"before": {"news": 40.0}, "after": {"news": 44.0}}
    targets.print_perplexities(info)
    assert "news                       40.00         44.00   +10.0%" in capsys.readouterr().out
    monkeypatch.setattr(targets, "NEW_VERSION", dataclasses.replace(targets.NEW_VERSION, lr=1e-5))
    targets.new_version_base(tmp_path / "work", log=lambda m: None)
    assert len(builds) == 2 and builds[1].lr == 1e-5


def test_unknown_names_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="^unknown target 'v3'; known: neuzip-k0, new-version, deeper, deeper-5, "
                                          "wider$"):
        targets.target_base("v3", tmp_path)
    with pytest.raises(ConfigError, match="^unknown corpus 'poems'; known: fortunes, news, tweets$"):
        targets.heldout_texts("poems")


def test_a_grown_base_computes_what_its_source_does_and_its_later_layers_move_by_name(tmp_path):
    source = write_tiny_causal(tmp_path / "source", layers=3)
    targets.grow(source, tmp_path / "grown", insert_after=(0, 1))
    old = AutoModelForCausalLM.from_pretrained(source).eval()
    new = AutoModelForCausalLM.from_pretrained(tmp_path / "grown").eval()
    assert new.config.num_hidden_layers == 5
    ids = torch.tensor([[1, 5, 9, 4, 7, 3]])
    with torch.no_grad():
        assert torch.equal(new(input_ids=ids).logits, old(input_ids=ids).logits)
    moved = old.state_dict()["model.layers.2.mlp.up_proj.weight"]
    assert torch.equal(new.state_dict()["model.layers.4.mlp.up_proj.weight"], moved)  # layer 2 is now layer 4
    assert not torch.equal(new.state_dict()["model.layers.2.mlp.up_proj.weight"], moved)


def test_the_deeper_target_grows_once_and_trains_the_grown_model(builds, tmp_path, monkeypatch):
    grown_by = []

    def grow(base, out, after):
        grown_by.append(after)
        (Path(out) / "config.json").write_text("{}")

    monkeypatch.setattr(targets, "grow", grow)
    base = targets.deeper_base(tmp_path / "work", log=lambda m: None)
    assert targets.deeper_base(tmp_path / "work", log=lambda m: None) == base
    assert grown_by == [targets.INSERT_AFTER] and builds == [targets.DEEPER]


def test_a_widened_base_computes_what_its_source_does(tmp_path):
    source = write_tiny_causal(tmp_path / "source", layers=2)
    old = AutoModelForCausalLM.from_pretrained(source).eval()
    width = old.config.intermediate_size
    targets.widen(source, tmp_path / "wider", width + 24)
    new = AutoModelForCausalLM.from_pretrained(tmp_path / "wider").eval()
    assert new.config.intermediate_size == width + 24
    assert new.state_dict()["model.layers.1.mlp.down_proj.weight"].shape[1] == width + 24
    ids = torch.tensor([[1, 5, 9, 4, 7, 3]])
    with torch.no_grad():
        assert torch.allclose(new(input_ids=ids).logits, old(input_ids=ids).logits, atol=1e-6)
    with pytest.raises(ConfigError, match="wide already"):
        targets.widen(source, tmp_path / "narrower", width)


def test_the_new_targets_grow_and_widen_once_each_and_train_what_they_built(builds, tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(targets, "grow", lambda base, out, after: (made.append(after),
                                                                    (Path(out) / "config.json").write_text("{}")))
    monkeypatch.setattr(targets, "widen", lambda base, out, width: (made.append(width),
                                                                     (Path(out) / "config.json").write_text("{}")))
    for _ in range(2):
        targets.target_base("deeper-5", tmp_path / "work", log=lambda m: None)
        targets.target_base("wider", tmp_path / "work", log=lambda m: None)
    assert made == [targets.INSERT_AFTER_5, targets.WIDER_MLP] and builds == [targets.DEEPER_5, targets.WIDER]

