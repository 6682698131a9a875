"""FLOPs accounting for a dense decoder: model FLOPs, throughput and MFU.

Contract: pure arithmetic on model shapes and sequence lengths (no model object, no
communication), plus one measurement, `peak_flops`, of the current CUDA device's bf16 matmul
rate. The trainer and tools/bench.py turn these into verl's perf metrics:

    perf/throughput = tokens of the step (prompt + response, all sequences, all ranks)
                      / step seconds / num devices                          [tokens/s/device]
    perf/mfu        = model FLOPs of the step / step seconds / (peak FLOP/s * num devices)

Model FLOPs count the math the model needs, not what the hardware ran: activation recomputation,
padding and the masked half of a dense causal score matrix are not counted, so a
recomputing or padding implementation reports a lower MFU, as it should.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

# Backward of a matmul Y = X W computes dX = dY W^T and dW = X^T dY: twice the forward FLOPs.
# The same holds for both attention matmuls (scores and values), so forward + backward is 3x.
FWD_BWD_FACTOR = 3


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def matmul_params(num_layers: int, hidden_size: int, intermediate_size: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, vocab_size: int) -> int:
    """Number of weights that take part in a matmul, N_matmul.

    Per layer: q and o are hidden x (num_heads * head_dim), k and v are hidden x
    (num_kv_heads * head_dim), gate, up and down are hidden x intermediate. Plus the LM head,
    hidden x vocab (counted also when tied to the embedding: the head is still a matmul, while
    the embedding is a lookup and costs no FLOPs). Norm weights and biases are excluded (O(hidden)
    FLOPs per token). For a critic pass vocab_size=1 (the value head).
    """
    _check_positive(num_layers=num_layers, hidden_size=hidden_size,
                    intermediate_size=intermediate_size, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    attention = hidden_size * head_dim * (2 * num_heads + 2 * num_kv_heads)  # q, o + k, v
    mlp = 3 * hidden_size * intermediate_size  # gate, up, down
    return num_layers * (attention + mlp) + hidden_size * vocab_size


def _check_seqlens(seqlens: Sequence[int]) -> None:
    for s in seqlens:
        if s < 0:
            raise ValueError(f"seqlens must be >= 0, got {s}")


def causal_attention_flops(num_layers: int, num_heads: int, head_dim: int,
                           seqlens: Sequence[int]) -> int:
    """Forward FLOPs of the two attention matmuls over packed causal sequences.

    For one sequence of length s and one layer, QK^T and PV each cost 2 * num_heads * head_dim
    * s^2 FLOPs when the full s x s score matrix is formed; causal masking keeps half of it:

        attention = sum_s 2 * 2 * num_layers * num_heads * head_dim * s^2 / 2

    Sequences are packed (cu_seqlens), so no token attends across a sequence boundary: the cost
    is a sum of s^2 per sequence, not (sum s)^2. GQA does not change it: every query head still
    scores against a key of head_dim. (s^2 / 2 rather than the exact s (s + 1) / 2 lower
    triangle, as in Megatron's and PaLM-style accounting; the difference is O(s).)
    """
    _check_positive(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim)
    _check_seqlens(seqlens)
    return 2 * num_layers * num_heads * head_dim * sum(s * s for s in seqlens)


def decoder_flops(num_layers: int, hidden_size: int, intermediate_size: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, vocab_size: int, seqlens: Sequence[int],
                  backward: bool = False) -> int:
    """Model FLOPs of a Llama/Qwen2-style decoder over packed sequences.

        forward  = 2 * N_matmul * T + causal_attention_flops(seqlens)
        backward = False: forward;   backward = True: 3 * forward

    with T = sum(seqlens) tokens and N_matmul from `matmul_params` (q, k, v, o, gate, up,
    down per layer, LM head; the embedding lookup is not a matmul). A matmul of an [T, a] input
    by an [a, b] weight is T * a * b multiply-adds, 2 FLOPs each; its backward is twice that
    (input and weight gradients), hence the 3x. Elementwise work (norms, RoPE, SwiGLU, softmax)
    is O(T * hidden) and left out, as in all standard MFU accounting.
    """
    num_params = matmul_params(num_layers, hidden_size, intermediate_size, num_heads,
                               num_kv_heads, head_dim, vocab_size)
    num_tokens = sum(seqlens)
    forward = 2 * num_params * num_tokens + causal_attention_flops(
        num_layers, num_heads, head_dim, seqlens)
    return FWD_BWD_FACTOR * forward if backward else forward


def decoder_flops_from_hf(config, seqlens: Sequence[int], backward: bool = False) -> int:
    """`decoder_flops` with the shapes read from a Hugging Face Llama/Qwen2 config object."""
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return decoder_flops(config.num_hidden_layers, config.hidden_size,
                         config.intermediate_size, num_heads, num_kv_heads, head_dim,
                         config.vocab_size, seqlens, backward)


def dense_flops_6n(num_params: int, num_tokens: int) -> int:
    """The 6 * N * T approximation of training FLOPs (Kaplan et al. 2020), attention left out.

    With N = matmul_params(...) it equals decoder_flops(..., backward=True) minus
    3 * causal_attention_flops(...). Quoting N as the total parameter count instead also charges
    the embedding table as if it were a matmul, which overstates small-model FLOPs.
    """
    _check_positive(num_params=num_params)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return 6 * num_params * num_tokens


def throughput(total_tokens: int, step_seconds: float, num_devices: int) -> float:
    """verl's perf/throughput: tokens of the step (prompt + response, every sequence of the
    step, summed over all ranks) per second per device."""
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    _check_positive(num_devices=num_devices)
    return total_tokens / step_seconds / num_devices


def mfu(flops: float, seconds: float, peak_flops_per_s: float, num_devices: int = 1) -> float:
    """Model FLOPs utilization: `flops` done by all `num_devices` together in `seconds`, over
    what they could do at `peak_flops_per_s` each. For a PPO step `flops` is the sum over the
    passes that ran (old/ref logprob forwards, critic values, actor/critic updates x epochs);
    generation is usually left out since decoding is bandwidth-bound, not FLOP-bound."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if peak_flops_per_s is None or peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s must be > 0, got {peak_flops_per_s}")
    _check_positive(num_devices=num_devices)
    return flops / seconds / (peak_flops_per_s * num_devices)


def peak_flops(device: torch.device | None = None, size: int = 8192, num_warmup: int = 3,
               num_iters: int = 20) -> float | None:
    """Measured bf16 dense matmul rate of a CUDA device in FLOP/s; None without CUDA.

    Times `num_iters` [size, size] x [size, size] bf16 matmuls with CUDA events after
    `num_warmup` untimed ones (cuBLAS heuristics, clocks ramping up). The result is what this
    device sustains on an ideal GEMM (about 80% of the datasheet number on an H100/H200), so
    MFU against it reads as "fraction of achievable". Measured once per device per process
    (~0.5 s, 3 * size^2 * 2 bytes of memory); callers report perf/mfu only when it is not None,
    since a CPU has no meaningful bf16 peak.
    """
    if not torch.cuda.is_available():
        return None
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    _check_positive(size=size, num_iters=num_iters)
    return _measure_matmul(index, size, num_warmup, num_iters)


@functools.cache
def _measure_matmul(index: int, size: int, num_warmup: int, num_iters: int) -> float:
    with torch.cuda.device(index):
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
        for _ in range(num_warmup):
            torch.mm(a, b, out=out)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(num_iters):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    return 2 * size ** 3 * num_iters / seconds
