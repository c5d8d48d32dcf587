import pytest
import torch

from kernels import NO_SLOT, make_segments
from kernels.segments import slot_rows


def test_make_segments_groups_tokens_by_slot_stably():
    seg = make_segments(torch.tensor([2, -1, 0, 2, -1, 1, 0]))
    assert seg.order.tolist() == [2, 6, 5, 0, 3]
    assert seg.slots.tolist() == [0, 1, 2]
    assert seg.starts.tolist() == [0, 2, 3]
    assert seg.lengths.tolist() == [2, 1, 2]
    assert (seg.max_length, seg.num_tokens) == (2, 7)
    assert all(t.dtype == torch.int64 for t in (seg.order, seg.starts, seg.lengths, seg.slots))


@pytest.mark.parametrize("slot_ids", [[NO_SLOT] * 5, []], ids=["all-no-slot", "no-tokens"])
def test_make_segments_leaves_out_no_slot_tokens(slot_ids):
    seg = make_segments(torch.tensor(slot_ids, dtype=torch.int64))
    assert seg.order.numel() == seg.slots.numel() == seg.starts.numel() == seg.lengths.numel() == 0
    assert (seg.max_length, seg.num_tokens) == (0, len(slot_ids))


def test_make_segments_lengths_and_starts_are_consistent(gen):
    slot_ids = torch.randint(-1, 5, (200,), generator=gen)  # [T]
    seg = make_segments(slot_ids)
    assert seg.lengths.sum() == seg.order.numel() == (slot_ids >= 0).sum()
    assert seg.starts.tolist() == (torch.cumsum(seg.lengths, 0) - seg.lengths).tolist()
    assert seg.max_length == seg.lengths.max()
    assert (seg.slots[1:] > seg.slots[:-1]).all() and (seg.slots >= 0).all()
    assert slot_ids[seg.order].tolist() == torch.repeat_interleave(seg.slots, seg.lengths).tolist()
    for start, length in zip(seg.starts.tolist(), seg.lengths.tolist()):
        run = seg.order[start:start + length]
        assert (run[1:] > run[:-1]).all()  # stable: tokens keep their batch order within a slot


def test_make_segments_rejects_values_below_no_slot():
    with pytest.raises(ValueError, match="slot_ids: expected values >= -1; got -2"):
        make_segments(torch.tensor([0, -2]))


def test_padded_layout_covers_every_slotted_token_once_in_order():
    seg = make_segments(torch.tensor([2, -1, 0, 2, -1, 1, 0, 2]))
    assert seg.padded.shape == seg.valid.shape == (3, 3)
    assert seg.valid.sum(1).tolist() == seg.lengths.tolist()
    assert seg.padded[seg.valid].tolist() == seg.order.tolist()  # real entries, row by row, are `order`
    assert seg.slot_range == (0, 3)


def test_padded_layout_has_no_mask_when_segments_are_equally_long():
    seg = make_segments(torch.tensor([1, 0, -1, 1, 0]))
    assert seg.valid is None and seg.padded.tolist() == [[1, 4], [0, 3]]


def test_consecutive_slots_are_read_as_a_view_and_gaps_are_gathered():
    stacked = torch.arange(5.0)
    consecutive = make_segments(torch.tensor([3, 2, 2, -1]))
    assert consecutive.slot_range == (2, 4)
    assert slot_rows(stacked, consecutive).data_ptr() == stacked[2:].data_ptr()
    gap = make_segments(torch.tensor([4, 1, -1]))
    assert gap.slot_range is None and slot_rows(stacked, gap).tolist() == [1.0, 4.0]
    assert make_segments(torch.tensor([-1, -1])).slot_range is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_make_segments_keeps_the_device_of_slot_ids():
    slot_ids = torch.randint(-1, 8, (4096,), device="cuda")
    seg = make_segments(slot_ids)
    assert all(t.device.type == "cuda" for t in (seg.order, seg.starts, seg.lengths, seg.slots))
    assert slot_ids[seg.order].tolist() == torch.repeat_interleave(seg.slots, seg.lengths).tolist()
