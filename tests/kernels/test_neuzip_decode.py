import numpy as np
import pytest
import torch

from kernels.neuzip_decode import BLOCK_LANES, neuzip_decode_torch, neuzip_decode_triton
from kernels.neuzip_decode_cpu import neuzip_decode_numba
from kernels.neuzip_groups import DecodeGroup, neuzip_decode_group_torch, neuzip_decode_group_triton
from serve.codecs import neuzip

# name: (elements, lane): one lane, a ragged last step, lanes of one symbol, many lanes.
SHAPES = {"one-lane": (240, 2048), "ragged": (1001, 64), "one-symbol-lanes": (37, 1), "many-lanes": (5000, 16)}


def weights(n: int, gen: torch.Generator) -> np.ndarray:
    w = (torch.randn(n, generator=gen) * 0.05).to(torch.bfloat16)
    return w.view(torch.int16).numpy().view(np.uint16)


def streams(n, lane, bits, gen, device="cpu"):
    enc = neuzip.encode(weights(n, gen), bits, lane=lane)
    return enc, [t.to(device) for t in neuzip.as_tensors(enc)]


@pytest.mark.parametrize("bits", neuzip.BITS)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_numba_and_torch_twin_decode_what_was_encoded(shape, bits, gen):
    bits16 = weights(shape[0], gen)
    enc = neuzip.encode(bits16, bits, lane=shape[1])
    want = neuzip.rounded(bits16, bits)
    for form in (neuzip_decode_torch, neuzip_decode_numba):
        out = torch.empty(enc.n, dtype=torch.int16)
        status = form(*neuzip.as_tensors(enc), bits, out)
        assert not status.any() and status.numel() == enc.lanes
        assert np.array_equal(out.numpy().view(np.uint16), want), form.__name__


@pytest.mark.parametrize("bits", neuzip.BITS)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_triton_matches_torch_twin(shape, bits, triton_device, gen):
    enc, args = streams(*shape, bits, gen, triton_device)
    got, want = (torch.empty(enc.n, dtype=torch.int16, device=triton_device) for _ in range(2))
    assert not neuzip_decode_triton(*args, bits, got).any()
    assert not neuzip_decode_torch(*args, bits, want).any()
    assert torch.equal(got, want)


def flags_damaged_lanes(form, gen: torch.Generator, device: torch.device | str = "cpu") -> None:
    """A flipped word, a cut stream and a shifted lane boundary all show in the status; nothing reads out of
    bounds."""
    enc, (words, offsets, table, sm) = streams(*SHAPES["many-lanes"], 7, gen, device)
    lane = 5
    flipped = words.clone()
    flipped[int(offsets[lane]) + 3] ^= 0x5A5A
    cut = offsets.clone()
    cut[-1] -= 1
    shifted = offsets.clone()
    shifted[lane + 1] += 1
    for w, o, bad_lane in ((flipped, offsets, lane), (words[:-1].clone(), cut, enc.lanes - 1), (words, shifted, lane)):
        out = torch.empty(enc.n, dtype=torch.int16, device=device)
        status = form(w, o, table, sm, 7, out)
        assert status[bad_lane] == 1


@pytest.mark.parametrize("form", [neuzip_decode_torch, neuzip_decode_numba], ids=["torch", "numba"])
def test_every_cpu_form_flags_the_lanes_of_a_damaged_stream(form, gen):
    flags_damaged_lanes(form, gen)


def test_triton_flags_the_lanes_of_a_damaged_stream(triton_device, gen):
    flags_damaged_lanes(neuzip_decode_triton, gen, triton_device)


def test_forms_refuse_arguments_of_the_wrong_kind(gen):
    enc, (words, offsets, table, sm) = streams(100, 16, 3, gen)
    out = torch.empty(enc.n, dtype=torch.int16)
    with pytest.raises(ValueError, match="bits must be"):
        neuzip_decode_torch(words, offsets, table, sm, 2, out)
    with pytest.raises(TypeError, match="int16"):
        neuzip_decode_numba(words, offsets, table, sm, 3, out.float())
    with pytest.raises(ValueError, match="sm has"):
        neuzip_decode_numba(words, offsets, table, sm[:10], 3, out)


@pytest.mark.parametrize("bits", neuzip.BITS)
def test_a_group_decodes_in_one_launch_what_each_part_decodes_alone(bits, triton_device, gen):
    """Parts of every shape (one lane, ragged, one-symbol lanes, many lanes) at their own lane lengths, their
    outputs at odd places of one buffer, as a GPU server's group of weights is; nothing else is written."""
    sentinel = 0x5A5A
    buffer = torch.full((sum(n for n, _ in SHAPES.values()) + 3 * len(SHAPES) + 3,), sentinel, dtype=torch.int16,
                        device=triton_device)
    parts, wants, at, gaps = [], [], 3, torch.ones(buffer.numel(), dtype=torch.bool)
    for n, lane in SHAPES.values():
        enc, args = streams(n, lane, bits, gen, triton_device)
        parts.append((*args, buffer[at:at + n]))
        wants.append(torch.from_numpy(neuzip.decode(enc).view(np.int16)))
        gaps[at:at + n] = False
        at += n + 3
    group = DecodeGroup(parts, bits)
    assert not neuzip_decode_group_triton(group).any()
    assert all(torch.equal(p[4].cpu(), w) for p, w in zip(parts, wants))
    assert buffer.cpu()[gaps].eq(sentinel).all()
    buffer.fill_(sentinel)
    assert not neuzip_decode_group_torch(group).any()
    assert all(torch.equal(p[4].cpu(), w) for p, w in zip(parts, wants)) and buffer.cpu()[gaps].eq(sentinel).all()


def test_a_group_flags_the_damaged_lane_of_the_damaged_part_only(triton_device, gen):
    _, good = streams(*SHAPES["ragged"], 7, gen, triton_device)  # 16 lanes: the Triton form's first block
    enc, (words, offsets, table, sm) = streams(*SHAPES["many-lanes"], 7, gen, triton_device)
    flipped = words.clone()
    flipped[int(offsets[5]) + 3] ^= 0x5A5A
    out = torch.empty(enc.n + 1001, dtype=torch.int16, device=triton_device)
    group = DecodeGroup([(*good, out[:1001]), (flipped, offsets, table, sm, out[1001:])], 7)
    bad_at = {neuzip_decode_group_triton: BLOCK_LANES + 5, neuzip_decode_group_torch: 16 + 5}  # each form's layout
    for form, at in bad_at.items():
        assert form(group).nonzero().flatten().tolist() == [at], form.__name__


def test_a_group_refuses_tensors_it_cannot_read_by_address(gen):
    _, args = streams(*SHAPES["ragged"], 7, gen)
    out = torch.empty(2 * 1001, dtype=torch.int16)
    with pytest.raises(ValueError, match="contiguous"):
        DecodeGroup([(*args, out[::2])], 7)
    with pytest.raises(ValueError, match="at least one"):
        DecodeGroup([], 7)
