import pytest
import torch

from kernels import NO_SLOT, lora_shrink, make_segments

NUM_SLOTS = 4
MIXED = [2, -1, 0, 2, -1, 1, 0]
SKEWED = [0, 0, -1, 0, 0, 0, 1, 2]  # one long segment: the twin pads 7 tokens to 15 rows


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slot_ids", [MIXED, [1, 0, -1, 1, 0], SKEWED, [1] * 5, [NO_SLOT] * 3],
                         ids=["padded", "padded-evenly", "skewed", "single-slot", "all-no-slot"])
def test_lora_shrink_torch_matches_per_token_loop(slot_ids, dtype, gen, tolerances):
    x, a_stacked, scale, seg = make_inputs(slot_ids, 9, 3, dtype, "cpu", gen)
    want = shrink_per_token(x, a_stacked, scale, slot_ids)
    torch.testing.assert_close(lora_shrink(x, a_stacked, scale, seg), want, **tolerances[torch.float32])


def test_lora_shrink_gives_no_slot_tokens_exact_zeros(gen):
    x, a_stacked, scale, seg = make_inputs(MIXED, 45, 5, torch.float32, "cpu", gen)
    z = lora_shrink(x, a_stacked, scale, seg)
    assert (z[[1, 4]] == 0).all() and (z[[0, 2, 3, 5, 6]] != 0).all()


@pytest.mark.parametrize("change, message", [
    (lambda x, a, s, g: (x, a.half(), s, g), "a_stacked: expected dtype torch.float32 .x's.; got torch.float16"),
    (lambda x, a, s, g: (x, a[:, :, :8], s, g), r"a_stacked: expected a contiguous \[num_slots, R, 45\]"),
    (lambda x, a, s, g: (x.T.contiguous().T, a, s, g), "x: expected a contiguous .* non-contiguous"),
    (lambda x, a, s, g: (x, a, s.double(), g), r"scale: expected \[4\] float32; got \[4\] torch.float64"),
    (lambda x, a, s, g: (x[:3], a, s, g), "seg: expected segments of 3 tokens .x's.; got 7"),
], ids=["dtype", "shape", "contiguity", "scale", "seg"])
def test_lora_shrink_rejects_bad_arguments_by_name(change, message, gen):
    args = change(*make_inputs(MIXED, 45, 5, torch.float32, "cpu", gen))
    with pytest.raises(ValueError, match=message):
        lora_shrink(*args)
