import pytest
import torch

from serve.data.models import smollm2_dir

pytestmark = pytest.mark.slow


def test_smollm2_converts_once_to_a_plain_safetensors_chat_model():
    """In the suite's own home, as every test that serves SmolLM2 finds it (a fresh machine converts it once, in
    whichever test asks first; converting it again into a home of this test's own would double that)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = smollm2_dir()
    written = (d / "model.safetensors").stat().st_mtime_ns
    assert smollm2_dir() == d and (d / "model.safetensors").stat().st_mtime_ns == written  # not converted again
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(d)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text
