"""The bench's new-version target: built once by its recipe, rebuilt when the recipe changes, its perplexity
shift printed; training and perplexities stubbed."""

import dataclasses
import json
from pathlib import Path

import pytest

import serve.bench.translora_targets as targets
import serve.data.models
from serve.errors import ConfigError


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
    with pytest.raises(ConfigError, match="^unknown target 'v3'; known: neuzip-k0, new-version$"):
        targets.target_base("v3", tmp_path)
    with pytest.raises(ConfigError, match="^unknown corpus 'poems'; known: fortunes, news, tweets$"):
        targets.heldout_texts("poems")
