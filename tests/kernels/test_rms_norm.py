"""rms_norm: the twin is transformers' LlamaRMSNorm bit for bit; the Triton form matches the twin."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels.rms_norm import rms_norm_torch, rms_norm_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_twin_is_llamas_rms_norm(dtype, gen):
    norm = LlamaRMSNorm(45, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(45, generator=gen))
    x = torch.randn(3, 7, 45, generator=gen).to(dtype)
    assert torch.equal(rms_norm_torch(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_form_equals_the_twin(dtype, triton_device, gen, tolerances):
    x = torch.randn(5, 45, generator=gen).to(dtype).to(triton_device)
    w = torch.randn(45, generator=gen).to(dtype).to(triton_device)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), **tolerances[dtype])
