"""Each sampling control against transformers' own logits processor on the same logits (OpenAI's formula for the
frequency and presence penalties, which transformers has no processor for), and a step's rows each under its own
controls: what a row is given does not depend on the other rows of its step."""

import math

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from serve.engine.generation.sampling import (RowSampling, controlled_logits, draw, probabilities, sample,
                                   sampling_metadata)
from serve.engine.types import SamplingParams

VOCAB = 50
CPU = torch.device("cpu")


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(params: SamplingParams, prompt=(1, 2, 3), output=(), ends=frozenset({7}), seed: int | None = 0) -> RowSampling:
    rng = torch.Generator().manual_seed(seed) if seed is not None else None
    return RowSampling(params, rng, list(prompt), list(output), ends)


def ours(params: SamplingParams, x: torch.Tensor, **kw) -> torch.Tensor:
    """The logits a row's controls leave, then (sampled rows) its probabilities after temperature and truncation."""
    meta = sampling_metadata([row(params, **kw)], VOCAB, CPU)
    y = controlled_logits(x.clone(), meta)
    return probabilities(y, meta) if params.temperature > 0 else y


def same_probabilities(ours_p: torch.Tensor, theirs_logits: torch.Tensor) -> None:
    theirs = theirs_logits.softmax(-1)
    assert torch.equal(ours_p > 0, theirs > 0)  # the same tokens left out
    torch.testing.assert_close(ours_p / ours_p.sum(-1, keepdim=True), theirs)


@pytest.mark.parametrize("t", [0.3, 1.0, 1.7])
def test_temperature_matches_transformers(t):
    x = logits()
    same_probabilities(ours(SamplingParams(temperature=t), x), TemperatureLogitsWarper(t)(None, x.clone()))


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_matches_transformers(k):
    x = logits()
    same_probabilities(ours(SamplingParams(temperature=1.0, top_k=k), x), TopKLogitsWarper(k)(None, x.clone()))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9])
def test_top_p_matches_transformers(p):
    x = logits()
    same_probabilities(ours(SamplingParams(temperature=1.0, top_p=p), x), TopPLogitsWarper(p)(None, x.clone()))


@pytest.mark.parametrize("m", [0.01, 0.2, 0.9])
def test_min_p_matches_transformers(m):
    x = logits()
    same_probabilities(ours(SamplingParams(temperature=1.0, min_p=m), x), MinPLogitsWarper(m)(None, x.clone()))


def test_temperature_then_top_k_top_p_and_min_p_together_match_transformers_chain():
    x = logits(seed=3)
    theirs = x.clone()
    for warper in (TemperatureLogitsWarper(0.7), MinPLogitsWarper(0.02), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        theirs = warper(None, theirs)
    same_probabilities(ours(SamplingParams(temperature=0.7, min_p=0.02, top_k=20, top_p=0.8), x), theirs)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers_over_prompt_and_output(penalty):
    x = logits(seed=1)
    prompt, output = [4, 9, 9, 30], [11, 4, 0]
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), x.clone())
    assert torch.equal(ours(SamplingParams(repetition_penalty=penalty), x, prompt=prompt, output=output), theirs)


def test_frequency_and_presence_penalties_follow_openais_formula_over_the_output_only():
    """OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c[j] the count of token j in the
    output so far (transformers has no processor for them)."""
    x = logits(seed=2)
    prompt, output = [5, 6], [8, 8, 8, 13, 5]
    got = ours(SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), x, prompt=prompt, output=output)
    want = x.clone()
    for j in range(VOCAB):
        c = output.count(j)
        want[0, j] -= c * 0.7 + (c > 0) * -0.4
    torch.testing.assert_close(got, want)


def test_logit_bias_matches_transformers_sequence_bias():
    x = logits(seed=4)
    bias = ((3, 5.0), (17, -100.0), (49, 0.25))
    theirs = SequenceBiasLogitsProcessor({(t,): v for t, v in bias})(torch.tensor([[1, 2]]), x.clone())
    torch.testing.assert_close(ours(SamplingParams(logit_bias=bias), x), theirs)


@pytest.mark.parametrize("out", [0, 2, 3])
def test_min_tokens_matches_transformers_min_new_tokens(out):
    x = logits(seed=5)
    prompt, output = [1, 2, 3, 4], list(range(10, 10 + out))
    theirs = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [7, 9])(torch.tensor([prompt + output]), x.clone())
    meta = sampling_metadata([row(SamplingParams(min_tokens=3), prompt=prompt, output=output, ends=frozenset({7, 9}))],
                             VOCAB, CPU)
    got = x.clone() if meta is None else controlled_logits(x.clone(), meta)  # None: nothing to change
    assert torch.equal(got, theirs)


def test_greedy_rows_take_the_argmax_of_their_controlled_logits():
    x = logits(rows=3, seed=6)
    rows = [row(SamplingParams()), row(SamplingParams(logit_bias=((int(x[1].argmin()), 1e4),))),
            row(SamplingParams(repetition_penalty=1e6), prompt=[int(x[2].argmax())])]
    tokens = sample(x, sampling_metadata(rows, VOCAB, CPU))
    assert tokens[0] == x[0].argmax() and tokens[1] == x[1].argmin()
    assert tokens[2] == x[2].clone().index_fill_(0, x[2].argmax(), -math.inf).argmax()


def test_a_step_with_no_controlled_row_builds_no_metadata():
    assert sampling_metadata([row(SamplingParams()), None, row(SamplingParams(top_k=3))], VOCAB, CPU) is None


def test_draw_is_inverse_cdf_and_never_takes_a_token_left_out():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.2, 0.0, 0.0, 0.0]])
    assert draw(probs, torch.tensor([0.0, 0.99])).tolist() == [1, 0]
    assert draw(probs, torch.tensor([0.51, 0.0])).tolist() == [3, 0]


CONTROLS = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=4, seed=2),
            SamplingParams(temperature=0.9, top_p=0.6, min_p=0.05, seed=3), SamplingParams(repetition_penalty=1.5),
            SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, temperature=0.5, seed=4),
            SamplingParams(logit_bias=((5, 3.0),)), SamplingParams(min_tokens=4)]


def test_each_row_samples_what_it_samples_alone_whatever_its_step_holds():
    x = logits(rows=len(CONTROLS), seed=7)
    together = sample(x.clone(), sampling_metadata([row(p, output=[5, 7]) for p in CONTROLS], VOCAB, CPU))
    alone = [sample(x[i:i + 1].clone(), sampling_metadata([row(p, output=[5, 7])], VOCAB, CPU)).item()
             for i, p in enumerate(CONTROLS)]
    assert together.tolist() == alone
    again = sample(x.clone(), sampling_metadata([row(p, output=[5, 7]) for p in CONTROLS], VOCAB, CPU))
    assert again.tolist() == alone  # seeded rows repeat
