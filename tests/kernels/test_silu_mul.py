"""silu_mul: the twin is LlamaMLP's activation and product bit for bit; the Triton form matches the twin."""

import pytest
import torch
from transformers.activations import ACT2FN

from kernels.silu_mul import silu_mul_torch, silu_mul_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_twin_is_llamas_activation_times_up(dtype, gen):
    g, u = (torch.randn(3, 7, 40, generator=gen).to(dtype) for _ in range(2))
    assert torch.equal(silu_mul_torch(g, u), ACT2FN["silu"](g) * u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_triton_form_equals_the_twin(dtype, triton_device, gen, tolerances):
    g, u = (torch.randn(5, 1100, generator=gen).mul(4).to(dtype).to(triton_device) for _ in range(2))  # two blocks
    # bf16 rounds twice (the activation, then the product); the interpreter truncates each time: a few ulps
    tol = {"rtol": 2e-2, "atol": 1e-2} if dtype == torch.bfloat16 else tolerances[dtype]
    torch.testing.assert_close(silu_mul_triton(g, u), silu_mul_torch(g, u), **tol)


def test_mismatched_inputs_fail_with_one_clear_line(gen):
    g = torch.randn(2, 8, generator=gen)
    with pytest.raises(ValueError, match="u: expected"):
        silu_mul_torch(g, g[:, :4])
