"""EMR-Merging's maths (METHODS.md section 3) and its bundle: invariants, exact cases, guarded edges, strict reads."""

import json

import pytest
import torch

from serve.codecs import emr
from serve.errors import ArtifactError, VariantIncompatible
from serve.store.tensors import SafetensorsSource
from tests.models import write_perturbed, write_tiny_causal


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny Llama and three fine-tunes of it: two of every weight, one of the top layer only."""
    root = tmp_path_factory.mktemp("emr")
    base = write_tiny_causal(root / "base")
    tasks = {"all1": write_perturbed(base, root / "all1", seed=1, scale=0.5),
             "all2": write_perturbed(base, root / "all2", seed=2, scale=0.5),
             "top": write_perturbed(base, root / "top", seed=3, scale=0.5, only="layers.1.")}
    return root, base, tasks


def test_unified_vector_agrees_with_every_task_under_its_mask(rng):
    taus = torch.randn(4, 50, 30, generator=rng, dtype=torch.float64)
    taus[:, :5] = 0.0  # no task changed these
    taus[1:, 5:8] = 0.0  # only task 0 did
    tau_uni = emr.elect(taus)
    masks = emr.masks_of(taus, tau_uni)
    for t in range(4):
        on = masks[t]
        assert torch.equal(torch.sign(tau_uni[on]), torch.sign(taus[t][on]))
        assert (tau_uni[on].abs() >= taus[t][on].abs()).all()
    assert torch.equal(tau_uni == 0, (taus == 0).all(0))  # zero exactly where every task is zero
    assert torch.equal(tau_uni[5:8], taus[0, 5:8])
    assert not masks[:, :5].any()  # a zero entry is in no mask


def test_sign_tie_goes_to_minus_one_and_an_empty_mask_gets_rescaler_one():
    taus = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)  # entry 0: a tie; entry 1: untouched
    tau_uni = emr.elect(taus)
    assert tau_uni.tolist() == [-1.0, 0.0]
    masks = emr.masks_of(taus, tau_uni)
    assert masks.tolist() == [[False, False], [True, False]]
    assert emr.rescalers([2.0, 0.0], [0.0, 0.0]) == [1.0, 1.0]  # lost every vote; a zero task vector: finite
    base = torch.tensor([0.5, 0.25])
    assert torch.equal(emr.reconstruct(base, tau_uni.float(), masks[0], 1.0), base)  # task 0 is the base again


def _model_tensors(path):
    src = SafetensorsSource(path)
    return {k: src[k] for k in src}


def test_one_task_and_identical_tasks_reconstruct_exactly(lm, tmp_path):
    root, base, tasks = lm
    for group in ({"only": tasks["all1"]}, {"a": tasks["all1"], "b": tasks["all1"]}):
        bundle = emr.merge(base, group, tmp_path / "b")
        assert all(t.rescaler == 1.0 for t in bundle.manifest.tasks)
        want = _model_tensors(tasks["all1"])
        for name in group:
            got = emr.task_tensors(bundle, name, SafetensorsSource(base))
            assert set(got) == set(want)
            for k in want:  # W_pre + (W_t - W_pre): exact up to the one fp32 rounding of the sum
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-7 * float(want[k].abs().max()) + 1e-12)


@pytest.mark.parametrize("rescaler", ["mean", "global"])
def test_merge_writes_one_bit_per_merged_weight_and_extract_gives_a_loadable_model(lm, tmp_path, rescaler):
    from transformers import AutoModelForCausalLM

    root, base, tasks = lm
    bundle = emr.merge(base, tasks, tmp_path / "bundle", rescaler=rescaler)
    m = bundle.manifest
    assert [t.name for t in m.tasks] == list(tasks) and m.rescaler == rescaler
    assert all(0.5 < t.rescaler < 3.0 for t in m.tasks), [t.rescaler for t in m.tasks]
    masks = SafetensorsSource(bundle.path / emr.MASKS_FILE)
    packed_bytes = sum(masks[k].numel() for k in masks)
    assert m.merged_params * len(tasks) / 8 <= packed_bytes <= 1.1 * m.merged_params * len(tasks) / 8
    top = next(t for t in m.tasks if t.name == "top")
    assert top.mask_bits < min(t.mask_bits for t in m.tasks if t.name != "top")  # it changed one layer

    out = emr.extract(bundle.path, "top", tmp_path / "top")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    state = model.state_dict()
    tau, k = SafetensorsSource(bundle.path / emr.TAU_FILE), 2
    b = "model.layers.1.mlp.down_proj.weight"
    mask = emr.unpack_bits(masks[b][k], tau[b].shape[-1])
    want = SafetensorsSource(base)[b] + top.rescaler * torch.where(mask, tau[b], 0.0)
    torch.testing.assert_close(state[b], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight"],  # "top" left layer 0 alone: its mask is empty
                       SafetensorsSource(base)["model.layers.0.mlp.down_proj.weight"])


def test_a_bad_or_damaged_bundle_is_refused_and_a_failed_merge_leaves_the_old_one(lm, tmp_path):
    root, base, tasks = lm
    good = emr.merge(base, {"all1": tasks["all1"]}, tmp_path / "bundle")
    before = (good.path / emr.BUNDLE_JSON).read_bytes()
    other = write_tiny_causal(tmp_path / "other", seed=9)
    with pytest.raises(VariantIncompatible, match="matches nothing|lacks|is \\["):
        emr.merge(base, {"all1": tasks["all1"], "x": write_tiny_causal(tmp_path / "wide", hidden=64)},
                  tmp_path / "bundle")
    assert (good.path / emr.BUNDLE_JSON).read_bytes() == before and emr.read_bundle(good.path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bundle.")]  # no staging left behind
    with pytest.raises(VariantIncompatible, match="another base"):
        emr.extract(good.path, "all1", tmp_path / "x", base_dir=other)
    with pytest.raises(VariantIncompatible, match="no task 'nope'"):
        emr.extract(good.path, "nope", tmp_path / "x")

    masks = good.path / emr.MASKS_FILE
    data = masks.read_bytes()
    masks.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        emr.read_bundle(good.path)
    masks.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="truncated"):
        emr.read_bundle(good.path)
    (good.path / emr.BUNDLE_JSON).write_text(json.dumps({"format": "manyfold.emr"}))
    with pytest.raises(ArtifactError, match="malformed bundle manifest"):
        emr.read_bundle(good.path)


def test_merge_task_arguments_are_checked():
    assert emr.read_merge_args(["a=/x", "b.c=/y"]) == {"a": emr.Path("/x"), "b.c": emr.Path("/y")}
    for bad in (["a"], ["a/b=/x"], ["=/x"], ["a=/x", "a=/y"]):
        with pytest.raises(VariantIncompatible, match="--task"):
            emr.read_merge_args(bad)
