"""The rollout's kernel settings: one frozen object instead of module switches.

    Engine(model, RolloutConfig(kernels=RolloutKernelSettings(pdl=False)))

The Engine hands it to its ModelRunner, which hands it to the attention contexts, the sampler
and the compile options; the Triton launchers take the values as explicit arguments whose
defaults are this class's defaults. So two engines in one process can run different settings,
and a benchmark builds a variant with dataclasses.replace(settings, ...) instead of patching
a module. The defaults are the fastest measured settings (H200, bench/RESULTS.md); every other
value is a benchmark variant that computes the same results. Torch-free: importable anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclass(frozen=True)
class RolloutKernelSettings:
    """The rollout engine's kernel settings (module doc); a variant: dataclasses.replace."""

    # programmatic dependent launch on Hopper+ (the fused decode attention, and inductor's
    # kernels in the compiled steps): a kernel starts while the one before it drains; decode
    # 1.828 -> 1.771 ms/step on an H200 (bench/RESULTS.md 2026-11-30 session 7)
    pdl: bool = True
    # cached keys per program (K and V each; 0 or a power of two) that the fused decode
    # attention asks into L2 before its PDL wait (bench/RESULTS.md 2026-11-30 session 8)
    decode_prefetch_keys: int = 128
    # The decode attention's tile and launch. Measured on an H200 (bench/RESULTS.md, 2026-11-30
    # sessions 4 to 6; bench/probes/decode_step.py): at batch 256, 640 cached tokens, h_kv 2,
    # d 64, the fused form with one split, 4 warps and 3 stages took 25.0 µs per layer (CUDA
    # graph), 2 warps 25.7 µs, 2 splits >= 29 µs; in session 6 the fastest of 14 settings.
    decode_block_n: int = 64            # keys per tile (a power of two >= 16, for tl.dot)
    decode_num_warps: int = 4           # warps per decode-attention program
    decode_num_stages: int = 3          # software-pipeline stages of its key loop
    # the dense prefill's K/V cache write in one Triton launch per layer (kernels/kv_write.py)
    # instead of torch's indexing: 10 ms less per generate on an H200 (session 6)
    triton_kv_write: bool = True
    # RoPE and the cache write inside the Triton decode attention (decode_attention_rope)
    # instead of two kernels of their own before it: 1.5 + 1.4 µs per layer on an H200
    # (bench/RESULTS.md; the benchmark's separate_rope variant)
    fused_rope: bool = True
    # temperature sampling through the fused Triton sampler (kernels/sampler.py) where it runs,
    # instead of the torch sampler's ~6 passes over the logits (session 4)
    fused_sampler: bool = True
    # blocks of 128 tokens per program of the fused sampler's first pass (a power of two;
    # 16: 2048 tokens)
    sampler_chunk_blocks: int = 16
    # warps per first-pass program: 30.8 against 33.7 µs with 4 for both passes at 256 x 151936
    # bf16 logits on an H200 (bench/probes/gemm_forms.py, session 7)
    sampler_chunk_warps: int = 2

    def __post_init__(self):
        bad = []
        if not _power_of_two(self.decode_block_n) or self.decode_block_n < 16:
            bad.append(f"decode_block_n={self.decode_block_n} (a power of two >= 16)")
        if self.decode_prefetch_keys != 0 and not _power_of_two(self.decode_prefetch_keys):
            bad.append(f"decode_prefetch_keys={self.decode_prefetch_keys} (0 or a power of two)")
        for name in ("decode_num_warps", "sampler_chunk_warps", "sampler_chunk_blocks"):
            if not _power_of_two(getattr(self, name)):
                bad.append(f"{name}={getattr(self, name)} (a power of two)")
        if self.decode_num_stages < 1:
            bad.append(f"decode_num_stages={self.decode_num_stages} (>= 1)")
        if bad:
            raise ValueError(f"RolloutKernelSettings: {'; '.join(bad)}")


DEFAULT_KERNEL_SETTINGS = RolloutKernelSettings()
