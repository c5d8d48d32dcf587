import pytest
import torch

from kernels import NO_SLOT, lora_expand, make_segments

NUM_SLOTS = 4
MIXED = [2, -1, 0, 2, -1, 1, 0]
SKEWED = [0, 0, -1, 0, 0, 0, 1, 2]  # one long segment: the twin pads 7 tokens to 15 rows
# name: (slot ids, R, out); small, as each interpreted program costs about 1 ms.
CASES = {
    "mixed-r5": (MIXED, 5, 33),
    "mixed-r16": (MIXED, 16, 33),
    "skewed": (SKEWED, 16, 33),
    "all-no-slot": ([NO_SLOT] * 7, 5, 33),
    "single-slot": ([1] * 7, 16, 33),
    "unsorted-16": ([3, 0, -1, 3, 1, 1, -1, 2, 0, 3, 3, -1, 2, 1, 0, 3], 16, 96),
    "several-tiles": ([0] * 66 + [1] * 3 + [-1], 80, 160),  # two token tiles, two output tiles, two R steps
}


def make_inputs(slot_ids: list[int], rank: int, out_features: int, dtype: torch.dtype, device, gen: torch.Generator):
    z = torch.randn(len(slot_ids), rank, generator=gen).to(device)  # [T, R] fp32
    b_stacked = (torch.randn(NUM_SLOTS, out_features, rank, generator=gen) * 0.1).to(device, dtype)  # [slots, out, R]
    y = torch.randn(len(slot_ids), out_features, generator=gen).to(device, dtype)  # [T, out]
    return z, b_stacked, make_segments(torch.tensor(slot_ids, device=device)), y


def expand_per_token(z: torch.Tensor, b_stacked: torch.Tensor, y: torch.Tensor, slot_ids: list[int]) -> torch.Tensor:
    """The spec, one token at a time, on a copy of y."""
    y = y.clone()
    for t, s in enumerate(slot_ids):
        if s != NO_SLOT:
            y[t] = (y[t].float() + z[t] @ b_stacked[s].float().T).to(y.dtype)
    return y


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["mixed-r16", "single-slot", "unsorted-16"])
def test_lora_expand_reads_b_stored_transposed(case, dtype, gen, tolerances):
    """The adapter pool keeps B as a contiguous [slots, R, out] and passes its transpose."""
    z, b_stacked, seg, y = make_inputs(*CASES[case], dtype, "cpu", gen)
    b_view = b_stacked.transpose(1, 2).contiguous().transpose(1, 2)  # [slots, out, R], R-major storage
    assert not b_view.is_contiguous()
    want = lora_expand(z, b_stacked, seg, y.clone())
    torch.testing.assert_close(lora_expand(z, b_view, seg, y.clone()), want, **tolerances[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slot_ids", [MIXED, [1, 0, -1, 1, 0], SKEWED, [1] * 5, [NO_SLOT] * 3],
                         ids=["padded", "padded-evenly", "skewed", "single-slot", "all-no-slot"])
def test_lora_expand_torch_matches_per_token_loop(slot_ids, dtype, gen, tolerances):
    z, b_stacked, seg, y = make_inputs(slot_ids, 3, 9, dtype, "cpu", gen)
    want = expand_per_token(z, b_stacked, y, slot_ids)
    torch.testing.assert_close(lora_expand(z, b_stacked, seg, y.clone()), want, **tolerances[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lora_expand_adds_into_y_and_leaves_no_slot_rows_bit_identical(dtype, gen, tolerances):
    z, b_stacked, seg, y = make_inputs(MIXED, 5, 33, dtype, "cpu", gen)
    before = y.clone()
    out = lora_expand(z, b_stacked, seg, y)
    assert out is y
    assert torch.equal(bits(y[[1, 4]]), bits(before[[1, 4]]))
    delta = torch.stack([z[t] @ b_stacked[s].float().T for t, s in enumerate(MIXED) if s != NO_SLOT])  # [5, out]
    torch.testing.assert_close(y[[0, 2, 3, 5, 6]], (before[[0, 2, 3, 5, 6]].float() + delta).to(dtype),
                               **tolerances[dtype])


@pytest.mark.parametrize("change, message", [
    (lambda z, b, g, y: (z, b.half(), g, y), "b_stacked: expected dtype torch.float32 .y's.; got torch.float16"),
    (lambda z, b, g, y: (z, b[:, :8], g, y), r"b_stacked: expected a \[num_slots, 33, R\] tensor"),
    (lambda z, b, g, y: (z.half(), b, g, y), r"z: expected a contiguous \[7, 5\] float32 tensor; got .* torch.float16"),
    (lambda z, b, g, y: (z, b, g, y.T.contiguous().T), "y: expected a contiguous .* non-contiguous"),
    (lambda z, b, g, y: (z[:3], b, g, y[:3]), "seg: expected segments of 3 tokens .y's.; got 7"),
], ids=["dtype", "shape", "z", "contiguity", "seg"])
def test_lora_expand_rejects_bad_arguments_by_name(change, message, gen):
    args = change(*make_inputs(MIXED, 5, 33, torch.float32, "cpu", gen))
    with pytest.raises(ValueError, match=message):
        lora_expand(*args)
