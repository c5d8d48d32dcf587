import importlib

import pytest
import torch

from kernels import NO_SLOT, pack_bits, unpack_bits
from kernels.emr_delta import emr_delta_torch, emr_delta_triton

NUM_SLOTS = 4
# name: (slot ids, in, out); odd sizes: `in` not a multiple of 8 leaves padding bits in the last mask byte.
CASES = {
    "mixed": ([2, -1, 0, 2, -1, 1, 0], 37, 33),
    "all-no-slot": ([NO_SLOT] * 5, 37, 33),
    "single-slot": ([1] * 7, 20, 9),
    "unsorted-16": ([3, 0, -1, 3, 1, 1, -1, 2, 0, 3, 3, -1, 2, 1, 0, 3], 70, 96),
    "several-tiles": ([0] * 66 + [1] * 3 + [-1] + [3] * 2, 80, 130),  # two token blocks, three output tiles
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(slot_ids, in_features, out_features, dtype, device, gen):
    x = torch.randn(len(slot_ids), in_features, generator=gen).to(device, dtype)  # [T, in]
    tau = (torch.randn(out_features, in_features, generator=gen) * 0.1).to(device, dtype)  # [out, in]
    bools = torch.rand(NUM_SLOTS, out_features, in_features, generator=gen) > 0.5  # [slots, out, in]
    masks = pack_bits(bools).to(device)  # [slots, out, ceil(in / 8)]
    scale = (torch.rand(NUM_SLOTS, generator=gen) + 0.5).to(device)  # [slots] fp32
    y = torch.randn(len(slot_ids), out_features, generator=gen).to(device, dtype)  # [T, out]
    return x, tau, masks, bools, scale, torch.tensor(slot_ids, device=device), y


def per_token(x, tau, bools, scale, y, slot_ids):
    """The spec, one token at a time, with the mask unpacked by hand."""
    y = y.clone()
    for t, s in enumerate(slot_ids):
        if s != NO_SLOT:
            w = bools[s].to(tau.device).float() * tau.float()
            y[t] = (y[t].float() + scale[s] * (x[t].float() @ w.T)).to(y.dtype)
    return y


def test_pack_bits_round_trips_with_little_endian_bit_order():
    mask = torch.tensor([[True, False, False, False, False, False, False, False, True, True, False]])
    packed = pack_bits(mask)
    assert packed.tolist() == [[1, 3]] and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, 11), mask)
    big = torch.rand(3, 5, 29) > 0.3
    assert torch.equal(unpack_bits(pack_bits(big), 29), big)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_emr_delta_torch_matches_per_token_spec(case, dtype, gen, tolerances):
    x, tau, masks, bools, scale, rows, y = make_inputs(*case, dtype, "cpu", gen)
    want = per_token(x, tau, bools, scale, y, case[0])
    torch.testing.assert_close(emr_delta_torch(x, tau, masks, scale, rows, y.clone()), want, **tolerances[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_emr_delta_triton_matches_torch(case, dtype, triton_device, gen, tolerances):
    x, tau, masks, _, scale, rows, y = make_inputs(*case, dtype, triton_device, gen)
    got = emr_delta_triton(x, tau, masks, scale, rows, y.clone())
    torch.testing.assert_close(got, emr_delta_torch(x, tau, masks, scale, rows, y.clone()), **tolerances[dtype])


@pytest.mark.parametrize("form", [emr_delta_torch, emr_delta_triton], ids=["torch", "triton"])
def test_emr_delta_adds_in_place_and_leaves_no_slot_rows_bit_identical(form, triton_device, gen):
    x, tau, masks, _, scale, rows, y = make_inputs(*CASES["mixed"], torch.float32, triton_device, gen)
    before = y.clone()
    assert form(x, tau, masks, scale, rows, y) is y
    assert torch.equal(y[[1, 4]], before[[1, 4]]) and not torch.equal(y[[0, 2]], before[[0, 2]])


def test_emr_delta_twin_bounds_what_it_unpacks(monkeypatch, gen, tolerances):
    """A chunk of output rows at a time gives the same sums as the whole matrix at once."""
    mod = importlib.import_module("kernels.emr_delta")  # the package's `emr_delta` is the public op

    x, tau, masks, _, scale, rows, y = make_inputs(*CASES["unsorted-16"], torch.float32, "cpu", gen)
    whole = emr_delta_torch(x, tau, masks, scale, rows, y.clone())
    monkeypatch.setattr(mod, "CHUNK_ELEMENTS", 3 * 70)  # three output rows a chunk
    torch.testing.assert_close(emr_delta_torch(x, tau, masks, scale, rows, y.clone()), whole, **tolerances[torch.float32])


@pytest.mark.parametrize("form", [emr_delta_torch, emr_delta_triton], ids=["torch", "triton"])
def test_emr_delta_refuses_a_mask_of_the_wrong_shape(form, gen):
    x, tau, masks, _, scale, rows, y = make_inputs(*CASES["mixed"], torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match="masks: expected a contiguous"):
        form(x, tau, masks[:, :, :-1].contiguous(), scale, rows, y)
