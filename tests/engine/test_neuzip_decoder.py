"""WeightDecoder hands out each weight decoded bit for bit, inline or ahead, whatever order the modules ask in."""

import torch

from serve.codecs import neuzip
from serve.codecs.neuzip_file import Stream, decode
from serve.engine.neuzip_decoder import TRIALS, WayChooser, WeightDecoder


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
