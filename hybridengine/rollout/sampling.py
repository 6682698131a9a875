"""Sampling parameters and the batched GPU sampler (temperature, top-k, top-p, greedy).

The processed distribution follows Hugging Face's warper order: logits / temperature, then top-k
(keep values >= the k-th largest), then top-p (keep the smallest set of most likely tokens whose
mass reaches top_p, always at least one), renormalised. Per sampled token the sampler returns
two log-probabilities:

    logprobs          log softmax(logits)[token]              (temperature 1, unmodified logits)
    sampled_logprobs  log of the processed distribution at the token (0.0 for greedy)

Randomness is counter-based: the uniform that draws the token at position p of sequence i is a
32-bit integer hash of (key_i, p), key_i = hash(seed, i), turned into a sample by inverse-CDF
search (`inverse_cdf`: a search over block sums, then inside one block). So a sample depends
only on (seed, sequence index, position) and the logits: never on batch composition, slot,
schedule or tensor-parallel rank; the same code runs inside a CUDA graph (no generator state);
every rank of a generation-TP group, which sees the same gathered logits, draws the same token
without communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hybridengine.kernels import sampler as fused_sampler
from hybridengine.kernels.settings import DEFAULT_KERNEL_SETTINGS, RolloutKernelSettings

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B     # < 2^27: (x < 2^32) * _MUL stays below 2^63, so int64 never overflows
MAX_STOP_TOKENS = 16


@dataclass(frozen=True)
class SamplingParams:
    """n samples per prompt; temperature 0 means greedy; top_k <= 0 and top_p = 1 mean off.
    stop_token_ids end a sequence (the stop token is part of the response); ignore_eos=True
    disables them so that every sequence generates max_tokens (benchmarks)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens} must be >= 1")
        if len(self.stop_token_ids) > MAX_STOP_TOKENS:
            raise ValueError(f"SamplingParams.stop_token_ids has {len(self.stop_token_ids)} ids; "
                             f"at most {MAX_STOP_TOKENS} are supported")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def mode(self, vocab_size: int) -> "SamplerMode":
        """The static part of the sampler (a CUDA graph is captured per mode)."""
        if self.greedy:
            return SamplerMode(True, 0, False, False)
        top_k = min(self.top_k, vocab_size) if self.top_k > 0 else 0
        if top_k == vocab_size:
            top_k = 0
        return SamplerMode(False, top_k, self.top_p < 1.0, self.temperature != 1.0)

    def stop_ids(self) -> tuple[int, ...]:
        return () if self.ignore_eos else self.stop_token_ids


class SamplerMode(NamedTuple):
    greedy: bool
    top_k: int            # 0: off
    top_p: bool           # top_p < 1
    scaled: bool          # temperature != 1


# --- counter-based randomness ------------------------------------------------------------------

def mix32(x):
    """A 32-bit integer finaliser (two multiply-xorshift rounds) on Python ints or int64 tensors
    holding values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def sequence_key(seed: int, seq_index: int) -> int:
    """The per-sequence random key in [0, 2^32) (host side, once per sequence)."""
    s = (seed ^ (seed >> 32)) & _M32
    return mix32(mix32(s) ^ mix32((seq_index * 0x9E3779B1 + 0x7F4A7C15) & _M32))


def uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """keys, positions [B] int64 -> u [B] float32 in (0, 1), a function of (key, position) only."""
    h = mix32(keys ^ mix32(positions & _M32))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


# --- the sampler -------------------------------------------------------------------------------

CDF_BLOCK = fused_sampler.CDF_BLOCK       # tokens per block (the fused kernel's, same draw)


def inverse_cdf(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """q [B, V] non-negative weights (each row's sum > 0), u [B] in (0, 1) -> [B, 1] int64: the
    first index whose cumulative weight reaches u·sum(q), never an index of weight 0.

    In two levels: the cumulative sum of block sums, a search there, then a cumulative sum and a
    search inside the one chosen block. A plain cumsum over [B, V] is a scan that writes a second
    [B, V] fp32 tensor; at vocab 151936 and batch 256 it was the slowest pass of the decode
    step's sampler on an H200 (0.3 ms of ~4 ms); block sums are a plain reduction."""
    B, V = q.shape
    pad = (-V) % CDF_BLOCK
    blocks = torch.nn.functional.pad(q, (0, pad)) if pad else q
    blocks = blocks.view(B, -1, CDF_BLOCK)                                   # [B, nb, blk]
    block_cdf = blocks.sum(-1).cumsum(-1)                                     # [B, nb]
    target = u.unsqueeze(1).to(block_cdf.dtype) * block_cdf[:, -1:]          # [B, 1]
    b = torch.searchsorted(block_cdf, target).clamp_(max=block_cdf.shape[1] - 1)
    before = block_cdf.gather(1, (b - 1).clamp(min=0)).masked_fill(b == 0, 0.0)
    inner = blocks.gather(1, b.unsqueeze(2).expand(B, 1, CDF_BLOCK)).squeeze(1).cumsum(-1)
    j = torch.searchsorted(inner, target - before)
    # Rounding can put the remainder past the block's own total: take the block's last token
    # of positive weight then (the first index at which the block's cumsum reaches its total).
    last = (inner < inner[:, -1:]).sum(-1, keepdim=True)
    return b * CDF_BLOCK + torch.minimum(j, last)

def _cut_top_p(desc: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """desc [B, K] logits sorted descending -> [B, 1] the smallest kept value: a token is kept
    when the mass of the strictly more likely tokens is below top_p (so at least one)."""
    probs = torch.softmax(desc, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    keep = mass_before < top_p
    return desc.masked_fill(~keep, float("inf")).amin(-1, keepdim=True)


def _filter(z: torch.Tensor, mode: SamplerMode, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k / top-p remove. z [B, V] fp32."""
    if mode.top_k:
        desc = torch.topk(z, mode.top_k, dim=-1).values                   # [B, k]
        cut = _cut_top_p(desc, top_p) if mode.top_p else desc[:, -1:]
    elif mode.top_p:
        cut = _cut_top_p(torch.sort(z, dim=-1, descending=True).values, top_p)
    else:
        return z
    return z.masked_fill(z < cut, float("-inf"))


def sample(logits: torch.Tensor, mode: SamplerMode, temperature: torch.Tensor,
           top_p: torch.Tensor, u: torch.Tensor,
           settings: RolloutKernelSettings = DEFAULT_KERNEL_SETTINGS):
    """logits [B, V] (any float dtype); temperature, top_p [1] device tensors (graph-safe);
    u [B] uniforms. Returns (tokens [B] int64, logprobs [B] fp32, sampled_logprobs [B] fp32).
    Static shapes and no host synchronisation.

    Temperature sampling without top-k / top-p (RL's usual setting) takes the fused Triton
    kernels where they run (kernels/sampler.py: two passes, the same draw) unless
    settings.fused_sampler is off; everything else sample_torch."""
    if settings.fused_sampler and not (mode.greedy or mode.top_k or mode.top_p) and \
            fused_sampler.available(logits.device):
        return fused_sampler.sample_temperature(logits, temperature, u, scaled=mode.scaled,
                                                chunk_blocks=settings.sampler_chunk_blocks,
                                                chunk_warps=settings.sampler_chunk_warps)
    return sample_torch(logits, mode, temperature, top_p, u)


def sample_torch(logits: torch.Tensor, mode: SamplerMode, temperature: torch.Tensor,
                 top_p: torch.Tensor, u: torch.Tensor):
    """sample() in plain torch ops: every mode, any device. Few passes over [B, V] (the decode
    step's largest tensors at vocab 151936): softmax reads the logits in their own dtype and
    writes fp32 probabilities once; log-probs are logs of gathered probabilities (fp32 relative
    error ~1e-7, so ~1e-7 absolute in the log)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)             # [B, V], T = 1
    if mode.greedy:
        tok = logits.argmax(-1)
        logprob = probs.gather(1, tok.unsqueeze(1)).squeeze(1).log()
        return tok, logprob, torch.zeros_like(logprob)
    processed = mode.scaled or mode.top_k or mode.top_p
    q = probs
    if processed:
        z = logits.float()
        z = _filter(z / temperature if mode.scaled else z, mode, top_p)
        q = torch.softmax(z, dim=-1)                                        # removed -> 0
    tok = inverse_cdf(q, u)                                                 # [B, 1]
    logprob = probs.gather(1, tok).squeeze(1).log()
    sampled = q.gather(1, tok).squeeze(1).log() if processed else logprob.clone()
    # a copy, not a view: every mode returns fresh tensors (under torch.compile a view input
    # guards on its base, so a view here and argmax's fresh tensor compiled twice)
    return torch.squeeze_copy(tok, 1), logprob, sampled
