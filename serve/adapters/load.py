"""Loading a causal LM (with a PEFT adapter if given) for Trans-LoRA: generating, teaching and validating."""

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def compute_device() -> torch.device:
    """Where every model of an adapter's training and a transfer runs (the teacher's writing, the discriminator,
    the student, the guard's comparison): the GPU where there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def model_dtype() -> torch.dtype:
    """The base's weights: bf16 on a GPU (PEFT keeps a trained adapter's own weights in fp32 beside them), fp32 on
    a CPU (a PiSSA residual kept exact, and no CPU path changed)."""
    return torch.bfloat16 if compute_device().type == "cuda" else torch.float32


def writing_dtype() -> torch.dtype:
    """bf16 on a GPU, and where this CPU multiplies it natively (AVX512-BF16 or AMX), else fp32. SmolLM2 writing
    candidates on 2 cores: on the Intel Xeon VM, bf16 took about two thirds of fp32's time (spam); on the AMD EPYC
    VM (AVX2 only: bf16 is emulated), 6.28 s a headline candidate in batches of 16 against 2.06 s in fp32."""
    if compute_device().type == "cuda":
        return torch.bfloat16
    native = [getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return torch.bfloat16 if any(native) else torch.float32


def load_lm(base_dir: str | Path, adapter_dir: str | Path | None = None, dtype: torch.dtype | None = None):
    """A causal LM on compute_device() in model_dtype() (or `dtype`; with a PEFT adapter if given) and its tokenizer,
    padding on the left for batches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype or model_dtype()).to(compute_device())
    if adapter_dir is not None:
        model = with_adapter(model, adapter_dir)
    return model.eval(), tok


def on_device(batch: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """A tokenised batch (built on the CPU) where the model is."""
    return {k: v.to(model.device) for k, v in batch.items()}


@contextmanager
def peft_quietly() -> Iterator[None]:
    """PEFT reads transformers' deprecated `is_gradient_checkpointing` each time it wraps a model: a FutureWarning
    per load that no user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        yield


def with_adapter(model, adapter_dir: str | Path, trainable: bool = False):
    """`model` with the PEFT adapter at adapter_dir."""
    from peft import PeftModel

    with peft_quietly():
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=trainable)
