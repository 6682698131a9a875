"""The dense prefill attention (rollout.attention's PrefillContext with prefill_attention =
dense): packed prompts right-padded to the longest one through one dense causal kernel (cuDNN on
CUDA), and the prefill's K/V cache write as an opaque op."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridengine.kernels import kv_write
from hybridengine.kernels.settings import DEFAULT_KERNEL_SETTINGS
from hybridengine.rollout.kv_cache import write_rows


# With the dense prefill attention (an opaque op), inductor deferred each layer's K/V cache
# write and fused those of 4 layers into one kernel that ran ~8x slower than the write in the
# varlen prefill (16 against 1.9 ms per generate on an H200, bench/RESULTS.md 2026-11-30
# session 6): as an opaque op of its own, the write runs where the layer computes it. Through
# torch's indexing it took 10 ms per generate there; kernels.kv_write does it in one Triton
# launch per layer where it runs (RolloutKernelSettings.triton_kv_write; benchmarks turn it
# off to compare).
@torch.library.custom_op("hybridengine::write_prefill_kv", mutates_args=("k_cache", "v_cache"))
def write_prefill_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, dst_slot: torch.Tensor,
                     dst_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     src: torch.Tensor,
                     triton: bool = DEFAULT_KERNEL_SETTINGS.triton_kv_write) -> None:
    """k_cache/v_cache[dst_slot[i], dst_pos[i]] = k/v[src[i]] (KVCache.write of packed rows):
    with triton, through kernels.kv_write where it runs, else torch's indexing."""
    if triton and kv_write.available(k.device) and \
            kv_write.supports(k_cache, v_cache, k, v):
        kv_write.write_kv_rows(k_cache, v_cache, dst_slot, dst_pos, k, v, src)
        return
    write_rows(k_cache, v_cache, dst_slot, dst_pos, k.index_select(0, src),
               v.index_select(0, src))


@write_prefill_kv.register_fake
def _(*args, **kwargs):
    return None


def padded_causal_attention(q, k, v, num_seqs: int, max_len: int,
                            pad_index: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed sequences q [T, h_q, d], k/v [T, h_kv, d] through a dense
    [num_seqs, h, max_len, d] kernel: each sequence right-padded with zeros to max_len
    (pad_index [T] = sequence · max_len + position; None when every sequence has max_len
    tokens and the packed rows already are the dense ones). Right padding needs no mask: a real
    query at position i sees keys 0..i, all real; padded rows are computed and dropped. On
    CUDA, cuDNN's fused attention (on an H200 at 32 × 512 tokens, h_q 14, h_kv 2, d 64: 64 µs
    against 146 µs for flash varlen; bench/RESULTS.md 2026-11-30 session 6), else SDPA."""
    if pad_index is None:
        return dense_causal_attention(q, k, v, num_seqs, max_len)

    def pad(x):
        return x.new_zeros(num_seqs * max_len, *x.shape[1:]).index_copy_(0, pad_index, x)
    out = dense_causal_attention(pad(q), pad(k), pad(v), num_seqs, max_len)
    return out.index_select(0, pad_index)


# A custom op, as the decode kernels: under torch.compile inductor sees one opaque call that
# takes q, k, v with the strides they have (views of the qkv projection and the RoPE output)
# instead of applying its own stride rules for cuDNN's inputs.
@torch.library.custom_op("hybridengine::dense_causal_attention", mutates_args=())
def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int,
                           max_len: int) -> torch.Tensor:
    """q [S·N, h_q, d], k/v [S·N, h_kv, d] holding S = num_seqs sequences of N = max_len rows
    each -> causal attention within each sequence, [S·N, h_q, d] (see padded_causal_attention)."""
    T, hq, d = q.shape
    qd, kd, vd = (x.view(num_seqs, max_len, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qd, kd, vd, None, False, 0.0, True, False, scale=d ** -0.5)[0]
    else:
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                             enable_gqa=kd.shape[1] != hq)
    return out.transpose(1, 2).reshape(T, hq, d).contiguous()


@dense_causal_attention.register_fake
def _(q, k, v, num_seqs, max_len):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
