"""bgmv_shrink / bgmv_expand: the Triton forms against their twins, and the twins against a loop over tokens."""

import pytest
import torch

from kernels.lora_bgmv import bgmv_expand_torch, bgmv_expand_triton, bgmv_shrink_torch, bgmv_shrink_triton

ROWS = [2, -1, 0, 2, -1, 1, 0]  # repeats, absent tokens, every stack row


def make_inputs(dtype, device, gen, in_f=45, out=37, rank=5, n=3):
    x = torch.randn(len(ROWS), in_f, generator=gen).to(dtype)
    a = torch.randn(n, rank, in_f, generator=gen).to(dtype)
    b = torch.randn(n, out, rank, generator=gen).to(dtype)
    scale = torch.rand(n, generator=gen) + 0.5
    y = torch.randn(len(ROWS), out, generator=gen).to(dtype)
    return [t.to(device) for t in (x, a, scale, b, y, torch.tensor(ROWS))]


def test_the_twins_equal_a_loop_over_tokens(gen):
    x, a, scale, b, y, rows = make_inputs(torch.float32, "cpu", gen)
    z = bgmv_shrink_torch(x, a, scale, rows)
    assert z.shape == (1, len(ROWS), a.shape[1])
    z = z[0]
    want_y = y.clone()
    for t, r in enumerate(ROWS):
        want_z = scale[r] * x[t] @ a[r].T if r >= 0 else torch.zeros(a.shape[1])
        torch.testing.assert_close(z[t], want_z)
        if r >= 0:
            want_y[t] += z[t] @ b[r].T
    torch.testing.assert_close(bgmv_expand_torch(z[None], b, rows, y.clone()), want_y)


@pytest.mark.parametrize("in_f", [45, 300])  # 300: `in` split over several programs per token, summed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_forms_equal_their_twins(dtype, in_f, triton_device, gen, tolerances):
    x, a, scale, b, y, rows = make_inputs(dtype, triton_device, gen, in_f=in_f)
    z = bgmv_shrink_triton(x, a, scale, rows)
    assert z.shape[0] == (1 if in_f == 45 else 3)  # partial sums: one per part of `in`
    torch.testing.assert_close(z.sum(0), bgmv_shrink_torch(x, a, scale, rows)[0], **tolerances[torch.float32 if dtype ==
                                                                                                 torch.float32 else dtype])
    bt = b.transpose(1, 2).contiguous().transpose(1, 2)  # the adapter pool's layout: B^T contiguous
    got = bgmv_expand_triton(z, bt, rows, y.clone())
    want = bgmv_expand_torch(z, b, rows, y.clone())
    torch.testing.assert_close(got, want, **tolerances[dtype])
    untouched = rows < 0
    assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("in_f", [45, 300])
def test_the_numba_form_equals_the_twins(in_f, gen):
    from kernels.lora_bgmv import host_stacks, lora_by_token_host, lora_by_token_torch

    x, a, scale, b, y, rows = make_inputs(torch.float32, "cpu", gen, in_f=in_f)
    bt = b.transpose(1, 2).contiguous().transpose(1, 2)  # the adapter pool's layout
    got = lora_by_token_host(x, host_stacks(a, bt, scale), rows.to(torch.int32), y.clone())
    torch.testing.assert_close(got, lora_by_token_torch(x, a, b, scale, rows, y.clone()), rtol=1e-5, atol=1e-5)
    untouched = rows < 0
    assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("form", ["torch", "triton"])
def test_packed_layers_shrink_in_one_launch_as_each_alone(form, triton_device, gen):
    """Three layers' A stacks in one [N, 3R, in] tensor, a scale each: one shrink, then each layer's expand over its
    own block of z, gives what each layer's own shrink and expand give."""
    shrink, expand = {"torch": (bgmv_shrink_torch, bgmv_expand_torch),
                      "triton": (bgmv_shrink_triton, bgmv_expand_triton)}[form]
    n, rank, in_f, outs = 3, 4, 300, (37, 9, 9)
    x = torch.randn(len(ROWS), in_f, generator=gen).to(triton_device)
    packed = torch.randn(n, 3 * rank, in_f, generator=gen).to(triton_device)
    scale = (torch.rand(n, 3, generator=gen) + 0.5).to(triton_device)
    rows = torch.tensor(ROWS, device=triton_device)
    z = shrink(x, packed, scale, rows)
    for g, out in enumerate(outs):
        b = torch.randn(n, out, rank, generator=gen).to(triton_device)
        y = torch.randn(len(ROWS), out, generator=gen).to(triton_device)
        a = packed[:, g * rank:(g + 1) * rank]  # a strided view: the layer's own stack
        alone = bgmv_expand_torch(bgmv_shrink_torch(x, a.contiguous(), scale[:, g].contiguous(), rows), b, rows,
                                  y.clone())
        # sums of 300 products in another order: fp32 rounding of the larger partials
        torch.testing.assert_close(expand(z[..., g * rank:(g + 1) * rank], b, rows, y.clone()), alone,
                                   rtol=1e-4, atol=1e-4)


def test_a_scale_that_does_not_split_the_rank_fails_with_one_clear_line(gen):
    x, a, scale, b, y, rows = make_inputs(torch.float32, "cpu", gen)  # rank 5
    with pytest.raises(ValueError, match="scale: expected"):
        bgmv_shrink_torch(x, a, scale[:, None].expand(-1, 2).contiguous(), rows)


def test_stacks_viewed_once_read_rows_written_later_and_calls_are_still_checked(gen):
    from kernels import lora_by_token
    from kernels.lora_bgmv import host_stacks, lora_by_token_host

    x, a, scale, b, y, rows = make_inputs(torch.float32, "cpu", gen, in_f=300)
    bt = b.transpose(1, 2).contiguous().transpose(1, 2)  # the adapter pool's layout
    rows = rows.to(torch.int32)
    stacks = host_stacks(a, bt, scale)
    assert torch.equal(lora_by_token_host(x, stacks, rows, y.clone()), lora_by_token(x, a, b, scale, rows, y.clone()))
    with torch.no_grad():
        a[1] += 1.0  # the views share the stacks' memory: a row written later is read
    assert torch.equal(lora_by_token_host(x, stacks, rows, y.clone()), lora_by_token(x, a, b, scale, rows, y.clone()))
    with pytest.raises(ValueError, match="x, rows, y: expected contiguous"):
        lora_by_token_host(x, stacks, rows, y[:, :5].clone())
    with pytest.raises(ValueError, match="expected the transpose of a contiguous"):
        host_stacks(a, b, scale)
