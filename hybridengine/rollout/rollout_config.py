"""The rollout engine's settings: one frozen object instead of a dozen positional arguments.

    Engine(model, RolloutConfig(max_num_seqs=64, compile=CompileMode.INDUCTOR))

A benchmark or a test builds a variant with dataclasses.replace(config, ...), as it does for
the kernel settings (config.kernels). The checks that need no model run here, when the config
is built, so that a bad value fails where it was written rather than at the first generate;
the ones that need the model (max_model_len's default, max_prefill_tokens against it) stay in
the Engine. Torch-free (as kernels.settings), so it also holds the attention choice lists: the
torch-side resolvers (rollout.attention) import them from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hybridengine.kernels.settings import DEFAULT_KERNEL_SETTINGS, RolloutKernelSettings

# decode attention backends (rollout.attention.resolve_backend)
BACKENDS = ("auto", "triton", "flash", "flash_per_head", "sdpa")
# prefill attention forms (rollout.attention.resolve_prefill_attention)
PREFILL_ATTENTION = ("auto", "varlen", "dense")
# KV-cache layouts: a max_model_len row per sequence (kv_cache.py) or blocks (paged_cache.py)
KV_LAYOUTS = ("static", "paged")
# a run's rollout.kv_layout: one of those, or auto (the run picks: rl.memory.resolve_kv_layout)
RUN_KV_LAYOUTS = ("auto", *KV_LAYOUTS)
# decode backends that read the static layout's rows only (the paged layout refuses them)
STATIC_ONLY_BACKENDS = ("flash", "flash_per_head")
# tokens per block of the paged layout: vLLM's default, fine-grained sharing, a short table
DEFAULT_BLOCK_SIZE = 16


class CompileMode(Enum):
    """How a rollout step runs (rollout.compile_steps). Members, not strings: a misspelt mode
    used to reach torch.compile as a backend name and fail at the first generate, and a mode
    meant for the other step was silently taken as a backend name."""

    EAGER = "eager"                   # no torch.compile
    INDUCTOR = "inductor"             # torch.compile's inductor: the production setting
    # decode only: inductor's max-autotune-no-cudagraphs (a benchmark variant, slower on an H200)
    MAX_AUTOTUNE = "max-autotune"
    # prefill only: inductor's C++ kernel launcher (a benchmark variant, no gain on an H200)
    CPP_WRAPPER = "cpp-wrapper"
    # dynamo's graphs and guards without inductor's codegen: the compiled paths on the CPU (tests)
    AOT_EAGER = "aot_eager"


DECODE_COMPILE_MODES = tuple(m for m in CompileMode if m is not CompileMode.CPP_WRAPPER)
PREFILL_COMPILE_MODES = tuple(m for m in CompileMode if m is not CompileMode.MAX_AUTOTUNE)
_STEP_MODES = {"decode": DECODE_COMPILE_MODES, "prefill": PREFILL_COMPILE_MODES}


def check_compile_mode(name: str, mode, step: str) -> None:
    """ValueError unless `mode` is a CompileMode that the `step` ("decode" | "prefill") takes;
    `name` is the argument's name in the message."""
    allowed = _STEP_MODES[step]
    if mode not in allowed:        # (a plain Enum: True or a mode's string is no member)
        shown = mode if isinstance(mode, CompileMode) else f"{mode!r} (not a CompileMode)"
        raise ValueError(f"{name}={shown}: the {step} step takes one of "
                         f"{', '.join(str(m) for m in allowed)}")


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine's settings (module doc); a variant: dataclasses.replace.

    KV budget: kv_cache_tokens (a token count), else on CUDA gpu_memory_utilization (share of
    device memory for everything the process holds while generating), else max_num_seqs rows.
    """

    max_num_seqs: int = 256             # sequences decoded together (cache rows at most)
    max_model_len: int | None = None    # prompt + response tokens; None: the model's maximum
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    # tokens per prefill step; >= max_model_len, since a prompt is prefilled in one step
    max_prefill_tokens: int = 16384
    enforce_eager: bool = False         # no CUDA graphs for the decode step
    attn_backend: str = "auto"          # decode attention: one of BACKENDS
    # the decode step (and its sampler bookkeeping) through torch.compile before capture
    compile: CompileMode = CompileMode.EAGER
    # the prefill forward through torch.compile (dynamic shapes; eager again if it fails)
    compile_prefill: CompileMode = CompileMode.EAGER
    # prefill attention: one of PREFILL_ATTENTION; with dense, prompts enter longest first, so
    # that each prefill pads little
    prefill_attention: str = "auto"
    # the Triton kernels' tiles and launches, PDL and the fused forms (the defaults are the
    # fastest measured)
    kernels: RolloutKernelSettings = DEFAULT_KERNEL_SETTINGS
    # paged: blocks lent as sequences grow, prefix sharing, preemption (rollout/paged_runner.py);
    # its decode takes attn_backend triton (the paged kernel) or sdpa (auto: triton on CUDA;
    # flash reads the static rows: refused), every other setting as the static layout
    kv_layout: str = "static"
    block_size: int = DEFAULT_BLOCK_SIZE     # tokens per block (paged)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in "
                             f"(0, 1]")
        if self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend={self.attn_backend!r} is not one of "
                             f"{', '.join(BACKENDS)}")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention={self.prefill_attention!r} is not one of "
                             f"{', '.join(PREFILL_ATTENTION)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={self.kv_layout!r} is not one of {', '.join(KV_LAYOUTS)}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be an int >= 1")
        check_compile_mode("compile", self.compile, "decode")
        check_compile_mode("compile_prefill", self.compile_prefill, "prefill")
