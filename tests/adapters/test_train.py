"""serve/adapters/train.py: peft training writes the servable adapter, deterministically, with its log."""

import json

import pytest
import torch

from serve.adapters.data import PromptExample, TextExample, tokenize_examples
from serve.adapters.train import batches, make_peft_model, train_adapter, train_steps
from serve.errors import ArtifactError, ConfigError
from serve.variants.lora import is_raw_pissa, read_peft_adapter
from tests.adapters import write_tiny_lm

EXAMPLES = [TextExample(text="the cat sat on the mat"), PromptExample(prompt="what is the sky", completion="blue"),
            TextExample(text="one two three four five"), PromptExample(prompt="the dog", completion="ran to house")]
PROMPT = torch.tensor([[1, 7, 8, 9, 10, 11, 7, 12]])
QUIET = {"progress": lambda step, loss: None}
ARGS = {"rank": 4, "alpha": 8, "batch_size": 2, "max_length": 16, "lr": 1e-2, **QUIET}

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")  # peft -> transformers


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_lm(tmp_path_factory.mktemp("tiny") / "base")


def test_pissa_adapter_on_original_base_reproduces_the_trained_model(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = train_adapter(base, EXAMPLES, tmp_path / "out", init="pissa", steps=5, **ARGS).out_dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging dir, no initial adapter left
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                     "train_log.json"]
    config, _ = read_peft_adapter(out)
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (8, 16, True)
    model, tok = make_peft_model(base, "pissa", 4, 8, seed=0)  # the same run by hand, kept on W_res
    train_steps(model, batches(tokenize_examples(tok, EXAMPLES, 16), 2, 0, tok.pad_token_id), 5, 1e-2, **QUIET)
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out)
    with torch.no_grad():
        torch.testing.assert_close(served.eval()(PROMPT).logits, model(PROMPT).logits, atol=1e-5, rtol=0)


def test_pissa_niter_init_writes_a_converted_adapter(base, tmp_path):
    out = train_adapter(base, EXAMPLES, tmp_path / "out", init="pissa_niter_4", steps=2, **ARGS).out_dir
    config, tensors = read_peft_adapter(out)
    assert (config["r"], config["lora_alpha"], is_raw_pissa(config)) == (8, 16, False)
    assert {tuple(t.shape) for k, t in tensors.items() if "q_proj.lora_A" in k} == {(8, 32)}
    assert json.loads((out / "train_log.json").read_text())["init"] == "pissa_niter_4"


def test_lora_init_writes_a_plain_adapter(base, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(e.model_dump()) + "\n" for e in EXAMPLES))
    out = train_adapter(base, data, tmp_path / "out", init="lora", steps=2, **ARGS).out_dir
    config, tensors = read_peft_adapter(out)
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (4, 8, True)
    assert {tuple(t.shape) for k, t in tensors.items() if "q_proj.lora_A" in k} == {(4, 32)}


def test_train_log_has_every_step_and_loss_falls(base, tmp_path):
    result = train_adapter(base, EXAMPLES * 4, tmp_path / "out", init="pissa", steps=30, **ARGS)
    log = json.loads((result.out_dir / "train_log.json").read_text())
    losses = [e["loss"] for e in log["log"]]
    assert [e["step"] for e in log["log"]] == list(range(1, 31)) and losses == result.losses
    assert (log["init"], log["rank"], log["steps"], log["seconds"] > 0) == ("pissa", 4, 30, True)
    per_layer = 4 * ((32 + 32) * 2 + (32 + 16) * 2 + (32 + 64) * 3)  # r (in + out): q,o / k,v / gate,up,down
    assert log["trainable_params"] == result.trainable_params == 2 * per_layer
    assert log["log"][0]["lr"] == 0 and max(e["lr"] for e in log["log"]) == pytest.approx(1e-2)
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]


def test_same_seed_writes_identical_files(base, tmp_path):
    a = train_adapter(base, EXAMPLES, tmp_path / "a", init="lora", steps=3, seed=7, **ARGS).out_dir
    b = train_adapter(base, EXAMPLES, tmp_path / "b", init="lora", steps=3, seed=7, **ARGS).out_dir
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_bad_arguments_are_refused_before_training(base, tmp_path):
    with pytest.raises(ConfigError, match=r"init must be 'lora', 'pissa' or 'pissa_niter_K', got 'svd'$"):
        train_adapter(base, EXAMPLES, tmp_path / "out", init="svd", steps=1, **QUIET)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ArtifactError, match=r"full: already exists and is not empty$"):
        train_adapter(base, EXAMPLES, tmp_path / "full", steps=1, **QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]
