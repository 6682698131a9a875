"""Gradient-accumulation fusion (Megatron's `gradient_accumulation_fusion`): a linear layer's
weight-gradient GEMM accumulates straight into the weight's fp32 `main_grad` (the optimizer's
bucket view, train.optimizer) with beta = 1, instead of writing a bf16 gradient that a hook then
adds into the bucket.

Why: per micro-batch and weight, the unfused path writes the bf16 gradient (2 bytes a
parameter), then reads it and the fp32 bucket and writes the bucket (10 bytes), one small add
kernel per weight (2,076 kernels, 27 ms of an H200's time per PPO seed update: bench/RESULTS.md
session 31). Fused, the GEMM's epilogue reads and writes the bucket (8 bytes), no kernel added,
and no bf16 gradient is allocated. The sum is also more exact: a micro-batch's gradient is
never rounded to bf16 before it is added.

How: `linear(x, weight, bias, fuse=True)` runs an autograd function whose backward computes the
input and bias gradients as F.linear's would and calls the op
`hybridengine::accumulate_wgrad(main_grad, grad_output, input)`, declared as mutating main_grad
(so torch.compile keeps it, in order, with no copy: the compiled layers call it in their
backward graph). Its kernel here is Python (the CPU's, and CUDA's until an engine that fuses
registers the C++ one, kernels/wgrad.py: 21 µs of host a call against 31.5). It returns no
weight gradient (the weight enters detached where it can), so the optimizer's hook adds nothing
for it. The GEMM: on CUDA, bf16/fp16 inputs into fp32 through
`aten::addmm.dtype_out` (cuBLAS with an fp32 C); where the inputs already have main_grad's
dtype (fp32 / fp64 weights, the CPU's tests) a plain in-place addmm; a CUDA torch whose
addmm.dtype_out refuses an fp32 C (or one capturing a graph before the probe ran) an fp32 product
added; bf16 on the CPU the product in the inputs' dtype added into main_grad, which is what the
unfused path computes. (`accumulate_mm`, which the fused log-prob's input gradient uses too.)

Used where the weight has `main_grad` (an optimizer owns it), requires grad, and grad mode is
on; forward-only passes and frozen (LoRA base) weights take F.linear.

Measured (H200, Qwen2.5-0.5B shapes, bench/RESULTS.md session 32): a layer's four weight-gradient
products at 8,192 tokens take 366 µs fused against 406 unfused; the PPO seed step's gain
(~10-20 ms) is below its run-to-run spread, so the switch is opt-in.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

# (device type, input dtype, main_grad dtype) -> does addmm.dtype_out accumulate in place here
_DTYPE_OUT_WORKS: dict[tuple, bool] = {}


def dtype_out_accumulates(device: torch.device, dtype: torch.dtype,
                          out_dtype: torch.dtype) -> bool:
    """Whether this torch's addmm.dtype_out takes a C of `out_dtype` with `dtype` inputs on
    `device` and accumulates into it in place (older CUDA builds require C in the inputs'
    dtype). Probed once, on 2x2 matrices, and never while a CUDA graph is being captured (the
    probe reads its result on the host): unprobed there, the unfused form is used."""
    key = (device.type, dtype, out_dtype)
    if key not in _DTYPE_OUT_WORKS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        try:
            c = torch.ones(2, 2, dtype=out_dtype, device=device)
            a = torch.ones(2, 2, dtype=dtype, device=device)
            torch.ops.aten.addmm.dtype_out(c, a, a, out_dtype, out=c)
            _DTYPE_OUT_WORKS[key] = bool((c == 3).all())
        except (RuntimeError, NotImplementedError):
            _DTYPE_OUT_WORKS[key] = False
    return _DTYPE_OUT_WORKS[key]


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc possibly wider than a and b (fp32 sums of bf16 products). On CUDA the
    GEMM itself emits acc's dtype: in place (addmm.dtype_out, beta = 1) where this torch takes it,
    else a product in acc's dtype then added; elsewhere the product in the inputs' dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and dtype_out_accumulates(acc.device, a.dtype, acc.dtype):
        torch.ops.aten.addmm.dtype_out(acc, a, b, acc.dtype, out=acc)
    elif acc.is_cuda:
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
    else:
        acc.add_(a @ b)


def _accumulate_wgrad(main_grad: torch.Tensor, grad_output: torch.Tensor,
                      x: torch.Tensor) -> None:
    """main_grad[out, in] += grad_output[..., out]^T · x[..., in], the sum over every token."""
    accumulate_mm(main_grad, grad_output.reshape(-1, grad_output.shape[-1]).t(),
                  x.reshape(-1, x.shape[-1]))


# Declared with torch.library's low-level API, not torch.library.custom_op: the op runs once per
# linear layer and micro-batch in the backward, and custom_op's Python layers (its autograd
# wrapper, argument defaults, pytrees) cost ~4x the host time of a plain kernel registration
_LIB = torch.library.Library("hybridengine", "FRAGMENT")
_LIB.define("accumulate_wgrad(Tensor(a!) main_grad, Tensor grad_output, Tensor x) -> ()")
_LIB.impl("accumulate_wgrad", _accumulate_wgrad, "CompositeExplicitAutograd")


@torch.library.register_fake("hybridengine::accumulate_wgrad", lib=_LIB)
def _(main_grad, grad_output, x) -> None:
    return None


accumulate_wgrad = torch.ops.hybridengine.accumulate_wgrad.default


class _LinearAccumulatingWgrad(torch.autograd.Function):
    """y = x·W^T + b; backward: dx and db as F.linear's, dW added into main_grad, none returned."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad):
        ctx.save_for_backward(x, weight)
        # not a saved tensor: every backward writes into the bucket main_grad views, so a saved
        # view would fail autograd's version check in the next one (its counter is the bucket's)
        ctx.main_grad = main_grad
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_x = grad_output @ weight if ctx.needs_input_grad[0] else None
        accumulate_wgrad(ctx.main_grad, grad_output, x)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fuse: bool = False) -> torch.Tensor:
    """F.linear; with `fuse`, where the weight trains into an optimizer's main_grad, its
    gradient is accumulated there by the backward's GEMM (module docstring)."""
    main_grad = getattr(weight, "main_grad", None) if fuse else None
    if main_grad is None or not (weight.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    # The weight enters detached where the input carries the autograd graph: its gradient is
    # main_grad's business alone, so autograd skips its AccumulateGrad node and the optimizer's
    # hook (host time per weight and micro-batch). Where nothing else would make the output
    # require grad, the weight does; its AccumulateGrad node then runs with no gradient.
    w = weight.detach() if x.requires_grad or (bias is not None and bias.requires_grad) \
        else weight
    return _LinearAccumulatingWgrad.apply(x, w, bias, main_grad)


def fuse_wgrad_accumulation(model: torch.nn.Module) -> int:
    """Turn the fusion on in every tensor-parallel linear layer of `model` (the layers with a
    `fuse_wgrad` switch: parallel.tensor) whose weight trains; call it once the optimizer has
    given the weights their main_grad. Returns the number of layers fused. (The training engine
    then probes the fused GEMM, outside any CUDA graph capture: kernels.wgrad.)"""
    fused = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "fuse_wgrad") and weight is not None and weight.requires_grad \
                and getattr(weight, "main_grad", None) is not None:
            module.fuse_wgrad = True
            fused += 1
    return fused
