"""Public ops of Manyfold's kernels; each binds per call to its Triton form or its torch twin via _backend.

The engine imports only these names; kernels/ imports nothing from serve/.
"""

import torch

from kernels import _backend
from kernels._backend import dispatch
from kernels.chunk_attention import chunk_attention_torch, chunk_attention_triton
from kernels.decode_attention import decode_attention_torch, decode_attention_triton
from kernels.decode_attention_cpu import decode_attention_numba
from kernels.emr_delta import emr_delta_torch, emr_delta_triton, masked, pack_bits, unpack_bits
from kernels.linear_by_token import linear_by_token_torch, linear_by_token_triton
from kernels.lora_bgmv import (HostStacks, bgmv_expand_torch, bgmv_expand_triton, bgmv_shrink_torch,
                               bgmv_shrink_triton, host_stacks, lora_by_token_host, lora_by_token_torch,
                               lora_by_token_triton)
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.neuzip_decode import neuzip_decode_torch, neuzip_decode_triton
from kernels.neuzip_decode_cpu import neuzip_decode_numba
from kernels.neuzip_groups import DecodeGroup, neuzip_decode_group_torch, neuzip_decode_group_triton
from kernels.rms_norm import rms_norm_torch, rms_norm_triton
from kernels.rotary import rotary_store_torch, rotary_store_triton
from kernels.segments import NO_SLOT, Segments, make_segments
from kernels.silu_mul import silu_mul_torch, silu_mul_triton

__all__ = ["DecodeGroup", "HostStacks", "NO_SLOT", "Segments", "bgmv_expand", "bgmv_shrink", "chunk_attention",
           "decode_attention", "emr_delta", "host_stacks", "linear_by_token", "lora_by_token", "lora_expand",
           "lora_shrink", "make_segments", "masked", "neuzip_decode", "neuzip_decode_group", "pack_bits", "rms_norm",
           "rotary_store", "silu_mul", "unpack_bits"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     lengths: torch.Tensor, scale: float, max_length: int) -> torch.Tensor:
    """o[b] = attention of q[b] over the first lengths[b] keys and values of row b's blocks (block_tables[b]),
    GQA; a new [B, H, D] tensor. fp32 CPU tensors run the numba form (what CPU serving runs: it reads the blocks
    where they lie), unless a test forces a form."""
    if not q.is_cuda and q.dtype == torch.float32 and _backend.FORCED is None:
        return decode_attention_numba(q, k_cache, v_cache, block_tables, lengths, scale, max_length)
    return dispatch(decode_attention_torch, decode_attention_triton, q)(q, k_cache, v_cache, block_tables, lengths,
                                                                        scale, max_length)


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    chunks: torch.Tensor, scale: float, max_tokens: int, o: torch.Tensor) -> torch.Tensor:
    """o[t] = causal attention of q[t] over its chunk's row's blocks up to its own position, for every token of every
    chunk (start, length, row, first) in one launch on CUDA; o's other rows untouched. Returns o."""
    return dispatch(chunk_attention_torch, chunk_attention_triton, q)(q, k_cache, v_cache, block_tables, chunks,
                                                                      scale, max_tokens, o)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) as transformers' LlamaRMSNorm, one launch on CUDA; a new tensor."""
    return dispatch(rms_norm_torch, rms_norm_triton, x)(x, weight, eps)


def rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
                 ) -> torch.Tensor:
    """q and k rotated as transformers' apply_rotary_pos_emb rotates them, q in place, k and v written into the paged
    KV cache at (blocks[t], offsets[t]); one launch on CUDA. Returns q."""
    return dispatch(rotary_store_torch, rotary_store_triton, q)(q, k, v, cos, sin, k_cache, v_cache, blocks,
                                                                offsets)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u as a gated MLP computes it eagerly, one launch on CUDA; a new tensor."""
    return dispatch(silu_mul_torch, silu_mul_triton, g)(g, u)


def bgmv_shrink(x: torch.Tensor, a_stacked: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """z[t] = x[t] @ a_stacked[r].T * scale[r] (by blocks of columns for a [N, G] scale) for r = rows[t] >= 0, else
    0; z is a new [S, T, R] fp32 tensor of S partial sums, which bgmv_expand adds up."""
    return dispatch(bgmv_shrink_torch, bgmv_shrink_triton, x)(x, a_stacked, scale, rows)


def bgmv_expand(z: torch.Tensor, b_stacked: torch.Tensor, rows: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y[t] += z.sum(0)[t] @ b_stacked[r].T for r = rows[t] >= 0, in place. Returns y."""
    return dispatch(bgmv_expand_torch, bgmv_expand_triton, y)(z, b_stacked, rows, y)


def lora_by_token(x: torch.Tensor, a_stacked: torch.Tensor, b_stacked: torch.Tensor, scale: torch.Tensor,
                  rows: torch.Tensor, y: torch.Tensor, host: HostStacks | None = None) -> torch.Tensor:
    """y[t] += scale[r] * (x[t] @ a_stacked[r].T) @ b_stacked[r].T for r = rows[t] >= 0, in place. Returns y. fp32
    CPU tensors run the numba form (what CPU serving runs), unless a test forces a form; host: the same stacks as
    host_stacks viewed them once (the adapter pool's), which that form then reads without checking them again."""
    if not y.is_cuda and x.dtype == torch.float32 and _backend.FORCED is None:
        if host is None:  # the stacks as the adapter pool lays them out (B^T contiguous), viewed for this call
            host = host_stacks(a_stacked, b_stacked.transpose(1, 2).contiguous().transpose(1, 2), scale)
        return lora_by_token_host(x, host, rows, y)
    return dispatch(lora_by_token_torch, lora_by_token_triton, y)(x, a_stacked, b_stacked, scale, rows, y)


def emr_delta(x: torch.Tensor, tau: torch.Tensor, masks: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
              y: torch.Tensor) -> torch.Tensor:
    """y[t] += scale[s] * x[t] @ (unpack(masks[s]) * tau).T for s = rows[t] >= 0, in place; masks stay packed."""
    return dispatch(emr_delta_torch, emr_delta_triton, x)(x, tau, masks, scale, rows, y)


def linear_by_token(x: torch.Tensor, w_stacked: torch.Tensor, b_stacked: torch.Tensor | None, rows: torch.Tensor,
                    y: torch.Tensor) -> torch.Tensor:
    """y[t] = x[t] @ w_stacked[r].T (+ b_stacked[r]) for r = rows[t] >= 0, in place; other rows untouched. Returns y."""
    return dispatch(linear_by_token_torch, linear_by_token_triton, x)(x, w_stacked, b_stacked, rows, y)


def neuzip_decode(words: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor, sm: torch.Tensor, bits: int,
                  out: torch.Tensor) -> torch.Tensor:
    """out (a bf16 tensor's bits, int16) from a NeuZip stream, in place; -> status [lanes], 0 where clean.
    CPU tensors decode with numba (the torch twin steps lanes from Python: the specification, not a server's
    path); CUDA tensors with the Triton kernel."""
    if not out.is_cuda:
        return neuzip_decode_numba(words, offsets, table, sm, bits, out)
    return dispatch(neuzip_decode_torch, neuzip_decode_triton, out)(words, offsets, table, sm, bits, out)


def neuzip_decode_group(group: DecodeGroup) -> torch.Tensor:
    """Every coded tensor of the group into its out, in place; -> status, nonzero where a lane did not decode
    cleanly (its layout is the form's own). On CUDA one Triton launch; elsewhere the parts in turn by the torch
    twin (CPU serving decodes with numba through serve/engine/neuzip/decoder.py, not through groups)."""
    return dispatch(neuzip_decode_group_torch, neuzip_decode_group_triton, group.parts[0][4])(group)
