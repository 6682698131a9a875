"""The vLLM rollout backend: a vLLM engine colocated on the training ranks, fed by the HybridEngine.

    rollout = VllmRollout(model_dir, cfg, gen_tp=t_g, dtype=..., max_model_len=...)   # once
    rollout.update_weights(gen_model, gen_mesh.gen_tp_group)   # every step, after to_generation
    results = rollout.generate(prompts, SamplingParams(...))   # -> [GenerationResult], as Engine
    rollout.free_cache()                                       # between phases (sleep on GPU)

One engine per generation replica, in this process (no engine subprocess): with a process group
it runs under vLLM's `external_launcher` executor, which builds its groups from the existing
world, TP groups on consecutive ranks (`vllm_replica`). Every rank of a replica calls every
method with the same arguments, as with the built-in engine.

Weights. vLLM's loaders take checkpoint (Hugging Face) tensors, each rank's loader cutting its
own TP slice out of the full tensor; the CPU backend also repacks linear weights after loading,
so only `reload_weights(is_checkpoint_format=True)` (load + re-process, layer by layer) is right
there. `hf_weight_stream` turns this rank's generation shard into full HF tensors, streamed: at
gen-TP 1 the shard is the model and the HF tensors are views of it (no copy, no communication);
at gen-TP > 1 the shards are all-gathered over the gen-TP group in buckets of `bucket_mb` and each
bucket is reassembled into full HF tensors just before vLLM consumes them, so at most one bucket
(t_g·bucket) of gathered weights and its HF tensors exist at a time. Full tensors make the update
independent of how our gen-TP groups map onto vLLM's, which differ when training TP·PP > t_g.

Log-probs. logprobs_mode="raw_logprobs": vLLM returns log softmax of the unmodified logits at the
sampled token, what the trainer recomputes (GenerationResult.logprobs). The processed-distribution
log-prob (`sampled_logprobs`) is not available from the same engine: it equals `logprobs` when
sampling is unmodified (temperature 1, no top-k / top-p), is 0.0 for greedy, and NaN otherwise.

Stopping follows the built-in engine: only `stop_token_ids` end a sequence (vLLM's own EOS is
off, ignore_eos=True), the stop token is part of the response, and max_tokens is capped by the
room left in max_model_len. Sleep mode (free weights and KV cache between phases) is used where
vLLM supports it (CUDA, ROCm, XPU); on CPU it is a no-op and the backend says so once.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist

from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.models.hf import Piece, is_tp_replicated, param_plan
from hybridengine.parallel.tensor import all_gather_flat, group_size
from hybridengine.rollout.engine import GenerationResult
from hybridengine.rollout.sampling import SamplingParams, sequence_key

log = logging.getLogger(__name__)

VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")
# Set before vLLM is imported: the engine runs in this process; vLLM logs warnings only.
_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
# CPU only: without it the first log-prob call compiles for ~15 s (enforce_eager covers the model).
_CPU_ENV = {"TORCHDYNAMO_DISABLE": "1"}


def vllm_available() -> tuple[bool, str]:
    """(True, version) when vLLM imports, else (False, the reason in one line)."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - a broken install raises anything (RuntimeError, OSError)
        msg = str(e).strip().splitlines()
        return False, f"vLLM is not importable ({type(e).__name__}: {msg[0] if msg else ''})"
    return True, vllm.__version__


def vllm_replica(rank: int, gen_tp: int) -> tuple[int, int]:
    """(replica index, TP rank inside it) of a global rank: vLLM's external launcher lays its TP
    groups on consecutive ranks."""
    return divmod(rank, gen_tp)


# --- weights: generation shard -> full HF tensors, streamed ------------------------------------

def _pieces(name: str, shape: torch.Size, cfg: ModelConfig, tp: int, rank: int) -> list[Piece]:
    """The HF slices of gen-TP shard `rank` of a parameter. Vocabulary rows follow the shard's
    real row count (the reshard plan keeps the training layout's padding, see hybrid.plan)."""
    pieces = param_plan(name, cfg, tp, rank)
    if name in VOCAB_PARAMS:
        rows = shape[0]
        start, stop = rank * rows, min((rank + 1) * rows, cfg.vocab_size)
        src = param_plan(name, cfg, 1, 0)[0]
        return [replace(src, start=start, stop=stop)] if stop > start else []
    return pieces


def _split_local(name: str, t: torch.Tensor, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A full (unsharded) parameter as HF tensors: views, no copy (qkv -> q, k, v; ...)."""
    offset = 0
    for p in _pieces(name, t.shape, cfg, 1, 0):
        n = p.stop - p.start
        yield p.name, t.narrow(p.local_dim, offset, n)
        offset += n


def _assemble(name: str, shards: list[torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every gen-TP rank's shard of one parameter -> its full HF tensors."""
    tp, parts = len(shards), {}
    for r, shard in enumerate(shards):
        offset = 0
        for p in _pieces(name, shard.shape, cfg, tp, r):
            n = p.stop - p.start
            parts.setdefault(p.name, []).append((p, shard.narrow(p.local_dim, offset, n)))
            offset += n
    out = {}
    for hf_name, chunks in parts.items():
        dim = chunks[0][0].hf_dim              # == local_dim for every Decoder parameter
        shape = list(chunks[0][1].shape)
        shape[dim] = max(p.stop for p, _ in chunks)
        full = chunks[0][1].new_empty(shape)
        for p, chunk in chunks:
            full.narrow(dim, p.start, p.stop - p.start).copy_(chunk)
        out[hf_name] = full
    return out


def _gathered(bucket: list[tuple[str, torch.Tensor]], group, cfg: ModelConfig, stats: dict):
    """One all-gather of a bucket of shards over the gen-TP group, reassembled into HF tensors."""
    tp = group_size(group)
    numel = sum(t.numel() for _, t in bucket)
    first = bucket[0][1]
    flat = torch.empty(numel, dtype=first.dtype, device=first.device)
    offset = 0
    for _, t in bucket:
        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    out = flat.new_empty(tp * numel)
    all_gather_flat(out, flat, group)
    stats["gathered_bytes"] += out.numel() * out.element_size()
    chunks, offset = out.view(tp, numel), 0                        # [tp, numel]
    for name, t in bucket:
        shards = [chunks[r, offset:offset + t.numel()].view(t.shape) for r in range(tp)]
        offset += t.numel()
        yield from _assemble(name, shards, cfg).items()


def hf_weight_stream(model: Decoder, group, bucket_mb: float,
                     stats: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every weight of a generation Decoder shard (pp = 1), layers in
    order; gen-TP > 1: sharded parameters gathered over `group` in buckets of `bucket_mb` (a
    collective: every member must consume the whole stream)."""
    tp, cfg = group_size(group), model.cfg
    stats = stats if stats is not None else {}
    stats.setdefault("gathered_bytes", 0)
    max_bytes = max(1, int(bucket_mb * 2**20))
    bucket, size = [], 0
    for name, p in model.named_parameters():
        if name.startswith("value_head.") or (name == "lm_head.weight"
                                              and cfg.tie_word_embeddings):
            continue
        t = p.detach()
        if tp == 1 or is_tp_replicated(name, cfg, tp):
            yield from _split_local(name, t, cfg)
            continue
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= max_bytes:
            yield from _gathered(bucket, group, cfg, stats)
            bucket, size = [], 0
    if bucket:
        yield from _gathered(bucket, group, cfg, stats)


# --- sampling ---------------------------------------------------------------------------------

def to_vllm_sampling(params: SamplingParams, prompt_len: int, max_model_len: int,
                     prompt_seed: int):
    """Our SamplingParams for one prompt as vLLM's (its n samples get seeds prompt_seed + j)."""
    import vllm
    top_k = params.top_k if params.top_k > 0 else 0                # vLLM: 0 = off
    return vllm.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=top_k,
        max_tokens=min(params.max_tokens, max_model_len - prompt_len),
        stop_token_ids=list(params.stop_ids()), ignore_eos=True, seed=prompt_seed,
        logprobs=0, detokenize=False, skip_special_tokens=False)


def _sampled_logprobs(params: SamplingParams, logprobs: list[float]) -> list[float]:
    if params.greedy:
        return [0.0] * len(logprobs)
    if params.mode(2**31).scaled or params.top_k > 0 or params.top_p < 1.0:
        return [math.nan] * len(logprobs)       # processed log-probs: not reported (module doc)
    return list(logprobs)


@contextlib.contextmanager
def _process_state_kept():
    """vLLM's engine start reseeds the global RNGs, lowers torch's thread count and, on CPU,
    replaces torch.set_num_threads with a no-op; the trainer shares this process: undo that."""
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py_rng = random.getstate()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
