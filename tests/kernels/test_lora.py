"""kernels.lora: shrink then expand in one call; the twin gives the bits of the two twins in turn."""

import pytest
import torch

from kernels import make_segments
from kernels.lora import lora_torch, lora_triton
from kernels.lora_expand import lora_expand_torch
from kernels.lora_shrink import lora_shrink_torch

SLOTS = [[2, -1, 0, 2, -1, 1, 0], [1, 1, 1], [-1, 0, -1]]  # mixed with repeats; one adapter for all; one token


def make_inputs(slots, dtype, device, gen, in_f=45, out=37, rank=5, n=3):
    x = torch.randn(len(slots), in_f, generator=gen).to(dtype)
    a = torch.randn(n, rank, in_f, generator=gen).to(dtype)
    bt = torch.randn(n, rank, out, generator=gen).to(dtype)  # the adapter pool's layout: B transposed
    scale = torch.rand(n, generator=gen) + 0.5
    y = torch.randn(len(slots), out, generator=gen).to(dtype)
    x, a, bt, scale, y = (t.to(device) for t in (x, a, bt, scale, y))
    return x, a, bt.transpose(1, 2), scale, make_segments(torch.tensor(slots), device), y


@pytest.mark.parametrize("slots", SLOTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_twin_gives_the_bits_of_shrink_then_expand(slots, dtype, gen):
    x, a, b, scale, seg, y = make_inputs(slots, dtype, "cpu", gen)
    want = lora_expand_torch(lora_shrink_torch(x, a, scale, seg), b, seg, y.clone())
    assert torch.equal(lora_torch(x, a, b, scale, seg, y.clone()), want)


@pytest.mark.parametrize("slots", SLOTS)
def test_the_triton_form_equals_the_twin(slots, triton_device, gen, tolerances):
    x, a, b, scale, seg, y = make_inputs(slots, torch.float32, triton_device, gen)
    torch.testing.assert_close(lora_triton(x, a, b, scale, seg, y.clone()), lora_torch(x, a, b, scale, seg, y.clone()),
                               **tolerances[torch.float32])
