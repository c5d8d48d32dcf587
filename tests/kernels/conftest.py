"""Kernel tests: Triton forms run on CPU tensors through Triton's interpreter, on CUDA tensors compiled."""

import os

import torch

# triton.jit picks the interpreter when it decorates a kernel, i.e. when kernels/ is first imported:
# this must run before any kernel import. On a CUDA machine the kernels compile instead (set it by hand to override).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import _backend  # noqa: E402

# One table per dtype, (rtol, atol). bf16 also absorbs the interpreter's fp32 -> bf16 cast, which
# truncates where a GPU rounds to nearest (one ulp), so lora_expand's bf16 y may differ by that much.
TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2},
}


@pytest.fixture
def tolerances() -> dict[torch.dtype, dict[str, float]]:
    return TOLERANCES


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def triton_device(request) -> torch.device:
    """Where a Triton form can launch: CPU under the interpreter, or CUDA."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if request.param == "cpu" and not _backend.INTERPRET:
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 before kernels/ is first imported")
    return torch.device(request.param)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)
