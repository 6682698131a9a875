"""Training-step throughput and MFU of the TrainEngine on any (tp, pp, dp) layout (JSON out).

Qwen2.5-0.5B shape, random bf16 weights, packed micro-batches of mixed-length sequences
(100-768 tokens), loss = -mean log p through the vocab-parallel log-prob, one distributed-AdamW
step per iteration. tokens/s counts the whole global batch; MFU = model FLOPs (fwd+bwd) / time /
(bf16 matmul peak measured in the same run x number of GPUs).

    torchrun --nproc_per_node=N tools/bench_train.py --tp 1 --pp 1 [--tokens-per-mb 16384]

Long sequences (issue 28): `--seq-len L` makes every micro-batch one sequence of L tokens;
`--recompute` recomputes each layer in backward; `--cp N [--cp-attention ring]` splits each
sequence over N context-parallel ranks. A run that does not fit prints {"oom": true, ...}
instead of failing, so that a sweep shows where one GPU stops.

    python tools/bench_train.py --model 1.5b --seq-len 32768 --num-mb 1 --recompute
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridengine.train.engine import MicroBatch, OptimConfig, TrainEngine  # noqa: E402
from hybridengine.models.attention import PackedInput  # noqa: E402
from hybridengine.parallel.layout import Layout  # noqa: E402
from hybridengine.parallel.mesh import build_mesh, init_distributed  # noqa: E402
from hybridengine.rl.flops import decoder_flops, peak_flops  # noqa: E402
from hybridengine.models.shapes import QWEN2_5_0_5B, SHAPES, TINY  # noqa: E402
from hybridengine.parallel.layout import CP_ATTENTION  # noqa: E402

# Qwen2.5-1.5B (its config.json): the 0.5B's family at 1536 x 8960, 28 layers, 12 / 2 heads
QWEN2_5_1_5B = replace(QWEN2_5_0_5B, hidden_size=1536, intermediate_size=8960, num_layers=28,
                       num_heads=12, num_kv_heads=2, head_dim=128)
MODELS = {"0.5b": QWEN2_5_0_5B, "1.5b": QWEN2_5_1_5B,
          **{name: shape for name, (shape, _) in SHAPES.items()}}
from tools.bench_model import mixed_lengths  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tokens-per-mb", type=int, default=16384)
    ap.add_argument("--num-mb", type=int, default=4, help="micro-batches per DP rank per step")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", default="0.5b", choices=sorted(MODELS))
    ap.add_argument("--seq-len", type=int, default=0,
                    help="one sequence of this many tokens per micro-batch (0: mixed lengths)")
    ap.add_argument("--recompute", action="store_true", help="activation recomputation")
    ap.add_argument("--compile", action="store_true", help="compiled decoder layers")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks")
    ap.add_argument("--cp-attention", default="allgather", choices=CP_ATTENTION)
    args = ap.parse_args()
    env = init_distributed()
    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    layout = Layout(args.tp, args.pp, env.world_size // (args.tp * args.pp * args.cp),
                    sequence_parallel=True, cp=args.cp, cp_attention=args.cp_attention)
    mesh = build_mesh(layout)
    cfg = TINY if args.tiny else MODELS[args.model]
    tokens = args.seq_len or (256 if args.tiny else args.tokens_per_mb)
    if args.seq_len:
        cfg = replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, tokens))
    torch.manual_seed(0)
    engine = TrainEngine(cfg, mesh, sequence_parallel=True, dtype=dtype, device=dev,
                         optim=OptimConfig(lr=1e-5), recompute=args.recompute,
                         compile_layers=args.compile)
    mbs, all_lens = [], []
    for i in range(args.num_mb):
        lens = [tokens] if args.seq_len else mixed_lengths(
            tokens, 16 if args.tiny else 100, 64 if args.tiny else 768,
            seed=1000 * mesh.dp_rank + i)
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g)
        packed = PackedInput.from_lengths(ids, lens, multiple_of=args.tp)
        mbs.append(MicroBatch(packed, {"targets": torch.roll(ids, -1)}).to(dev))
        all_lens += lens
    total_tokens = sum(all_lens) * layout.dp

    def loss_fn(out, mb):
        loss = -out["logprob"].sum() / (tokens * args.num_mb * layout.dp)
        return loss, {"loss": loss.detach()}
    setup = {"model": "tiny" if args.tiny else args.model, "seq_len": args.seq_len,
             "recompute": args.recompute, "compile": args.compile,
             "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp,
                        "cp_attention": layout.cp_attention if layout.cp > 1 else None}}
    try:
        for _ in range(2):
            engine.train_step(mbs, loss_fn)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            engine.train_step(mbs, loss_fn)
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:      # where one GPU stops: a result, not a failure
        if env.rank == 0:
            print(json.dumps({**setup, "oom": True, "error": str(e).splitlines()[0][:300],
                              "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30}))
        return
    sec = (time.perf_counter() - t0) / args.iters
    flops = decoder_flops(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, all_lens,
                          backward=True) * layout.dp
    peak = peak_flops() if cuda else None
    if env.rank == 0:
        print(json.dumps({
            **setup,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "num_gpus": env.world_size, "tokens_per_step": total_tokens,
            "micro_batches_per_dp_rank": args.num_mb, "step_s": sec,
            "tokens_per_s": total_tokens / sec,
            "tokens_per_s_per_gpu": total_tokens / sec / env.world_size,
            "peak_tflops_per_gpu": peak / 1e12 if peak else None,
            "mfu": flops / sec / (peak * env.world_size) if peak else None,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
