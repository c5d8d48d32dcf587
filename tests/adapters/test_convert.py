"""serve/adapters/convert.py: a converted PiSSA adapter on the original base equals the trained PiSSA model."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from serve.adapters.convert import convert_pissa, converted_config
from serve.adapters.data import PromptExample, TextExample, tokenize_examples
from serve.adapters.train import batches, make_peft_model, train_steps
from serve.errors import ArtifactError, VariantIncompatible
from serve.variants.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_servable,
    is_raw_pissa,
    read_peft_adapter,
)
from tests.adapters import write_tiny_lm

RANK, ALPHA = 4, 8  # s = 2: a scale other than 1 is carried through the conversion
EXAMPLES = [TextExample(text="the cat sat on the mat"), PromptExample(prompt="what is the sky", completion="blue"),
            TextExample(text="one two three four five")]
PROMPT = torch.tensor([[1, 7, 8, 9, 10, 11, 7, 12]])

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")  # peft -> transformers


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(original base dir, work dir, trained PiSSA model): initial/ and trained/ hold the raw adapters; the
    model's base layers hold W_res, its adapter (A1, B1)."""
    root = tmp_path_factory.mktemp("pissa")
    base = write_tiny_lm(root / "base")
    model, tok = make_peft_model(base, "pissa", RANK, ALPHA, seed=0)
    model.save_pretrained(root / "initial")
    data = batches(tokenize_examples(tok, EXAMPLES, 16), 2, 0, tok.pad_token_id)
    train_steps(model, data, steps=5, lr=1e-2, progress=lambda step, loss: None)
    model.save_pretrained(root / "trained")
    return base, root, model


def lora_modules(model):
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def base_weights(base) -> dict[str, torch.Tensor]:
    return load_file(base / "model.safetensors")


def key(module_name: str, which: str) -> str:
    return f"{module_name}.{which}.weight"


def test_converted_adapter_on_base_equals_residual_plus_trained(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, root, trained = run
    out = convert_pissa(root / "trained", root / "initial", tmp_path / "lora")
    config, tensors = read_peft_adapter(out)
    s_new, s_old = config["lora_alpha"] / config["r"], ALPHA / RANK
    assert (config["r"], s_new, config["init_lora_weights"]) == (2 * RANK, s_old, True)
    w = base_weights(base)
    modules = lora_modules(trained)
    assert len(modules) == 14
    for name, m in modules.items():
        a1, b1 = m.lora_A["default"].weight, m.lora_B["default"].weight
        w_res = m.base_layer.weight  # [out, in]
        w_name = name.removeprefix("base_model.model.") + ".weight"
        merged = w[w_name] + s_new * tensors[key(name, "lora_B")] @ tensors[key(name, "lora_A")]
        torch.testing.assert_close(merged, (w_res + s_old * b1 @ a1).detach(), atol=1e-5, rtol=0)
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        before = original(PROMPT).logits
        served = PeftModel.from_pretrained(original, out).eval()
        after = served(PROMPT).logits
        torch.testing.assert_close(after, trained(PROMPT).logits, atol=1e-5, rtol=0)
    assert (after - before).abs().max() > 0.1  # training moved the model: the check has teeth


def test_untrained_pissa_converts_to_zero_delta(tmp_path):
    base = write_tiny_lm(tmp_path / "base")
    model, _ = make_peft_model(base, "pissa", RANK, ALPHA, seed=0)
    model.save_pretrained(tmp_path / "initial")
    model.save_pretrained(tmp_path / "trained")
    config, tensors = read_peft_adapter(convert_pissa(tmp_path / "trained", tmp_path / "initial", tmp_path / "lora"))
    s = config["lora_alpha"] / config["r"]
    names = sorted(k.removesuffix(".lora_A.weight") for k in tensors if ".lora_A." in k)
    assert len(names) == 14
    for name in names:
        delta = s * tensors[f"{name}.lora_B.weight"] @ tensors[f"{name}.lora_A.weight"]
        assert delta.abs().max() <= 1e-6, name


@pytest.mark.filterwarnings("ignore:PiSSA changes the base weights")
def test_conversion_equals_peft_save_pretrained(run, tmp_path):
    _, root, trained = run
    ours = convert_pissa(root / "trained", root / "initial", tmp_path / "ours")
    trained.save_pretrained(tmp_path / "peft", path_initial_model_for_weight_conversion=str(root / "initial"))
    our_config, our_tensors = read_peft_adapter(ours)
    peft_config, peft_tensors = read_peft_adapter(tmp_path / "peft")
    assert our_tensors.keys() == peft_tensors.keys()
    for k, t in peft_tensors.items():
        assert torch.equal(our_tensors[k], t), k
    our_config["target_modules"].sort()
    peft_config["target_modules"].sort()
    assert our_config == peft_config


def test_converted_config_keeps_every_scale():
    plain = converted_config({"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"q_proj": 2},
                              "init_lora_weights": "pissa_niter_4"})
    assert (plain["r"], plain["lora_alpha"], plain["rank_pattern"], plain["alpha_pattern"]) == (
        16, 32, {"q_proj": 8}, {"q_proj": 4})
    assert plain["init_lora_weights"] is True and not is_raw_pissa(plain)
    rs = converted_config({"r": 8, "lora_alpha": 16, "use_rslora": True, "alpha_pattern": {"q_proj": 2},
                           "rank_pattern": {"q_proj": 4}, "init_lora_weights": "pissa"})
    assert math.isclose(rs["lora_alpha"] / math.sqrt(rs["r"]), 16 / math.sqrt(8))
    assert math.isclose(rs["alpha_pattern"]["q_proj"] / math.sqrt(rs["rank_pattern"]["q_proj"]), 2 / math.sqrt(4))


@pytest.mark.parametrize("init, raw", [("pissa", True), ("pissa_niter_4", True), ("PiSSA", True), (True, False),
                                       ("gaussian", False), ("olora", False), (None, False)])
def test_raw_pissa_detection(init, raw):
    assert is_raw_pissa({"init_lora_weights": init}) is raw


def test_raw_pissa_is_not_servable(run):
    _, root, _ = run
    config, _ = read_peft_adapter(root / "trained")
    with pytest.raises(VariantIncompatible, match=r"trained is a raw PiSSA adapter, relative to its residual base.*"
                       r"manyfold adapter convert --adapter .*trained --initial INITIAL_ADAPTER_DIR --out OUT$"):
        check_servable(root / "trained", config)


def copy_adapter(src, dst, config_edit=None, tensors_edit=None):
    config, tensors = read_peft_adapter(src)
    dst.mkdir()
    (dst / ADAPTER_CONFIG).write_text(json.dumps(config_edit(config) if config_edit else config))
    save_file(tensors_edit(tensors) if tensors_edit else tensors, dst / ADAPTER_WEIGHTS)
    return dst


def test_pickle_adapter_is_refused(run, tmp_path):
    _, root, _ = run
    bad = copy_adapter(root / "trained", tmp_path / "bad")
    (bad / "adapter_model.bin").write_bytes(b"\x80\x04not opened")
    with pytest.raises(ArtifactError, match=r"bad: adapter weights are a pickle file, which can run code when "
                       r"loaded; Manyfold reads adapter_model\.safetensors only \(save with safe_serialization=True\)$"):
        convert_pissa(bad, root / "initial", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mismatched_initial_is_refused(run, tmp_path):
    _, root, _ = run
    other_rank = copy_adapter(root / "initial", tmp_path / "r2", lambda c: {**c, "r": 2})
    with pytest.raises(VariantIncompatible, match=r"r2/adapter_config\.json: r is 2; the trained adapter has 4$"):
        convert_pissa(root / "trained", other_rank, tmp_path / "out")
    name = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    cut = copy_adapter(root / "initial", tmp_path / "cut", tensors_edit=lambda t: {**t, name: t[name][:2]})
    with pytest.raises(VariantIncompatible, match=rf"cut/adapter_model\.safetensors: tensor {name} is "
                       r"torch\.float32 \(2, 32\); the trained adapter has torch\.float32 \(4, 32\)$"):
        convert_pissa(root / "trained", cut, tmp_path / "out")


def test_only_raw_pissa_converts(run, tmp_path):
    _, root, _ = run
    lora = convert_pissa(root / "trained", root / "initial", tmp_path / "lora")
    with pytest.raises(VariantIncompatible, match=r"lora/adapter_config\.json: init_lora_weights is True, "
                       r"not a raw PiSSA adapter$"):
        convert_pissa(lora, root / "initial", tmp_path / "again")
    with pytest.raises(ArtifactError, match=r"lora: already exists and is not empty$"):
        convert_pissa(root / "trained", root / "initial", lora)
    with pytest.raises(ArtifactError, match=r"missing: no such adapter directory$"):
        convert_pissa(tmp_path / "missing", root / "initial", tmp_path / "out")
