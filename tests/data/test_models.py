import pytest
import torch

from serve.data.models import smollm2_dir

pytestmark = pytest.mark.slow


def test_smollm2_converts_once_to_a_plain_safetensors_chat_model(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("MANYFOLD_HOME", str(tmp_path))
    d = smollm2_dir()
    assert (d / "model.safetensors").is_file() and smollm2_dir() == d
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(d)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text
