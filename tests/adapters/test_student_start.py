"""Where a student starts on a target of another depth or MLP width (serve/adapters/student_start.py): the source
adapter projected onto the target's layers, found by their weights, or onto its wider MLPs, computes on the new
base exactly what it computed on its own; a transfer starts from it where it beats the target alone."""

import json

import pytest
import torch

from serve.adapters import translora
from serve.adapters.load import load_lm
from serve.adapters.student_start import layer_map, project_adapter, project_width
from serve.adapters.train import train_adapter
from serve.adapters.transfer_guard import unfit_reason
from serve.bench.translora_targets import grow, widen
from tests.adapters import toy_task
from tests.models import write_tiny_causal


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """(a 3-layer source, its adapter, the source grown to 5 layers: one inserted after layers 0 and 2)."""
    tmp = tmp_path_factory.mktemp("grown")
    source = write_tiny_causal(tmp / "source", layers=3)
    adapter = tmp / "adapter"
    train_adapter(source, toy_task(), adapter, init="lora", rank=4, steps=30, lr=1e-2, progress=lambda *_: None)
    translora.train_discriminator(source, adapter, toy_task(), "toy", steps=2)
    grow(source, tmp / "target", insert_after=(0, 2))
    return source, adapter, tmp / "target"


def test_the_layers_are_matched_by_their_weights_and_the_projection_computes_what_the_adapter_did(grown, tmp_path):
    source, adapter, target = grown
    assert unfit_reason(source, adapter, target) == ("the source base has 3 layers and the target 5: its layers do "
                                                     "not line up")
    mapping = layer_map(source, target)
    assert mapping == {0: 0, 1: 2, 2: 3}  # the copies (1 and 4) have zero output projections: less alike
    projected = project_adapter(adapter, mapping, tmp_path / "projected")
    ids = torch.tensor([[1, 5, 9, 4, 7, 3]])
    with torch.no_grad():
        want = load_lm(source, adapter)[0](input_ids=ids).logits
        by_name = load_lm(target, adapter)[0](input_ids=ids).logits
        got = load_lm(target, projected)[0](input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(by_name, want, atol=1e-3)  # loaded by name, layers 1 and 2 land on others


def test_a_transfer_to_a_deeper_base_starts_from_the_projection_where_it_beats_the_target_alone(
        grown, tmp_path, monkeypatch):
    source, adapter, target = grown
    monkeypatch.setattr(translora, "choose", lambda comparison, keep_unchanged: "student")  # the guard: elsewhere
    report = translora.transfer(source, adapter, target, tmp_path / "moved", samples=4, max_attempts=48, steps=1,
                                lr=1e-9, use_filter=False)
    assert report.started_from == "the source adapter projected onto the target (2 layers moved)"
    assert report.distilled.startswith("distribution")  # the same tokenizer: another depth does not matter there


def test_an_adapter_projected_onto_wider_mlps_computes_what_it_did(tmp_path):
    """Every linear adapted, the MLPs among them: on a base whose MLPs are wider (new neurons adding nothing), the
    adapter padded with zero rows and columns computes what it computed on its own base; by name it does not load."""
    source = write_tiny_causal(tmp_path / "source", layers=2)
    adapter = tmp_path / "adapter"
    train_adapter(source, toy_task(), adapter, init="lora", rank=4, steps=20, lr=1e-2, progress=lambda *_: None)
    width = json.loads((source / "config.json").read_text())["intermediate_size"]
    widen(source, tmp_path / "target", width + 16)
    assert "mlp" in unfit_reason(source, adapter, tmp_path / "target")
    projected, widened = project_width(adapter, source, tmp_path / "target", tmp_path / "projected")
    assert widened == 2 * 3  # gate, up and down of each of the two layers
    assert unfit_reason(source, projected, tmp_path / "target") is None
    ids = torch.tensor([[1, 5, 9, 4, 7, 3]])
    with torch.no_grad():
        want = load_lm(source, adapter)[0](input_ids=ids).logits
        got = load_lm(tmp_path / "target", projected)[0](input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert project_width(adapter, source, source, tmp_path / "same") is None  # as wide: nothing to pad
    other = write_tiny_causal(tmp_path / "other", layers=2, hidden=48)  # every width differs: no projection
    assert project_width(adapter, source, other, tmp_path / "other-projected") is None



def test_a_transfer_to_a_wider_base_starts_from_the_widened_adapter_where_it_beats_the_target_alone(tmp_path,
                                                                                                   monkeypatch):
    source = write_tiny_causal(tmp_path / "source", layers=2)
    adapter = tmp_path / "adapter"
    train_adapter(source, toy_task(), adapter, init="lora", rank=4, steps=30, lr=1e-2, progress=lambda *_: None)
    translora.train_discriminator(source, adapter, toy_task(), "toy", steps=2)
    width = json.loads((source / "config.json").read_text())["intermediate_size"]
    widen(source, tmp_path / "target", width + 16)
    monkeypatch.setattr(translora, "choose", lambda comparison, keep_unchanged: "student")  # the guard: elsewhere
    report = translora.transfer(source, adapter, tmp_path / "target", tmp_path / "moved", samples=4,
                                max_attempts=48, steps=1, lr=1e-9, use_filter=False)
    assert report.started_from == "the source adapter projected onto the target (6 modules widened)"
