"""linear_by_token: the twin against a per-token loop, the Triton form against the twin."""

import pytest
import torch

from kernels.linear_by_token import linear_by_token_torch, linear_by_token_triton

# name: (rows, in, out, stack rows); odd sizes, -1 mixed with repeats, more tokens than one block.
CASES = {
    "mixed": ([2, -1, 0, 2, -1, 1, 0], 45, 33, 3),
    "none": ([-1] * 5, 20, 9, 2),
    "one-row": ([0] * 7, 20, 9, 1),
    "several-blocks": ([1] * 40 + [-1] * 3 + [0] * 30, 70, 130, 2),
}


def make_inputs(case, dtype, device, gen, bias=True):
    rows, in_f, out_f, stack = case
    x = torch.randn(len(rows), in_f, generator=gen).to(dtype)
    w = (torch.randn(stack, out_f, in_f, generator=gen) * 0.2).to(dtype)
    b = torch.randn(stack, out_f, generator=gen).to(dtype) if bias else None
    y = torch.randn(len(rows), out_f, generator=gen).to(dtype)
    return [t.to(device) if t is not None else None for t in (x, w, b, torch.tensor(rows), y)]


def per_token(x, w, b, rows, y):
    y = y.clone()
    for t, r in enumerate(rows.tolist()):
        if r >= 0:
            y[t] = (x[t].float() @ w[r].float().T + (b[r].float() if b is not None else 0)).to(y.dtype)
    return y


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_twin_equals_a_loop_over_tokens(case, bias, gen):
    x, w, b, rows, y = make_inputs(case, torch.float32, "cpu", gen, bias)
    torch.testing.assert_close(linear_by_token_torch(x, w, b, rows, y.clone()), per_token(x, w, b, rows, y))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_triton_form_equals_the_twin(case, dtype, bias, triton_device, gen, tolerances):
    x, w, b, rows, y = make_inputs(case, dtype, triton_device, gen, bias)
    want = linear_by_token_torch(x, w, b, rows, y.clone())
    got = linear_by_token_triton(x, w, b, rows, y.clone())
    torch.testing.assert_close(got, want, **tolerances[dtype])
    untouched = rows < 0
    assert torch.equal(got[untouched], y[untouched])  # the base's output stays, bit for bit


def test_bad_calls_are_one_line(gen):
    x, w, b, rows, y = make_inputs(CASES["mixed"], torch.float32, "cpu", gen)
    with pytest.raises(ValueError, match=r"w_stacked: expected a contiguous \[N, out, 45\]"):
        linear_by_token_torch(x, w[..., :44].contiguous(), b, rows, y)
    with pytest.raises(ValueError, match=r"rows: expected \[7\] int32 or int64"):
        linear_by_token_torch(x, w, b, rows.float(), y)
