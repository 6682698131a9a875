"""Fused LM head + vocab-parallel log-prob and entropy: the [T, V] logits never exist in full.

    fused_linear_logprob_entropy(hidden, weight, targets, tp_group, vocab_size, temperature,
                                 sequence_parallel, chunk_cols=None, impl=None)
        -> (logprob [T], entropy [T]), fp32 (fp64 for fp64 inputs), identical on all TP ranks

The result (values and gradients) is parallel/vocab.py's on the logits hidden·weight^T: z =
logits / temperature over this rank's slice of the padded vocabulary, pad columns (global id >=
vocab_size) excluded. Targets outside [0, vocab_size) are owned by no column (logp = −log Z).

The slice is cut into chunks of columns (not of tokens). Each chunk is one GEMM
[T, H]·[H, cols] into a reused buffer, then one pass over it that merges per-row statistics, the
same way the ranks merge them over TP afterwards:

    m = max z,   s = Σ e^(z−m),   d = Σ e^(z−m)·(z−m),   zt = z[target]
    log Z = m + log s,   H = log s − d/s,   logp = zt − log Z

(d relative to the max keeps the kernels' H free of the cancellation in log Z − E[z] at large
logits). Logits are the GEMM's output dtype (bf16 for bf16 weights, as in the unfused path);
statistics and math are fp32 (fp64 for fp64 inputs). The forward saves log Z and H ([T] each) besides its inputs. The backward recomputes each chunk, turns
it in place into dL/dlogits, then grad_weight[chunk] = G^T·x, one GEMM over all tokens written
into its rows (no fp32 [V, H] accumulator, as token chunks would need), and grad_x += G·W[chunk]
into an fp32 [T, H] accumulator. A final soft-cap (Gemma 2) caps each chunk in place after its
GEMM; the backward keeps the chunk's tanh (one more chunk buffer) for the cap's derivative.
Cost: 4 GEMMs of 2·T·H·V/tp FLOPs (one is the recompute), one read of each logits chunk forward
and one read-write backward, against 3 GEMMs and ~10 fp32 passes over stored [T, V/tp] logits
in the unfused path.

The two per-chunk ops have two implementations, picked by `impl`:
    "cuda"   csrc/logprob_kernels.cu, JIT-built on first use (fp32 / fp16 / bf16 logits on CUDA)
    "torch"  parallel/vocab.py's block functions applied to each chunk as if it were a whole
             vocabulary (any device, any float dtype)
impl=None takes "cuda" when it applies and builds, else "torch" (a failed build logs one line).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from hybridengine.parallel.tensor import all_reduce, copy_to_tp, gather_from_sp, group_rank, \
    group_size
from hybridengine.parallel.vocab import _chunk_backward, _chunk_forward
from hybridengine.parallel.wgrad_accumulation import accumulate_mm

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "csrc")
# Default chunk: at most this many logits (512 MiB in bf16): e.g. 16k tokens x 15k columns.
MAX_CHUNK_ELEMENTS = 1 << 28
# The running max of a row before any column: finite, so that 0·(m − M) stays 0 (see the .cu).
EMPTY_MAX = -1e30
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- statistics ---------------------------------------------------------------------------------

def _rebase(m, s, d, ref):
    """(s, d) of statistics with max m re-expressed relative to a larger max `ref`."""
    r = torch.exp(m - ref)
    return s * r, (d + s * (m - ref)) * r


def _merge_(state, m_c, s_c, d_c):
    """Merge one chunk's statistics into the running (m, s, d, zt), in place."""
    m, s, d, _ = state
    ref = torch.maximum(m, m_c)
    s1, d1 = _rebase(m, s, d, ref)
    s2, d2 = _rebase(m_c, s_c, d_c, ref)
    s.copy_(s1 + s2)
    d.copy_(d1 + d2)
    m.copy_(ref)


def _finish(state, group):
    """Merge the ranks' statistics: (logprob, entropy, log Z), identical on every TP rank."""
    m, s, d, zt = state
    ref = all_reduce(m.clone(), group, dist.ReduceOp.MAX)
    s, d = _rebase(m, s, d, ref)
    s, d, zt = all_reduce(torch.stack([s, d, zt]), group).unbind()   # one all-reduce for three
    log_s = torch.log(s)
    log_z = ref + log_s
    return zt - log_z, log_s - d / s, log_z


# --- the two per-chunk ops ----------------------------------------------------------------------

class TorchChunkOps:
    """The chunk ops in torch: vocab.py's block functions, on the chunk as a whole vocabulary of
    n_valid real columns (group None, target ids shifted by the chunk's first column)."""

    @staticmethod
    def stats_update(logits, targets, col_offset, n_valid, temperature, state):
        local = targets - col_offset
        _, ent_c, log_z_c, _ = _chunk_forward(logits, local, None, n_valid, temperature)
        m = state[0]
        # Relative to its own log-sum-exp a chunk has s = 1 and d = E[z] − log Z = −H.
        _merge_(state, log_z_c.to(m.dtype), torch.ones_like(m), -ent_c.to(m.dtype))
        own = (local >= 0) & (local < n_valid)
        z_t = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        state[3].add_(torch.where(own, z_t.to(m.dtype) / temperature, 0.0))

    @staticmethod
    def grad(logits, targets, col_offset, n_valid, temperature, log_z, entropy, g_logp, g_ent):
        return _chunk_backward(logits, targets - col_offset, log_z, log_z - entropy, g_logp, g_ent,
                               None, n_valid, temperature)


class CudaChunkOps:
    """The chunk ops as the kernels of csrc/logprob_kernels.cu (the gradient is in place)."""

    def __init__(self, ext):
        self.ext = ext

    def stats_update(self, logits, targets, col_offset, n_valid, temperature, state):
        self.ext.stats_update(logits, targets, col_offset, n_valid, 1.0 / temperature, *state)

    def grad(self, logits, targets, col_offset, n_valid, temperature, log_z, entropy, g_logp,
             g_ent):
        self.ext.grad_inplace(logits, targets, col_offset, n_valid, 1.0 / temperature, log_z,
                              entropy, g_logp, g_ent)
        return logits


_EXTENSION = None      # the built module; False once a build failed


def _build_extension():
    from torch.utils.cpp_extension import load
    major, minor = torch.cuda.get_device_capability()
    # Hopper gets the arch-specific target (sm_90a); other GPUs their own arch.
    cc = "90a" if major == 9 else f"{major}{minor}"
    arch = f"compute_{cc},code=sm_{cc}"
    return load(name="hybridengine_logprob",
                sources=[os.path.join(CSRC, "logprob_bindings.cpp"),
                         os.path.join(CSRC, "logprob_kernels.cu")],
                extra_cflags=["-O3"], extra_cuda_cflags=["-O3", f"-gencode=arch={arch}"],
                verbose=os.environ.get("HYBRIDENGINE_VERBOSE_BUILD") == "1")


def cuda_extension():
    """The JIT-built kernels (cached by torch under TORCH_EXTENSIONS_DIR or ~/.cache), or None
    when CUDA is absent, HYBRIDENGINE_NO_CUDA_KERNELS=1, or the build failed (logged once)."""
    global _EXTENSION
    if _EXTENSION is None:
        if not torch.cuda.is_available() or os.environ.get("HYBRIDENGINE_NO_CUDA_KERNELS") == "1":
            return None
        try:
            _EXTENSION = _build_extension()
        except Exception as e:     # any build failure: one line, then the torch path
            msg = str(e).strip().splitlines()
            logger.warning("hybridengine: CUDA log-prob kernels unavailable, using torch "
                           "(%s: %s)", type(e).__name__, msg[-1] if msg else "")
            _EXTENSION = False
    return _EXTENSION or None


def _chunk_ops(x, impl):
    if impl == "torch":
        return TorchChunkOps()
    fits = x.is_cuda and x.dtype in CUDA_DTYPES
    ext = cuda_extension() if fits else None
    if ext is not None:
        return CudaChunkOps(ext)
    if impl == "cuda":
        raise RuntimeError("impl='cuda' needs CUDA tensors of dtype float32/float16/bfloat16 and "
                           "the built kernels (see the log for why they did not build)")
    return TorchChunkOps()


# --- the autograd function ----------------------------------------------------------------------

def _chunks(v_local, v_offset, vocab_size, num_tokens, chunk_cols):
    """[(start, stop, n_valid)] column chunks of this rank's slice; n_valid excludes padding."""
    if chunk_cols is None:
        # Balanced chunks of at most MAX_CHUNK_ELEMENTS logits, 128-column aligned.
        max_cols = max(128, MAX_CHUNK_ELEMENTS // max(num_tokens, 1))
        per_chunk = -(-v_local // -(-v_local // max_cols))
        chunk_cols = min(v_local, -(-per_chunk // 128) * 128)
    real = vocab_size - v_offset       # real columns of this rank's slice
    return [(a, min(a + chunk_cols, v_local), max(0, min(a + chunk_cols, v_local, real) - a))
            for a in range(0, v_local, chunk_cols)]


class _FusedLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, group, vocab_size, temperature, chunk_cols, ops, cap):
        v_offset = group_rank(group) * weight.shape[0]
        chunks = _chunks(weight.shape[0], v_offset, vocab_size, x.shape[0], chunk_cols)
        stat = torch.promote_types(x.dtype, torch.float32)
        state = (x.new_full((x.shape[0],), EMPTY_MAX, dtype=stat),
                 *(x.new_zeros(x.shape[0], dtype=stat) for _ in range(3)))   # m, s, d, zt
        buf = x.new_empty(x.shape[0] * max(b - a for a, b, _ in chunks))
        for start, stop, n_valid in chunks:
            if n_valid:
                logits = _logits(x, weight[start:stop], buf)                # [T, cols]
                if cap is not None:
                    logits.div_(cap).tanh_().mul_(cap)
                ops.stats_update(logits, targets, v_offset + start, n_valid, temperature, state)
        logp, ent, log_z = _finish(state, group)
        ctx.save_for_backward(x, weight, targets, log_z, ent)
        ctx.chunks, ctx.v_offset, ctx.temperature, ctx.ops = chunks, v_offset, temperature, ops
        ctx.cap = cap
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x, weight, targets, log_z, ent = ctx.saved_tensors
        g_logp = torch.zeros_like(log_z) if g_logp is None else g_logp.to(log_z.dtype).contiguous()
        g_ent = torch.zeros_like(log_z) if g_ent is None else g_ent.to(log_z.dtype).contiguous()
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = torch.zeros(x.shape, dtype=log_z.dtype, device=x.device) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        width = x.shape[0] * max(b - a for a, b, _ in ctx.chunks)
        buf = x.new_empty(width)
        tanh_buf = x.new_empty(width) if ctx.cap is not None else None
        for start, stop, n_valid in ctx.chunks:
            if not n_valid:            # all padding: no logit, no gradient
                if need_w:
                    grad_w[start:stop].zero_()
                continue
            w_c = weight[start:stop]
            logits = _logits(x, w_c, buf)
            if ctx.cap is not None:     # capped = cap·tanh(raw/cap); d capped/d raw = 1 − tanh²
                t = tanh_buf[: logits.numel()].view_as(logits)
                torch.div(logits, ctx.cap, out=t).tanh_()
                torch.mul(t, ctx.cap, out=logits)
            g = ctx.ops.grad(logits, targets, ctx.v_offset + start, n_valid,
                             ctx.temperature, log_z, ent, g_logp, g_ent)    # [T, cols]
            if ctx.cap is not None:
                g.mul_(t.square_().neg_().add_(1))
            if need_w:
                torch.mm(g.t(), x, out=grad_w[start:stop])
            if need_x:
                accumulate_mm(grad_x, g, w_c)
        return (grad_x.to(x.dtype) if need_x else None, grad_w, *([None] * 7))


def _logits(x, w_c, buf):
    """x·w_c^T into the front of the flat reused buffer: [T, cols], contiguous."""
    out = buf[: x.shape[0] * w_c.shape[0]].view(x.shape[0], w_c.shape[0])
    return torch.mm(x, w_c.t(), out=out)


def _check(hidden, weight, targets, tp, vocab_size, temperature, sequence_parallel, impl,
           softcap):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
                         "[T, H] and [V/tp, H]")
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise ValueError(f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, "
                         f"{weight.device}) must share dtype and device")
    num_tokens = hidden.shape[0] * (tp if sequence_parallel else 1)
    if targets.shape != (num_tokens,):
        raise ValueError(f"targets {tuple(targets.shape)} must be [{num_tokens}] (all tokens)")
    if not 0 < vocab_size <= weight.shape[0] * tp:
        raise ValueError(f"vocab_size={vocab_size} outside (0, {weight.shape[0] * tp}] "
                         "(padded rows x tp)")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be > 0 (or None)")
    if impl not in (None, "cuda", "torch"):
        raise ValueError(f"impl={impl!r} must be None, 'cuda' or 'torch'")


def fused_linear_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                 targets: torch.Tensor, tp_group=None,
                                 vocab_size: int | None = None, temperature: float = 1.0,
                                 sequence_parallel: bool = False, chunk_cols: int | None = None,
                                 impl: str | None = None, rows: torch.Tensor | None = None,
                                 softcap: float | None = None):
    """Log-prob of `targets` and entropy of softmax(hidden·weight^T / temperature), per token.
    rows: the (gathered) token positions wanted; the others' outputs are 0 and their head GEMMs
    never run (RL scores response tokens only). softcap: the logits are cap·tanh(logits/cap)
    first (Gemma 2's final soft-cap), in the logits' dtype as the unfused head computes it.

    hidden: [T, H], or this rank's [T/tp, H] block with sequence_parallel (all-gathered here;
    backward reduce-scatters), else replicated over TP (backward all-reduces). weight: this rank's
    [V_padded/tp, H] head rows. targets: [T] global ids. chunk_cols: vocabulary columns per chunk
    (None: balanced chunks of <= MAX_CHUNK_ELEMENTS logits). Returns ([T], [T]) in fp32.
    """
    tp = group_size(tp_group)
    sp = sequence_parallel and tp > 1
    vocab_size = weight.shape[0] * tp if vocab_size is None else vocab_size
    _check(hidden, weight, targets, tp, vocab_size, temperature, sp, impl, softcap)
    if chunk_cols is not None and chunk_cols < 1:
        raise ValueError(f"chunk_cols={chunk_cols} must be >= 1")
    x = (gather_from_sp(hidden, tp_group) if sp else copy_to_tp(hidden, tp_group)).contiguous()
    # Out-of-range ids (e.g. ignore indices) become -1: owned by no chunk on any rank.
    targets = targets.to(device=x.device, dtype=torch.long)
    targets = torch.where((targets >= 0) & (targets < vocab_size), targets, -1).contiguous()
    num_tokens = x.shape[0]
    if rows is not None:
        rows = rows.to(device=x.device, dtype=torch.long)
        x, targets = x.index_select(0, rows), targets.index_select(0, rows)
    lp, ent = _FusedLinearLogprobEntropy.apply(x, weight, targets, tp_group, vocab_size,
                                               float(temperature), chunk_cols,
                                               _chunk_ops(x, impl),
                                               None if softcap is None else float(softcap))
    if rows is None:
        return lp, ent
    zeros = lp.new_zeros(num_tokens)
    return zeros.index_copy(0, rows, lp), zeros.index_copy(0, rows, ent)
