"""Attention over the KV cache: the contexts the decoder calls as `attn_ctx.attend(layer, q, k, v)`.

PrefillContext: packed prompts (varlen). The new K/V are written to the cache rows of every
sequence that shares the prompt (n samples: one prefill, n rows), and attention runs causally
over the fresh packed K/V (no cached prefix exists), through the core PackedCausalAttention
(CUDA: flash varlen; CPU: per-sequence SDPA).

DecodeContext: one new token per row; K/V written at (slot, position), then attention over the
row's cached prefix, by one of four backends:
  triton split-KV flash-decoding over the cache (kernels/decode_attention.py): one program per
         (row, K/V head, split of the keys) computes the G query heads of that K/V head. Given
         the runner's per-slot position state (`slot_positions`), the context sets
         `applies_rope`: the decoder hands it q and k unrotated, and RoPE, the cache write and
         attention run in one kernel (`attend_rope`).
  flash  flash-attention varlen with seqused_k over the flat cache: cu_seqlens_k[i] =
         slot_i·max_model_len (rows sorted by slot, so increasing), seqused_k = length. It reads
         only the used tokens. The G = h_q/h_kv query heads that share a K/V head enter as G
         query rows of one sequence with h_kv heads (flash-attention's "seqlen_q/ngroups swap",
         non-causal: every row sees the whole prefix): one tile reads each K/V head once and
         computes G rows, where per-head decode reads it G times for one useful row of a
         64-row tile. Through torch.nn.attention.varlen.varlen_attn when it takes seqused_k
         (torch 2.13), else the aten flash op it wraps, whose schema has had seqused_k longer
         (torch 2.11).
  flash_per_head  the same kernel with one query row per sequence and GQA inside the kernel
         (the comparison point for `flash`).
  sdpa   the rows' cache gathered to [B, h_kv, L, d] and a length mask; q grouped as
         [B, h_kv, h_q/h_kv, d] so that no K/V head is repeated. The CPU path; a CUDA fallback.
A layer with an AttentionSpec (models.features: sliding window, logit soft-cap, query scale)
goes through the triton kernels under the triton backend (they take the three as arguments;
a window limits the keys each row reads), and through the sdpa form with a mask that also hides
keys older than the window (the soft-cap in torch) under the others, whose kernels apply
neither cap nor scale. The prefill's spec layers run PackedCausalAttention's spec path (flash varlen with a window on CUDA
when nothing is capped, else torch per sequence), never the dense form.
`auto` (on CUDA in fp16/bf16) takes the first of AUTO_ORDER that runs and agrees with SDPA on
the device (checked once; a mismatch or an error tries the next, with a warning), else sdpa.
Shapes are static given (rows, max_k), so a decode step can be captured in a CUDA graph.
Both contexts take the engine's kernel settings (kernels.settings.RolloutKernelSettings) and
pass them to the Triton launchers.
"""
from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

from hybridengine.kernels import decode_attention as triton_decode
from hybridengine.kernels.settings import DEFAULT_KERNEL_SETTINGS, RolloutKernelSettings
from hybridengine.models.attention import PackedCausalAttention, PackedInput
from hybridengine.models.features import AttentionSpec, masked_attention, window_mask
# the dense prefill form lives beside (its names stay importable from here)
from hybridengine.rollout.dense_prefill import padded_causal_attention, write_prefill_kv
from hybridengine.rollout.kv_cache import KVCache
# the choice lists live in the torch-free config module (RolloutConfig checks them there)
from hybridengine.rollout.rollout_config import BACKENDS, PREFILL_ATTENTION

logger = logging.getLogger(__name__)

_FLASH = ("flash", "flash_per_head")
_SEQUSED = ("triton",) + _FLASH          # backends that read the used prefix of each slot
# Measured on an H200 (bench/RESULTS.md, 2026-11-30): triton 3.1 ms per decode step against
# flash 3.5 ms at batch 256, ~640 cached tokens, Qwen2.5-0.5B shape.
AUTO_ORDER = ("triton", "flash", "flash_per_head")


def _find_flash_decode():
    """A callable (q, k, v, cu_q, cu_k, seqused_k, max_q, max_k) -> out (non-causal), or None
    on this torch."""
    try:
        from torch.nn.attention.varlen import varlen_attn
        params = inspect.signature(varlen_attn).parameters
        if "seqused_k" in params and "enable_gqa" in params:
            def public(q, k, v, cu_q, cu_k, seqused, max_q, max_k):
                return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=seqused,
                                   enable_gqa=True)
            return public
    except ImportError:
        pass
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or "seqused_k" not in [a.name for a in op.default._schema.arguments]:
        return None

    def aten(q, k, v, cu_q, cu_k, seqused, max_q, max_k):
        # dropout 0, not causal (a decode query sees its whole prefix); GQA is native
        return op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, seqused_k=seqused)[0]
    return aten


_FLASH_DECODE = _find_flash_decode()


def resolve_prefill_attention(requested: str, device: torch.device, dtype: torch.dtype,
                              heads: tuple[int, int, int] = (8, 2, 64)) -> str:
    """The prefill attention: varlen (flash varlen on CUDA, per-sequence SDPA on CPU) or dense
    (padded_causal_attention: cuDNN on CUDA). auto: dense on CUDA in fp16/bf16 when it runs
    and agrees with varlen on this device and head shape (checked once), else varlen."""
    if requested not in PREFILL_ATTENTION:
        raise ValueError(f"prefill_attention={requested!r} is not one of "
                         f"{', '.join(PREFILL_ATTENTION)}")
    if requested != "auto":
        return requested
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "varlen"
    return "dense" if _dense_prefill_agrees(device, dtype, heads) else "varlen"


def _dense_prefill_agrees(device, dtype, heads) -> bool:
    """Run the dense prefill once on padded prompts of the model's head shape and compare with
    varlen: a cuDNN that rejects the shape (or computes it differently) keeps varlen."""
    hq, hkv, d = heads
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        lens = [40, 64, 23]
        T, N = sum(lens), max(lens)
        q = torch.randn(T, hq, d, generator=g).to(device, dtype)
        k, v = (torch.randn(T, hkv, d, generator=g).to(device, dtype) for _ in range(2))
        packed = PackedInput.from_lengths(torch.zeros(T, dtype=torch.long, device=device), lens)
        ref = PackedCausalAttention(packed).attend(0, q, k, v).float()
        pad_index = torch.cat([i * N + torch.arange(n) for i, n in enumerate(lens)]).to(device)
        err = (padded_causal_attention(q, k, v, len(lens), N, pad_index).float() - ref)
        err = err.abs().max().item()
        if err < 2e-2:
            return True
        logger.warning("dense prefill attention differs from varlen by %.3g; prefill runs "
                       "varlen", err)
    except (RuntimeError, TypeError, ValueError) as e:
        logger.warning("dense prefill attention unavailable (%s); prefill runs varlen",
                       str(e).splitlines()[0] if str(e) else type(e).__name__)
    return False


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype,
                    heads: tuple[int, int, int] = (8, 2, 64),
                    settings: RolloutKernelSettings = DEFAULT_KERNEL_SETTINGS) -> str:
    """The decode backend for a model whose rank holds heads = (q heads, K/V heads, head_dim);
    `auto` checks the triton kernels with the engine's kernel settings."""
    if requested not in BACKENDS:
        raise ValueError(f"attn_backend={requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "triton":
        if not triton_decode.available(device):
            raise ValueError(f"attn_backend='triton' needs triton and CUDA (device={device})")
        if not triton_decode.supports(*heads):
            raise ValueError(f"attn_backend='triton' needs q heads divisible by K/V heads and "
                             f"a power-of-two head_dim >= 16 (q, kv heads, head_dim = {heads})")
        return requested
    half = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    usable = half and _FLASH_DECODE is not None
    if requested in _FLASH and not usable:
        raise ValueError(f"attn_backend={requested!r} needs CUDA, fp16/bf16 and a torch whose "
                         f"flash varlen kernel takes seqused_k (device={device}, dtype={dtype}, "
                         f"torch {torch.__version__})")
    if requested != "auto":
        return requested
    # auto: the first backend that runs and agrees with SDPA on this device, torch and shape
    for backend in AUTO_ORDER:
        runs = (half and triton_decode.available(device) and triton_decode.supports(*heads)
                if backend == "triton" else usable)
        if runs and _decode_agrees(device, dtype, backend, heads, settings):
            return backend
    return "sdpa"


class DecodeContext:
    """One query token per row. slots [B] int64 sorted (padding rows: the scratch slot last),
    positions [B] int64 = where this step's token goes; max_k: keys the sdpa backend reads
    (max_model_len under a CUDA graph); slot_positions [num_slots + 1]: the position state
    by slot (positions = slot_positions[slots]), for the fused triton form; settings: the
    triton kernels' tile and launch."""

    def __init__(self, cache: KVCache, layer_start: int, slots: torch.Tensor,
                 positions: torch.Tensor, backend: str, max_k: int,
                 cu_q: torch.Tensor | None = None, cu_k_tail: torch.Tensor | None = None,
                 slot_positions: torch.Tensor | None = None,
                 settings: RolloutKernelSettings | None = None):
        self.cache, self.layer_start, self.backend = cache, layer_start, backend
        self.slots, self.max_k = slots, max_k
        # the triton kernels' arguments (constants under torch.compile). No settings object as
        # a default argument: torch 2.11's dynamo builds this class inside the compiled decode
        # step through a polyfill that cannot wrap a default value of a user class, and broke
        # the graph there (one graph more than compile_steps documents; H200, session 12)
        s = DEFAULT_KERNEL_SETTINGS if settings is None else settings
        self.launch = dict(block_n=s.decode_block_n, num_warps=s.decode_num_warps,
                           num_stages=s.decode_num_stages)
        self.rope_launch = dict(self.launch, pdl=s.pdl, prefetch_keys=s.decode_prefetch_keys)
        # the fused triton form reads the runner's per-slot position state itself and derives
        # the write position and length in the kernel: nothing below is needed for it
        self.slot_positions = slot_positions
        self.positions = positions              # the spec layers' path (_attend_spec)
        self._spec_masks: dict[int | None, torch.Tensor] = {}
        self.applies_rope = backend == "triton" and slot_positions is not None
        if self.applies_rope:
            return
        L = cache.max_model_len
        # A finished row still in the batch (one step of lag) may sit at position L: clamp its
        # harmless write into its own row.
        self.write_pos = positions.clamp(max=L - 1)                           # [B]
        seqlens = (positions + 1).clamp(max=L)                                 # [B]
        if backend in _SEQUSED:
            self.seqused = seqlens.to(torch.int32)
            if backend in _FLASH:        # the varlen call's sequence bounds (triton takes slots)
                self.cu_q = cu_q                                               # [B + 1]: 0..B
                self.cu_k = torch.cat([slots * L, cu_k_tail]).to(torch.int32) # [B + 1]
        else:
            cols = torch.arange(max_k, device=slots.device)
            self.mask = (cols < seqlens.unsqueeze(1))[:, None, None, :]      # [B, 1, 1, max_k]

    def attend(self, layer_idx: int, q, k, v, spec: AttentionSpec | None = None) -> torch.Tensor:
        """q [B, h_q, d], k/v [B, h_kv, d] -> [B, h_q, d]."""
        layer = layer_idx - self.layer_start
        if spec is not None and self.backend != "triton":
            return self._attend_spec(layer, q, k, v, spec)
        self.cache.write(layer, self.slots, self.write_pos, k, v)
        if self.backend == "triton":
            return triton_decode.decode_attention(q, self.cache.k[layer], self.cache.v[layer],
                                                  self.slots, self.seqused, **self.launch,
                                                  **_spec_args(spec))
        if self.backend in _FLASH:
            kf, vf = self.cache.flat(layer)
            L = self.cache.max_model_len
            group = q.shape[1] // k.shape[1]
            if self.backend == "flash_per_head" or group == 1:
                return _FLASH_DECODE(q, kf, vf, self.cu_q, self.cu_k, self.seqused, 1, L)
            return grouped_flash_decode(q, kf, vf, self.cu_q, self.cu_k, self.seqused, L)
        kc, vc = self.cache.gather_slots(layer, self.slots, self.max_k)     # [B, h_kv, L, d]
        return grouped_sdpa(q, kc, vc, self.mask)

    def _attend_spec(self, layer: int, q, k, v, spec: AttentionSpec) -> torch.Tensor:
        """The cache write, then masked torch attention over the rows' first max_k keys: key j
        visible to the row at position p when p - window < j <= p (the same clamp as sdpa's)."""
        pos = self.positions.clamp(max=self.cache.max_model_len - 1)             # [B]
        self.cache.write(layer, self.slots, pos, k, v)
        kc, vc = self.cache.gather_slots(layer, self.slots, self.max_k)        # [B, h_kv, L, d]
        mask = self._spec_masks.get(spec.window)
        if mask is None:
            cols = torch.arange(self.max_k, device=pos.device)
            mask = window_mask(pos[:, None], cols[None, :], spec.window)[:, None, None, :]
            self._spec_masks[spec.window] = mask                             # [B, 1, 1, L]
        return masked_attention(q.unsqueeze(2), kc, vc, mask, spec).squeeze(2)

    def attend_rope(self, layer_idx: int, q, k, v, cos, sin,
                    spec: AttentionSpec | None = None) -> torch.Tensor:
        """attend() from the unrotated q, k (fp32 RoPE tables cos, signed sin [B, d]), in one
        kernel (triton backend with slot_positions)."""
        layer = layer_idx - self.layer_start
        return triton_decode.decode_attention_rope(q, k, v, cos, sin, self.cache.k[layer],
                                                   self.cache.v[layer], self.slots,
                                                   self.slot_positions, **self.rope_launch,
                                                   **_spec_args(spec))


def _spec_args(spec: AttentionSpec | None) -> dict:
    """An AttentionSpec as the triton decode kernels' arguments (0: the default / none)."""
    if spec is None:
        return {}
    return {"scale": spec.scale or 0.0, "softcap": spec.softcap or 0.0,
            "window": spec.window or 0}


def grouped_flash_decode(q, kf, vf, cu_q, cu_k, seqused, max_k) -> torch.Tensor:
    """q [B, h_q, d] -> [B, h_q, d]: row b's query heads j·G … j·G+G−1 (those of K/V head j)
    become query rows b·G … b·G+G−1, head j, of a varlen call with h_kv heads on both sides;
    cu_q (0..B) scales by G."""
    B, hq, d = q.shape
    hkv = kf.shape[1]
    group = hq // hkv
    rows = q.view(B, hkv, group, d).transpose(1, 2).reshape(B * group, hkv, d)
    out = _FLASH_DECODE(rows, kf, vf, cu_q * group, cu_k, seqused, group, max_k)
    return out.view(B, group, hkv, d).transpose(1, 2).reshape(B, hq, d)


def grouped_sdpa(q, k, v, mask) -> torch.Tensor:
    """q [B, h_q, d] against k/v [B, h_kv, L, d] under mask [B, 1, 1, L]; query head h uses KV
    head h // (h_q / h_kv), as Hugging Face's repeat_kv."""
    B, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(B, hkv, hq // hkv, d)                                  # [B, h_kv, G, d]
    o = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
    return o.reshape(B, hq, d)


class PrefillContext:
    """Packed prompts: write K/V of packed token src[i] to cache (dst_slot[i], dst_pos[i])
    (every row of every sample of the prompt), attend causally within each prompt: through the
    varlen kernel, or with dense = (prompts, max_len, pad_index) through a dense kernel over
    the right-padded prompts (padded_causal_attention); settings.triton_kv_write: the dense
    form's cache write in Triton where it runs."""

    def __init__(self, cache: KVCache | None, layer_start: int, packed: PackedInput,
                 src=None, dst_slot=None, dst_pos=None, dense: tuple | None = None,
                 settings: RolloutKernelSettings = DEFAULT_KERNEL_SETTINGS):
        self.cache, self.layer_start = cache, layer_start
        self.src, self.dst_slot, self.dst_pos = src, dst_slot, dst_pos
        self.inner = PackedCausalAttention(packed)
        self.dense = dense
        self.triton_kv_write = settings.triton_kv_write

    def attend(self, layer_idx: int, q, k, v, spec: AttentionSpec | None = None) -> torch.Tensor:
        if self.cache is not None:          # None: a memory-profiling run
            layer = layer_idx - self.layer_start
            if self.dense is not None:
                write_prefill_kv(self.cache.k[layer], self.cache.v[layer], self.dst_slot,
                                 self.dst_pos, k, v, self.src, self.triton_kv_write)
            else:
                self.cache.write(layer, self.dst_slot, self.dst_pos,
                                 k.index_select(0, self.src), v.index_select(0, self.src))
        if spec is not None:
            return self.inner.attend(layer_idx, q, k, v, spec)
        if self.dense is not None:
            return padded_causal_attention(q, k, v, *self.dense)
        return self.inner.attend(layer_idx, q, k, v)


def decoder_qkv(qkv: torch.Tensor, hq: int, hkv: int, d: int):
    """q [T, h_q, d], k, v [T, h_kv, d] as the decoder's Attention hands them to a context:
    views of the fused projection qkv [T, (h_q + 2 h_kv)·d] (at T = 1 torch gives k's and v's
    size-1 first dimension different strides; the agreement checks use this very pattern)."""
    qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
    qk, v = qk.view(-1, hq + hkv, d), v.view(-1, hkv, d)
    return qk[:, :hq], qk[:, hq:], v


def _decode_agrees(device: torch.device, dtype: torch.dtype, backend: str,
                   heads: tuple[int, int, int] = (8, 2, 64),
                   settings: RolloutKernelSettings = DEFAULT_KERNEL_SETTINGS) -> bool:
    """Run a decode backend once on a small cache of the model's head shape, at batch 3 (one
    padding row) and batch 1, on q/k/v laid out as the decoder hands them over, and compare
    with grouped SDPA: a torch or triton that rejects the argument pattern (or computes it
    differently) falls back here, before the first step, not in the middle of a rollout."""
    hq, hkv, d = heads
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        cache = KVCache(1, 4, 64, hkv, d, dtype, device)
        for t in cache.k + cache.v:
            t.copy_(torch.randn(t.shape, generator=g).to(device, dtype))
        all_slots = torch.tensor([0, 2, cache.scratch_slot], device=device)
        all_pos = torch.tensor([37, 5, 0], device=device)
        tail = torch.tensor([(cache.num_slots + 1) * 64], device=device)
        err = 0.0
        for rows in ([0, 1, 2], [1]):
            B = len(rows)
            slots, pos = all_slots[rows], all_pos[rows]
            qkv = torch.randn(B, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
            q, k_new, v_new = decoder_qkv(qkv, hq, hkv, d)
            cu_q = torch.arange(B + 1, dtype=torch.int32, device=device)
            outs = {}
            for name in (backend, "sdpa"):
                ctx = DecodeContext(cache, 0, slots, pos, name, 64, cu_q, tail,
                                    settings=settings)
                outs[name] = ctx.attend(0, q, k_new, v_new).float()
            if backend == "triton":     # the fused form too, with an identity rotation
                cos = torch.ones(B, d, device=device)
                by_slot = torch.zeros(cache.num_slots + 1, dtype=torch.long, device=device)
                by_slot[slots] = pos
                ctx = DecodeContext(cache, 0, slots, pos, backend, 64, cu_q, tail, by_slot,
                                    settings)
                outs["rope"] = ctx.attend_rope(0, q, k_new, v_new, cos, 0 * cos).float()
            err = max(err, max((outs[b] - outs["sdpa"]).abs().max().item() for b in outs))
        if err < 2e-2:
            return True
        logger.warning("%s decode attention differs from SDPA by %.3g; trying the next "
                       "backend", backend, err)
    except (RuntimeError, TypeError, ValueError) as e:
        logger.warning("%s decode attention unavailable (%s); trying the next backend",
                       backend, str(e).splitlines()[0])
    return False
