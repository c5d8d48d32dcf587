"""WeightDecoder hands out each weight decoded bit for bit, inline or ahead, whatever order the modules ask in."""

import torch

from serve.codecs import neuzip
from serve.codecs.neuzip_file import Stream, decode
from serve.engine.neuzip.decoder import TRIALS, WayChooser, WeightDecoder


def coded(name: str, shape: tuple[int, int], gen: torch.Generator) -> Stream:
    """A lossless stream big enough (over 2^16 elements) that its lanes are decoded in two parts."""
    w = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16)
    enc = neuzip.encode(w.view(torch.int16).numpy(), 7)
    return Stream(name, shape, 7, *neuzip.as_tensors(enc))


def test_weights_decoded_ahead_or_inline_equal_their_decoding_in_any_order():
    gen = torch.Generator().manual_seed(0)
    streams = {m: coded(m, (300 + 17 * i, 256), gen) for i, m in enumerate(["a", "b", "c"])}
    want = {m: decode(s) for m, s in streams.items()}
    decoder = WeightDecoder(streams, torch.device("cpu"))
    decoder.way = "ahead"  # wherever it may: forwards of at most ahead_max_tokens tokens
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for order, tokens in ((["a", "b", "c"], 1), (["a", "b", "c"], 1), (["a", "c", "b", "b"], 1),
                              (["a", "b", "c"], 10_000)):
            with decoder.forward(tokens):
                assert decoder.ahead == (tokens == 1)
                for m in order:
                    assert torch.equal(decoder.weight(m).view(torch.int16), want[m].view(torch.int16)), (order, m)
        assert decoder.decode_s > 0 and decoder.wait_s > 0
    finally:
        torch.set_num_threads(threads)
        decoder.close()


def test_each_size_of_forward_is_timed_both_ways_then_keeps_the_faster():
    ways = WayChooser()
    seconds = {(1, True): 0.1, (1, False): 0.3, (64, True): 0.5, (64, False): 0.2}  # steps of 1 and 64 rows
    for _ in range(2 * TRIALS):
        for tokens in (1, 64):
            ahead = ways.ahead(tokens)
            ways.record(tokens, ahead, seconds[tokens, ahead])
    assert ways.chosen() == {1: "ahead", 64: "inline"}
    assert ways.ahead(1) and not ways.ahead(50)  # 50 tokens: the size of 64
    assert ways.ahead(200)  # a size not measured yet starts with a trial ahead


def test_a_gpu_decodes_a_group_of_weights_a_launch_and_hands_out_each_exactly(monkeypatch):
    """GroupDecoder (a GPU's way; here its torch twin on the CPU): weights in model order cut into groups, the
    first weight asked for of a group decodes all of it once, and a weight asked for out of turn decodes its group
    again; every weight handed out equals its own decoding."""
    import serve.engine.neuzip.groups as groups

    gen = torch.Generator().manual_seed(1)
    streams = {m: coded(m, (40 + 3 * i, 32), gen) for i, m in enumerate("ecabd")}  # model order, not by name
    want = {m: decode(s) for m, s in streams.items()}
    launches = []
    real = groups.neuzip_decode_group
    monkeypatch.setattr(groups, "neuzip_decode_group", lambda g: launches.append(g) or real(g))
    decoder = groups.GroupDecoder(streams, torch.device("cpu"), group_elements=3 * 44 * 32)
    assert [[p[4].numel() for p in g.parts] for g in decoder.groups] == [[1280, 1376, 1472], [1568, 1664]]
    for order, decodes in ((list("ecabd"), 2), (list("ecabd"), 2), (list("ebcd"), 4)):
        launches.clear()
        for m in order:
            assert torch.equal(decoder.weight(m).view(torch.int16), want[m].view(torch.int16)), (order, m)
        assert len(launches) == decodes
    first = decoder.weight("e")  # its group again: one more decode
    decoder.weight("a")  # a sibling of the same group: no decode, and e's weight is still e's
    assert torch.equal(first.view(torch.int16), want["e"].view(torch.int16)) and len(launches) == 5
    assert groups.cut_groups({"big": 10, "small": 1}, most=4) == [["big"], ["small"]]
