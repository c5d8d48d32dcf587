"""Loading a causal LM (with a PEFT adapter if given) for Trans-LoRA: generating, teaching and validating."""

from pathlib import Path

import torch


def load_lm(base_dir: str | Path, adapter_dir: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """A causal LM in fp32 (or `dtype`; with a PEFT adapter if given) and its tokenizer, padding on the left for
    batches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval(), tok
