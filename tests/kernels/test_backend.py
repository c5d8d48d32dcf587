"""kernels._backend: which form of an op runs. A server on a CPU runs the torch twin whatever TRITON_INTERPRET says;
only a test that asks for the interpreter gets the Triton form on CPU tensors; MANYFOLD_KERNELS forces a form."""

import pytest
import torch

import kernels
from kernels import decode_attention
from kernels._backend import select
from kernels.decode_attention import decode_attention_torch


def test_select_runs_the_twin_for_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setattr(kernels._backend, "INTERPRET", False)
    monkeypatch.setattr(kernels._backend, "FORCED", None)
    assert select(torch.zeros(1)) == "torch"


def test_select_runs_the_twin_for_cpu_tensors_even_under_the_interpreter(monkeypatch):
    """TRITON_INTERPRET=1 in a server's environment must not turn it into an emulator."""
    monkeypatch.setattr(kernels._backend, "INTERPRET", True)
    monkeypatch.setattr(kernels._backend, "FORCED", None)
    assert select(torch.zeros(1)) == "torch"


def test_a_test_asks_for_the_interpreter_explicitly(monkeypatch):
    monkeypatch.setattr(kernels._backend, "INTERPRET", True)
    monkeypatch.setattr(kernels._backend, "FORCED", "triton")
    assert select(torch.zeros(1)) == "triton"


def test_manyfold_kernels_torch_forces_the_twin(monkeypatch, gen):
    def must_not_run(*args):
        raise AssertionError("the Triton form ran although MANYFOLD_KERNELS=torch")

    monkeypatch.setattr(kernels._backend, "INTERPRET", True)
    monkeypatch.setattr(kernels._backend, "FORCED", "torch")
    monkeypatch.setattr(kernels, "decode_attention_triton", must_not_run)
    q, k, v = torch.randn(2, 4, 8, generator=gen), torch.randn(3, 5, 2, 8, generator=gen), torch.randn(3, 5, 2, 8)
    tables, lengths = torch.tensor([[2], [0]]), torch.tensor([3, 5])
    torch.testing.assert_close(decode_attention(q, k, v, tables, lengths, 0.5, 5),
                               decode_attention_torch(q, k, v, tables, lengths, 0.5, 5))


def test_manyfold_kernels_rejects_unknown_values():
    with pytest.raises(ValueError, match="MANYFOLD_KERNELS must be 'torch' or 'triton'; got 'cuda'"):
        kernels._backend.parse_forced("cuda")
