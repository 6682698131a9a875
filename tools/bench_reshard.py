"""Train -> generation switch of the HybridEngine vs the naive full gather vs a plain all-gather.

Random bf16 weights built directly with Decoder (no files), Qwen2.5-0.5B and Qwen2.5-7B shapes,
training layout (t = world size, p = 1, d = 1) -> generation TP t_g (default 1). For each model:
zero_redundancy (micro-DP all-gather in flat buckets) and naive (per-tensor full-model gathers
over the model-parallel group, then slicing, like verl / DS-Chat) switches, warm-up then the
median of several (zero_redundancy also with keep_weights, and at each --direct-min-mb
threshold: direct buckets gather straight into the generation weights); and one plain
all-gather moving the same bytes per rank (the bound). `best` indexes the fastest
zero_redundancy run. Bus bandwidth of an all-gather = bytes each rank receives / seconds. Every
variant's generation weights are checked equal (`modes_agree`). JSON to stdout (and --out).

    torchrun --nproc_per_node=2 tools/bench_reshard.py [--models 0.5b,7b] [--bucket-mb 256]
    torchrun --nproc_per_node=2 tools/bench_reshard.py --tiny       # CPU / gloo smoke check
--profile adds to each run the kernel table of one more switch (tools/profiling.py): copy and
NCCL time, and each stream's busy time against the switch's span (do the copies hide under the
gathers?).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hybridengine.hybrid.reshard import HybridEngine  # noqa: E402
from hybridengine.models.decoder import Decoder, ModelConfig  # noqa: E402
from hybridengine.parallel import tensor as ptensor  # noqa: E402
from hybridengine.parallel.layout import GenLayout, Layout  # noqa: E402
from hybridengine.parallel.mesh import build_gen_mesh, build_mesh, init_distributed  # noqa: E402

from hybridengine.models.shapes import QWEN2_5_0_5B, QWEN2_5_7B  # noqa: E402
from profiling import profile_ranges  # noqa: E402

SHAPES = {
    "0.5b": QWEN2_5_0_5B,
    "7b": QWEN2_5_7B,
    "tiny": ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True,
                        model_type="qwen2"),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_switch(engine, train, warmup, iters):
    """Median over `iters` round trips after `warmup`; the generation weights of the last one."""
    to_gen, to_train, rep = [], [], None
    for i in range(warmup + iters):
        gen = engine.to_generation(train)
        rep = engine.reports[-1]
        snapshot = {n: p.detach().clone() for n, p in gen.named_parameters()} \
            if i == warmup + iters - 1 else None
        back = engine.to_training()
        if i >= warmup:
            to_gen.append(rep.seconds)
            to_train.append(back.seconds)
    engine.pop_metrics()
    out = {"seconds": statistics.median(to_gen), "seconds_all": to_gen,
           "to_training_seconds": statistics.median(to_train),
           "bytes_received": rep.bytes_received, "max_bytes_received": rep.max_bytes_received,
           "collectives": rep.num_collectives, "peak_memory_gb": rep.peak_memory_after_gb}
    out["busbw_gbps"] = rep.bytes_received / out["seconds"] / 1e9
    return out, snapshot


def bench_allgather(group, num_bytes, device, warmup, iters):
    """One plain all-gather in which every rank receives `num_bytes` (the bound)."""
    size = ptensor.group_size(group)
    if size == 1 or num_bytes == 0:
        return {"seconds": 0.0, "busbw_gbps": 0.0}
    chunk = num_bytes // (size - 1) // 2                      # bf16 elements
    x = torch.ones(chunk, dtype=torch.bfloat16, device=device)
    out = torch.empty(size * chunk, dtype=torch.bfloat16, device=device)
    times = []
    for i in range(warmup + iters):
        _sync(device)
        t0 = time.perf_counter()
        ptensor.all_gather_flat(out, x, group)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    return {"seconds": sec, "busbw_gbps": (size - 1) * chunk * 2 / sec / 1e9}


def profile_switch(engine, train) -> dict:
    table = profile_ranges(lambda: engine.to_generation(train), ["reshard"])
    engine.to_training()
    engine.pop_metrics()
    return table


def bench_model(name, cfg, args, mesh, gen_mesh, device):
    torch.manual_seed(1000 + mesh.rank)
    train = Decoder(cfg, mesh.tp_group, sequence_parallel=True, dtype=torch.bfloat16,
                    device=device)
    result = {"model": name, "layout": list(vars(mesh.layout).values()),
              "gen_tp": args.gen_tp, "model_bytes": cfg.num_params() * 2, "runs": []}
    # zero_redundancy at every bucket size, then with kept weights (no allocation, bound
    # copies: the steady state of a trainer that keeps them) at every bucket size and
    # direct-bucket threshold, then the naive baseline, allocating and with kept weights.
    mb0, d0 = args.bucket_mb[0], args.direct_min_mb[0]
    variants = [("zero_redundancy", mb, False, d0) for mb in args.bucket_mb] + \
        [("zero_redundancy", mb, True, d) for mb in args.bucket_mb
         for d in args.direct_min_mb] + \
        [("naive", mb0, False, None), ("naive", mb0, True, None)]
    reference, agree = None, True           # every variant's weights equal the first one's
    for mode, bucket_mb, keep, direct_mb in variants:
        engine = HybridEngine(cfg, mesh, gen_mesh, mode=mode, bucket_mb=bucket_mb,
                              keep_weights=keep, direct_min_mb=direct_mb)
        stats, snapshot = bench_switch(engine, train, args.warmup, args.iters)
        if reference is None:
            reference = snapshot
        else:
            agree = agree and snapshot.keys() == reference.keys() and all(
                torch.equal(snapshot[k], reference[k]) for k in snapshot)
        del snapshot
        plan, _ = engine.plan(torch.bfloat16)
        stats.update(mode=mode, bucket_mb=bucket_mb, keep_weights=keep, direct_min_mb=direct_mb,
                     direct_buckets=sum(plan.direct))
        if args.profile:
            stats["profile"] = profile_switch(engine, train)
        result["runs"].append(stats)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["modes_agree"] = agree
    del reference
    ours = [r for r in result["runs"] if r["mode"] == "zero_redundancy"]
    best = min(ours, key=lambda r: r["seconds"])
    bound = bench_allgather(gen_mesh.micro_dp_group, best["bytes_received"], device,
                            args.warmup, args.iters)
    naive = min(r["seconds"] for r in result["runs"] if r["mode"] == "naive")   # the faster
    result.update(allgather_bound=bound, best=ours.index(best),
                  speedup_vs_naive=naive / best["seconds"] if best["seconds"] else None,
                  ratio_to_bound=best["seconds"] / bound["seconds"] if bound["seconds"] else None)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="0.5b,7b", help="comma list of: " + ",".join(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="tiny model, 1 warm-up, 2 iterations")
    ap.add_argument("--gen-tp", type=int, default=1)
    ap.add_argument("--bucket-mb", default="256", help="comma list: zero_redundancy sweeps them")
    ap.add_argument("--direct-min-mb", default="4,none",
                    help="comma list of direct-bucket thresholds (MB per member; none: off)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--profile", action="store_true", help="kernel table of one more switch")
    args = ap.parse_args()
    args.bucket_mb = [float(x) for x in args.bucket_mb.split(",")]
    args.direct_min_mb = [None if x.strip().lower() == "none" else float(x)
                          for x in args.direct_min_mb.split(",")]
    models = ["tiny"] if args.tiny else args.models.split(",")
    if args.tiny:
        args.warmup, args.iters = 1, 2
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; choose from {sorted(SHAPES)}")

    env = init_distributed()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                          else "cpu")
    layout = Layout(tp=env.world_size)
    mesh, gen_mesh = build_mesh(layout), build_gen_mesh(GenLayout(layout, args.gen_tp))
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "world_size": env.world_size,
              "backend": dist.get_backend() if dist.is_initialized() else "none",
              "note": None if env.world_size > 1 else "1 process: t = t_g = 1, nothing moves",
              "results": [bench_model(m, SHAPES[m], args, mesh, gen_mesh, device) for m in models]}
    if env.rank == 0:
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
