"""Chooses, per call, between an op's Triton form and its torch twin; the only place kernels/ imports triton.

"triton" on CUDA tensors, otherwise "torch", whatever TRITON_INTERPRET says: a server on CPU never runs an
emulator. MANYFOLD_KERNELS=torch|triton overrides; it is read once, when kernels/ is first imported (a step runs
hundreds of ops: none reads the environment). "triton" on CPU tensors needs TRITON_INTERPRET=1 set before then,
and is for tests that ask for the interpreter explicitly (they set FORCED).
"""

import os
from collections.abc import Callable
from typing import Literal

import torch

Backend = Literal["torch", "triton"]

try:
    import triton
    import triton.language as tl

    TRITON_ERROR: Exception | None = None
    # triton.jit reads TRITON_INTERPRET when it decorates a kernel, i.e. when kernels/ is first imported,
    # so the choice must follow the value seen then, not whatever the environment says later.
    INTERPRET: bool = bool(triton.knobs.runtime.interpret)
except Exception as e:  # a broken install can fail with more than ImportError (missing libcuda, ABI)
    TRITON_ERROR = e
    INTERPRET = False

    class _Missing:
        """Stands in for triton and triton.language: kernels still define (jit is identity), never launch."""

        def jit(self, fn: Callable) -> Callable:
            return fn

        def __getattr__(self, name: str) -> None:
            return None

    triton = tl = _Missing()


def parse_forced(value: str) -> Backend | None:
    """MANYFOLD_KERNELS's value -> the form it forces (None: chosen by the tensors' device)."""
    if not value:
        return None
    if value not in ("torch", "triton"):
        raise ValueError(f"MANYFOLD_KERNELS must be 'torch' or 'triton'; got {value!r}")
    if value == "triton" and TRITON_ERROR is not None:
        raise RuntimeError(f"MANYFOLD_KERNELS=triton but triton cannot be imported: {TRITON_ERROR}")
    return value  # type: ignore[return-value]


FORCED: Backend | None = parse_forced(os.environ.get("MANYFOLD_KERNELS", ""))


def select(*tensors: torch.Tensor) -> Backend:
    """Which form runs this call: FORCED, else Triton for CUDA tensors."""
    if FORCED is not None:
        return FORCED
    if TRITON_ERROR is not None:
        return "torch"
    return "triton" if any(t.is_cuda for t in tensors) else "torch"


def dispatch(torch_fn: Callable, triton_fn: Callable, *tensors: torch.Tensor) -> Callable:
    """The implementation `select` picks for these tensors."""
    return triton_fn if select(*tensors) == "triton" else torch_fn
