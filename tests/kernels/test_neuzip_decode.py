import numpy as np
import pytest
import torch

from kernels.neuzip_decode import (DecodeGroup, neuzip_decode_group_torch, neuzip_decode_group_triton,
                                   neuzip_decode_numba, neuzip_decode_torch, neuzip_decode_triton)
from serve.codecs import neuzip

# name: (elements, lane): one lane, a ragged last step, lanes of one symbol, many lanes.
SHAPES = {"one-lane": (700, 2048), "ragged": (1001, 64), "one-symbol-lanes": (37, 1), "many-lanes": (5000, 16)}


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
    outputs at odd places of one buffer, as a GPU server's group of weights is."""
    buffer = torch.zeros(sum(n for n, _ in SHAPES.values()) + 3 * len(SHAPES), dtype=torch.int16,
                         device=triton_device)
    parts, wants, at = [], [], 3
    for n, lane in SHAPES.values():
        enc, args = streams(n, lane, bits, gen, triton_device)
        parts.append((*args, buffer[at:at + n]))
        wants.append(torch.from_numpy(neuzip.decode(enc).view(np.int16)))
        at += n + 3
    group = DecodeGroup(parts, bits)
    assert not neuzip_decode_group_triton(group).any()
    got = [p[4].clone() for p in parts]
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, wants))
    buffer.zero_()
    assert not neuzip_decode_group_torch(group).any()
    assert all(torch.equal(g, p[4]) for g, p in zip(got, parts))
    assert buffer[:3].eq(0).all()  # nothing written outside the parts


def test_a_group_flags_a_damaged_part(triton_device, gen):
    enc, (words, offsets, table, sm) = streams(*SHAPES["many-lanes"], 7, gen, triton_device)
    _, good = streams(*SHAPES["ragged"], 7, gen, triton_device)
    flipped = words.clone()
    flipped[int(offsets[5]) + 3] ^= 0x5A5A
    out = torch.empty(enc.n + 1001, dtype=torch.int16, device=triton_device)
    parts = [(*good, out[:1001]), (flipped, offsets, table, sm, out[1001:])]
    for form in (neuzip_decode_group_triton, neuzip_decode_group_torch):
        assert form(DecodeGroup(parts, 7)).any()
