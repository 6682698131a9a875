"""Device probe of session 4 (2026-11-30; bench/RESULTS.md, calls 3 and 4), JSON lines out:

1. transport (2 ranks, skipped with PROBE_TRANSPORT=0): how fast one rank fills its peer's
   memory on one NVLink host — NCCL all-gather, copy-engine pushes and pulls through symmetric
   memory (torch.distributed._symmetric_memory), an SM copy kernel pushing a strided
   (row-parallel) slice, NCCL all-gather on window-registered buffers;
2. sampler: the fused Triton temperature sampler against the torch sampler at 256 x 151936;
3. attention: the Triton decode kernel's split count, key tile, warps and stages (moved to
   decode_step.py in session 5, when the kernel's arguments changed).

    torchrun --nproc_per_node=2 bench/probes/transport_attention.py
    PROBE_TRANSPORT=0 torchrun --nproc_per_node=1 bench/probes/transport_attention.py
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())


def emit(**kw):
    print(json.dumps(kw), flush=True)


def timed(fn, iters=5, warm=2) -> float:
    """Median seconds of fn() over iters calls, every rank starting together."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def on_side_stream(side, hdl, body):
    """body() between two symmetric-memory barriers on a side stream (peers ready before,
    every peer's copies landed after), ordered after and before the current stream's work."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        hdl.barrier()
        body()
        hdl.barrier()
    torch.cuda.current_stream().wait_stream(side)


def transport(rank, world, dev):
    n = (2 << 30) // 2                               # 2 GiB per rank, bf16
    gen = torch.Generator(device=dev)
    shard = [torch.randn(n, device=dev, generator=gen.manual_seed(r)).to(torch.bfloat16)
             for r in range(world)]                  # every rank's input, for the checks
    x = shard[rank]
    out = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
    gb = n * 2 * (world - 1) / 1e9                   # received per rank

    def report(name, seconds, ok=None, gigabytes=gb):
        if rank == 0:
            emit(probe=name, seconds=seconds, gbps=gigabytes / seconds, ok=ok)

    report("nccl_all_gather", timed(lambda: dist.all_gather_into_tensor(out, x)))
    try:
        import torch.distributed._symmetric_memory as symm
        buf = symm.empty(world * n, dtype=torch.bfloat16, device=dev)
        hdl = symm.rendezvous(buf, dist.group.WORLD)
        peers = [hdl.get_buffer(r, (world * n,), torch.bfloat16) for r in range(world)]
        side = torch.cuda.Stream(dev)

        def push(piece=None):         # my shard into slot `rank` of every buffer (CE copies)
            def body():
                for r in range(world):
                    dst = peers[r][rank * n:(rank + 1) * n]
                    step = piece or n
                    for o in range(0, n, step):
                        dst[o:o + step].copy_(x[o:o + step])
            on_side_stream(side, hdl, body)

        def gathered(t):
            return all(torch.equal(t[r * n:(r + 1) * n], shard[r]) for r in range(world))

        report("symm_push_ce", timed(push), gathered(buf))
        report("symm_push_ce_64MB_pieces", timed(lambda: push(32 << 20)), gathered(buf))

        def pull():                   # every peer's slot of its own buffer into `out`
            def body():
                for r in range(world):
                    if r != rank:
                        out[r * n:(r + 1) * n].copy_(peers[r][r * n:(r + 1) * n])
            on_side_stream(side, hdl, body)
        out.zero_()
        out[rank * n:(rank + 1) * n].copy_(x)
        report("symm_pull_ce", timed(pull), gathered(out))

        # row-parallel pattern: my (rows, cols) block -> columns [rank·cols, (rank+1)·cols)
        # of a (rows, world·cols) weight in every peer: a strided destination (SM kernel)
        cols = 2432
        rows = n // cols
        src = x[:rows * cols].view(rows, cols)

        def push_strided():
            def body():
                for r in range(world):
                    dst = peers[r][:world * rows * cols].view(rows, world * cols)
                    dst[:, rank * cols:(rank + 1) * cols].copy_(src)
            on_side_stream(side, hdl, body)
        report("symm_push_strided_sm", timed(push_strided),
               gigabytes=rows * cols * 2 * (world - 1) / 1e9)
    except Exception as e:                # noqa: BLE001 - a probe reports what it cannot run
        if rank == 0:
            emit(probe="symm", error=repr(e)[:400])
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(dev)
        pool = torch.cuda.MemPool(backend.mem_allocator)
        backend.register_mem_pool(pool, symm=True)
        with torch.cuda.use_mem_pool(pool):
            xs = x.clone()
            outs = torch.empty_like(out)
        report("nccl_symmetric_all_gather", timed(lambda: dist.all_gather_into_tensor(outs, xs)))
    except Exception as e:                # noqa: BLE001
        if rank == 0:
            emit(probe="nccl_symmetric", error=repr(e)[:400])


def sampler(dev):
    import triton
    from hybridengine.kernels.sampler import sample_temperature
    from hybridengine.rollout.sampling import SamplerMode, sample_torch, uniforms
    z = (torch.randn(256, 151936, device=dev) * 4).to(torch.bfloat16)
    u = uniforms(torch.arange(256, device=dev) * 7919, torch.arange(256, device=dev))
    t1, p1 = torch.ones(1, device=dev), torch.ones(1, device=dev)
    mode = SamplerMode(False, 0, False, False)
    fused = triton.testing.do_bench_cudagraph(lambda: sample_temperature(z, t1, u, False), rep=50)
    plain = triton.testing.do_bench_cudagraph(lambda: sample_torch(z, mode, t1, p1, u), rep=50)
    emit(probe="sampler", fused_ms=fused, torch_ms=plain)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    if rank == 0:
        emit(torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())))
    if os.environ.get("PROBE_TRANSPORT", "1") == "1":
        transport(rank, world, dev)
    if rank == 0:
        sampler(dev)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
