"""torch.compile of the model runner's steps: which functions compile, with which options.

Compiled steps (compile / compile_prefill) compile a bounded set of graphs, all in the first
generate call, whatever the prompt lengths, batch sizes, sampler modes, max_tokens or slot
counts that follow (tests/test_compile_bound.py):

    decode forward          1   rows marked dynamic: every graph bucket; slot count dynamic
    random-stream hashing   1   dynamic=True (prefill and decode rows alike)
    commit                  1   dynamic=True
    prefill forward         1   per attention form: varlen, and dense when prefill_attention
                                is dense (the other form is compiled at the first prefill)

so at most MAX_COMPILED_GRAPHS; without CUDA graphs (enforce_eager) the decode forward adds one
at its second step, when its key bound max_k turns dynamic. What keeps the set bounded: no
duck sizing (compiling.compile_fn); no dimension of size 1 (decode buckets start at 2; a
one-prompt prefill gets a 1-token dummy prompt and row in the scratch slot); one form of every
input (a pad index even where no prompt is padded; sampler outputs are never views; a
prefill's slots sit at offset 0 of its index buffer, as the decode step's rows do). Those
rules live in rollout/model_runner.py, where the inputs are built.
"""
from __future__ import annotations

import torch

from hybridengine.compiling import compile_fn
from hybridengine.kernels.decode_attention import pdl_supported
from hybridengine.rollout.rollout_config import CompileMode, check_compile_mode
from hybridengine.rollout.sampling import uniforms

# graphs the compiled steps compile in a process (module docstring)
MAX_COMPILED_GRAPHS = 5


def inductor_options(device: torch.device, decode: bool, pdl: bool = True) -> dict:
    """Inductor options of the rollout's compiled steps: with pdl (RolloutKernelSettings.pdl),
    programmatic dependent launch where torch has it (2.11+) and the GPU supports it (Hopper
    and later): inductor's Triton kernels are launched so that each may be scheduled while the
    kernel before it drains, and wait on the device (griddepcontrol) before touching its
    output. Measured on an H200: decode 1.828 -> 1.771 ms/step (bench/RESULTS.md 2026-11-30
    session 7). The decode step's pointwise kernels take inductor's first launch setting
    instead of the fastest of those it times once at compile time: for the SwiGLU kernel that
    timing picked either of two, and in the captured step one took 15 and the other 19 ms per
    generate (23 under PDL; H200, bench/RESULTS.md 2026-11-30 session 8), so the rollout's
    speed changed from one process to the next."""
    from torch._inductor import config
    options = {"triton.autotune_pointwise": False} if decode else {}
    if pdl and hasattr(config.triton, "enable_pdl") and pdl_supported(device):
        options["triton.enable_pdl"] = True
    return options


def compile_decode_steps(decode_hidden, commit, mode: CompileMode, device: torch.device,
                         pdl: bool = True):
    """(decode forward, random-stream hashing, commit): the given functions (and
    sampling.uniforms), or unless mode is EAGER their torch.compile'd forms.

    Compiling fuses the decode step's small ops (norms, RoPE, SwiGLU); the batch dimension is
    marked dynamic, so one compile serves every graph bucket. The bookkeeping around the
    sampler (the random stream's integer hashing, result and state updates: ~45 tiny kernels
    per decode step) is compiled the same way; the torch sampler is not: its vocabulary-wide
    sort/cumsum gains nothing from fusion and trips Inductor on torch 2.11 (bench/RESULTS.md).
    MAX_AUTOTUNE: inductor benchmarks its GEMM templates against cuBLAS for the decode step's
    small-M matmuls, a benchmark variant: slower on an H200 (78.9k against 82.4k generated
    tok/s, 93 s of warm-up against 55 s). CPP_WRAPPER is a prefill mode: ValueError."""
    check_compile_mode("compile", mode, "decode")
    if mode is CompileMode.EAGER:
        return decode_hidden, uniforms, commit
    if mode is CompileMode.MAX_AUTOTUNE:
        how = {"mode": "max-autotune-no-cudagraphs"}
    else:               # INDUCTOR, AOT_EAGER: the member's value is the backend's name
        how = {"backend": mode.value}
        if mode is CompileMode.INDUCTOR:
            how["options"] = inductor_options(device, decode=True, pdl=pdl)
    return (compile_fn(decode_hidden, **how), compile_fn(uniforms, dynamic=True, **how),
            compile_fn(commit, dynamic=True, **how))


def compile_prefill_step(prefill_hidden, mode: CompileMode, device: torch.device,
                         pdl: bool = True):
    """The prefill forward, or unless mode is EAGER its torch.compile'd form (dynamic shapes:
    every prefill packs a different number of tokens and prompts; the runner falls back to
    eager, once, if compiling fails). CPP_WRAPPER: inductor launches the kernels from C++
    instead of Python (a benchmark variant; on an H200 it gained nothing measurable: prefill
    0.241 against 0.243 s, with 110 against 60 s of warm-up; bench/RESULTS.md 2026-11-30
    session 6, call 1). MAX_AUTOTUNE is a decode mode: ValueError."""
    check_compile_mode("compile_prefill", mode, "prefill")
    if mode is CompileMode.EAGER:
        return prefill_hidden
    if mode is CompileMode.AOT_EAGER:
        return compile_fn(prefill_hidden, backend=mode.value, dynamic=True)
    options = inductor_options(device, decode=False, pdl=pdl)
    if mode is CompileMode.CPP_WRAPPER:
        options = {"cpp_wrapper": True, **options}
    return compile_fn(prefill_hidden, backend=CompileMode.INDUCTOR.value, dynamic=True,
                      **({"options": options} if options else {}))
