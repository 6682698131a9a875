"""The MFU peer of issue 7: Megatron-core training the Qwen2.5-0.5B shape, next to our decoder on
the same tokens in the same process.

Megatron-core's GPTModel with its *local* layer spec (torch norms, unfused core attention; no
Transformer Engine or apex, which the GPU machine lacks), bf16, random weights, one GPU (tp = pp
= dp = 1): forward + backward of `batch` sequences of `seq_len` tokens (causal, padded layout
[b, s], the only one the local spec has), loss = Megatron's vocab-parallel cross entropy. Ours:
tools/bench_model.bench_ours on the same tokens as `batch` packed sequences of `seq_len`. MFU =
rl.flops.decoder_flops (as bench_model) / time / the bf16 matmul peak measured in this run; the
same formula for both.

    python tools/bench_megatron.py [--batch 16 --seq-len 1024 --iters 10] [--no-ours]
    python tools/bench_megatron.py --tiny          # CPU smoke run (gloo, fp32, tiny shape)

Megatron-core is not a dependency: carry its wheel (pure Python but for a dataset helper) and
put it on PYTHONPATH. JSON to stdout, progress to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
from hybridengine.models.shapes import QWEN2_5_0_5B, TINY  # noqa: E402
from hybridengine.rl.flops import decoder_flops, peak_flops  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench_megatron] {msg}", file=sys.stderr, flush=True)


def cpu_shims() -> None:
    """Megatron-core assumes CUDA in two places a CPU smoke run reaches (it checks our wiring of
    its API, not speed): RoPE moves its table to torch.cuda.current_device(), and core attention
    forks the CUDA RNG tracker (for dropout, 0 here)."""
    import contextlib

    from megatron.core import tensor_parallel
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def init_single_process(device: torch.device) -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def build_megatron(cfg, device, dtype):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(0)
    tcfg = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads, num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=cfg.attention_bias,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        use_cpu_initialization=device.type != "cuda",
        # the fused paths need apex / TE / CUDA extensions this machine lacks
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False)
    model = GPTModel(config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
                     share_embeddings_and_output_weights=cfg.tie_word_embeddings,
                     pre_process=True, post_process=True)
    return model.to(device=device, dtype=dtype)


def bench_megatron(cfg, args, device, dtype) -> dict:
    torch.manual_seed(0)
    model = build_megatron(cfg, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    tokens, labels = ids[:, :-1].to(device), ids[:, 1:].to(device)
    positions = torch.arange(args.seq_len, device=device).expand(args.batch, -1)
    # causal mask in Megatron's convention: True = masked out
    mask = torch.triu(torch.ones(args.seq_len, args.seq_len, dtype=torch.bool, device=device),
                      diagonal=1)[None, None]

    def step():
        loss = model(tokens, positions, mask, labels=labels)          # [b, s] per-token loss
        loss.float().mean().backward()

    for _ in range(args.warmup):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    _sync(device)
    sec = (time.perf_counter() - t0) / args.iters
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"seconds_per_step": sec, "tokens_per_s": args.batch * args.seq_len / sec,
            "params": params, "peak_memory_gb": peak_mem}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-ours", action="store_true", help="skip our decoder on the same tokens")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, fp32")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = QWEN2_5_0_5B if cuda else replace(TINY, max_position_embeddings=4096)
    if args.tiny:
        args.batch, args.seq_len, args.iters, args.warmup = 2, 64, 2, 1
        cpu_shims()
    init_single_process(device)
    peak = peak_flops() if cuda else None
    flops = decoder_flops(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size,
                          [args.seq_len] * args.batch, backward=True)
    log(f"megatron-core local spec: {args.batch} x {args.seq_len} tokens on {device}")
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "batch": args.batch, "seq_len": args.seq_len, "flops_per_step": flops,
           "peak_flops": peak, "params": cfg.num_params(),
           "megatron": bench_megatron(cfg, args, device, dtype)}
    if out["megatron"]["params"] != cfg.num_params():
        raise RuntimeError(f"Megatron's model has {out['megatron']['params']} parameters, ours "
                           f"{cfg.num_params()}: not the same shape")
    import megatron.core
    out["megatron_core"] = getattr(megatron.core, "__version__", "unknown")
    if not args.no_ours:
        from bench_model import bench_ours
        log("ours: the same tokens, packed")
        sec, mem = bench_ours(cfg, [args.seq_len] * args.batch, device, dtype, args.iters,
                              compile_layers=False)
        out["ours"] = {"seconds_per_step": sec, "tokens_per_s": args.batch * args.seq_len / sec,
                       "peak_memory_gb": mem}
    for name in ("megatron", "ours"):
        if name in out and peak:
            out[name]["mfu"] = flops / out[name]["seconds_per_step"] / peak
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
