"""engine.batch_invariant: a row's tokens and log probabilities are bitwise those it gives alone whatever else its
steps hold (other rows of every kind, its prompt cut into other chunks), on a plain base and a NeuZip one; the
tiled matmul it rests on gives a row the same result wherever it sits in whatever batch."""

import pytest
import torch

from serve.config import BatchConfig, EngineConfig
from serve.engine.generation.row import NewRow
from serve.engine.model import BaseModelRuntime
from serve.engine.step.invariant import TILE_ROWS, BatchInvariant
from serve.engine.types import SamplingParams
from tests.engine.test_paged import TARGETS, full, generate, pissa
from tests.models import random_emr_group, random_lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_matmul_result_does_not_depend_on_its_batch(dtype):
    """mm, addmm (a linear with its bias) and bmm, one row at a time against slices of every size and offset."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * TILE_ROWS + 5, 96, generator=g).to(dtype)
    w, bias = torch.randn(80, 96, generator=g).to(dtype), torch.randn(80, generator=g).to(dtype)
    stacked = torch.randn(2, 96, 8, generator=g).to(dtype)
    ops = {"mm": lambda a: a @ w.T, "addmm": lambda a: torch.nn.functional.linear(a, w, bias),
           "bmm": lambda a: torch.bmm(a.expand(2, *a.shape), stacked).transpose(0, 1).reshape(len(a), -1)}
    with BatchInvariant():
        for name, op in ops.items():
            alone = torch.cat([op(x[i:i + 1]) for i in range(len(x))])
            for start, rows in ((0, len(x)), (7, 40), (30, 3), (64, 1), (1, 2 * TILE_ROWS)):
                assert torch.equal(op(x[start:start + rows]), alone[start:start + rows]), (name, start, rows)


def runtime(path, invariant: bool = True) -> BaseModelRuntime:
    rt = BaseModelRuntime("lm", path, batch=BatchConfig(max_batch_size=8, max_step_tokens=24, max_model_len=96),
                          engine=EngineConfig(batch_invariant=invariant))
    rt.eos_ids = set()
    return rt


@pytest.mark.parametrize("base", ["plain", "nz"])
def test_with_the_option_every_kinds_rows_give_in_a_batch_what_they_give_alone(bases, base):
    """Rows of the base, a LoRA, a PiSSA, a full fine-tune and (on the plain base) two EMR tasks, prompts of 9 to 33
    tokens over steps of 24 prompt tokens: all at once (prompts cut into other chunks, decode steps of every row,
    the prompts' first blocks read from the prefix cache the rows alone wrote) against each alone, bit for bit."""
    rt = runtime(bases[base])
    kinds = [None, random_lora(rt, "a", 4, 1, TARGETS), pissa(rt, "p", 4, 2), full(rt, "f", 3)]
    kinds += random_emr_group(rt, "g", 2, 5) if base == "plain" else []
    params = SamplingParams(max_tokens=10, logprobs=2)
    rows = [NewRow(i, [(5 * i + j) % 40 + 3 for j in range(9 + 4 * i)], params, v) for i, v in enumerate(kinds)]
    alone = {tag: gen for r in rows for tag, gen in generate(rt, [r]).items()}
    together = generate(rt, rows)
    assert len({tuple(g.token_ids) for g in alone.values()}) >= 4  # the kinds really differ
    for tag, want in alone.items():
        assert together[tag].token_ids == want.token_ids, tag
        assert [lp.logprob for lp in together[tag].logprobs] == [lp.logprob for lp in want.logprobs], tag
        assert [lp.top for lp in together[tag].logprobs] == [lp.top for lp in want.logprobs], tag
