import pytest
import torch

import kernels
from kernels import NO_SLOT, Segments, lora_shrink, make_segments
from kernels._backend import select
from kernels.lora_shrink import lora_shrink_torch, lora_shrink_triton

NUM_SLOTS = 4
MIXED = [2, -1, 0, 2, -1, 1, 0]
SKEWED = [0, 0, -1, 0, 0, 0, 1, 2]  # one long segment: the twin pads 7 tokens to 15 rows
# name: (slot ids, in, R); small, as each interpreted program costs about 1 ms.
CASES = {
    "mixed-r5": (MIXED, 45, 5),
    "mixed-r16": (MIXED, 45, 16),
    "skewed": (SKEWED, 45, 16),
    "all-no-slot": ([NO_SLOT] * 7, 45, 5),
    "single-slot": ([1] * 7, 45, 16),
    "unsorted-16": ([3, 0, -1, 3, 1, 1, -1, 2, 0, 3, 3, -1, 2, 1, 0, 3], 96, 16),
    "several-tiles": ([0] * 66 + [1] * 3 + [-1], 96, 80),  # two token tiles, two rank tiles, two K steps
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(slot_ids: list[int], in_features: int, rank: int, dtype: torch.dtype, device, gen: torch.Generator):
    x = torch.randn(len(slot_ids), in_features, generator=gen).to(device, dtype)  # [T, in]
    a_stacked = (torch.randn(NUM_SLOTS, rank, in_features, generator=gen) * 0.1).to(device, dtype)  # [slots, R, in]
    scale = (torch.rand(NUM_SLOTS, generator=gen) + 0.5).to(device)  # [slots]
    return x, a_stacked, scale, make_segments(torch.tensor(slot_ids, device=device))


def shrink_per_token(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, slot_ids: list[int]):
    """The spec, one token at a time."""
    z = torch.zeros(x.shape[0], a_stacked.shape[1])  # [T, R]
    for t, s in enumerate(slot_ids):
        if s != NO_SLOT:
            z[t] = scale[s] * (x[t].float() @ a_stacked[s].float().T)
    return z


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_lora_shrink_matches_torch(case, dtype, triton_device, gen, tolerances):
    x, a_stacked, scale, seg = make_inputs(*case, dtype, triton_device, gen)
    got = lora_shrink_triton(x, a_stacked, scale, seg)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], a_stacked.shape[1])
    torch.testing.assert_close(got, lora_shrink_torch(x, a_stacked, scale, seg), **tolerances[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slot_ids", [MIXED, [1, 0, -1, 1, 0], SKEWED, [1] * 5, [NO_SLOT] * 3],
                         ids=["padded", "padded-evenly", "skewed", "single-slot", "all-no-slot"])
def test_lora_shrink_torch_matches_per_token_loop(slot_ids, dtype, gen, tolerances):
    x, a_stacked, scale, seg = make_inputs(slot_ids, 9, 3, dtype, "cpu", gen)
    want = shrink_per_token(x, a_stacked, scale, slot_ids)
    torch.testing.assert_close(lora_shrink_torch(x, a_stacked, scale, seg), want, **tolerances[torch.float32])


@pytest.mark.parametrize("form", [lora_shrink_torch, lora_shrink_triton], ids=["torch", "triton"])
def test_lora_shrink_gives_no_slot_tokens_exact_zeros(form, triton_device, gen):
    x, a_stacked, scale, seg = make_inputs(MIXED, 45, 5, torch.float32, triton_device, gen)
    z = form(x, a_stacked, scale, seg)
    assert (z[[1, 4]] == 0).all() and (z[[0, 2, 3, 5, 6]] != 0).all()


@pytest.mark.parametrize("form", [lora_shrink_torch, lora_shrink_triton], ids=["torch", "triton"])
@pytest.mark.parametrize("change, message", [
    (lambda x, a, s, g: (x, a.half(), s, g), "a_stacked: expected dtype torch.float32 .x's.; got torch.float16"),
    (lambda x, a, s, g: (x, a[:, :, :8], s, g), r"a_stacked: expected a contiguous \[num_slots, R, 45\]"),
    (lambda x, a, s, g: (x.T.contiguous().T, a, s, g), "x: expected a contiguous .* non-contiguous"),
    (lambda x, a, s, g: (x, a, s.double(), g), r"scale: expected \[4\] float32; got \[4\] torch.float64"),
    (lambda x, a, s, g: (x[:3], a, s, g), "seg: expected segments of 3 tokens .x's.; got 7"),
], ids=["dtype", "shape", "contiguity", "scale", "seg"])
def test_lora_shrink_rejects_bad_arguments_by_name(form, change, message, gen):
    args = change(*make_inputs(MIXED, 45, 5, torch.float32, "cpu", gen))
    with pytest.raises(ValueError, match=message):
        form(*args)


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
    monkeypatch.setattr(kernels._backend, "INTERPRET", True)
    monkeypatch.setattr(kernels._backend, "FORCED", "torch")
    monkeypatch.setattr(kernels, "lora_shrink_triton", _must_not_run)
    x, a_stacked, scale, seg = make_inputs(MIXED, 45, 5, torch.float32, "cpu", gen)
    torch.testing.assert_close(lora_shrink(x, a_stacked, scale, seg), lora_shrink_torch(x, a_stacked, scale, seg))


def test_manyfold_kernels_rejects_unknown_values():
    with pytest.raises(ValueError, match="MANYFOLD_KERNELS must be 'torch' or 'triton'; got 'cuda'"):
        kernels._backend.parse_forced("cuda")


def _must_not_run(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, seg: Segments) -> torch.Tensor:
    raise AssertionError("the Triton form ran although MANYFOLD_KERNELS=torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_lora_shrink_matches_torch_at_serving_sizes(dtype, gen, tolerances):
    slot_ids = torch.randint(-1, 8, (1000,), generator=gen).tolist()
    x = torch.randn(len(slot_ids), 2048, generator=gen).to("cuda", dtype)  # [T, in]
    a_stacked = (torch.randn(8, 64, 2048, generator=gen) * 0.02).to("cuda", dtype)  # [slots, R, in]
    scale = torch.rand(8, generator=gen).cuda() + 0.5  # [slots]
    seg = make_segments(torch.tensor(slot_ids, device="cuda"))
    got = lora_shrink(x, a_stacked, scale, seg)
    # fp32 sums of 2048 products in different orders: compare against the twin at fp32 scale, not bit for bit.
    tol = tolerances[dtype] if dtype != torch.float32 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got, lora_shrink_torch(x, a_stacked, scale, seg), **tol)
