"""Fixtures of the adapter tests: one thread, and the Trans-LoRA tests' two tiny bases and the adapter they move."""

import pytest
import torch

from serve.adapters import translora
from serve.adapters.train import train_adapter
from tests.adapters import toy_task
from tests.models import write_tiny_causal, write_tiny_gpt2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads; on a shared 2-core machine two spinning threads run 4x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two architectures and tokenizers: a tiny Llama (the source) and a tiny GPT-2."""
    tmp = tmp_path_factory.mktemp("translora")
    return write_tiny_causal(tmp / "llama"), write_tiny_gpt2(tmp / "gpt2")


@pytest.fixture(scope="module")
def source_adapter(bases, tmp_path_factory):
    """A PiSSA adapter of the toy task on the Llama, with its discriminator, seeds and validation set beside it."""
    out = tmp_path_factory.mktemp("adapter") / "toy"
    train_adapter(bases[0], toy_task(), out, init="pissa", rank=4, steps=4, progress=lambda *_: None)
    info = translora.train_discriminator(bases[0], out, toy_task(), "toy", steps=4)
    assert info["real"] == 15 and info["generated"] == 15 and len(info["losses"]) == 4  # 24 less 9 held out
    assert info["seeds"] == 5 and info["validation"] == 9
    return out


@pytest.fixture
def any_student_passes(monkeypatch):
    """For tests of what a store-wide transfer does around each transfer (resuming, skipping, failing one): the
    guard's choice is made to keep every student, whatever its figures (test_transfer_guard.py tests the guard)."""
    monkeypatch.setattr(translora, "choose", lambda comparison, keep_unchanged: "student")
