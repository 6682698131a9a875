"""Device probe (2026-11-30, session 4): (1) bandwidth of the ways one rank can fill a peer's
memory on one NVLink host: NCCL all-gather, copy-engine pushes / pulls into symmetric memory
(torch.distributed._symmetric_memory), SM-kernel pushes into strided peer views; (2) the Triton
decode-attention kernel's split count, tile and warp settings at the rollout benchmark's shape.
JSON lines to stdout.  torchrun --nproc_per_node=2 bench/probes/transport_attention.py
"""
import json, math, os, sys, time, traceback
import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())


def emit(**kw):
    print(json.dumps(kw), flush=True)


def timed(fn, iters=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize(); dist.barrier()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize(); dist.barrier()
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def transport(rank, world, dev):
    n = (2 << 30) // 2                               # 2 GiB per rank, bf16
    x = torch.randn(n, device=dev).to(torch.bfloat16)
    out = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
    gb = n * 2 * (world - 1) / 1e9                    # received per rank
    s = timed(lambda: dist.all_gather_into_tensor(out, x))
    if rank == 0: emit(probe="nccl_all_gather", seconds=s, gbps=gb / s)
    try:
        import torch.distributed._symmetric_memory as symm
        grp = dist.group.WORLD
        try:
            symm.enable_symm_mem_for_group(grp.group_name)
        except Exception:
            pass
        buf = symm.empty(world * n, dtype=torch.bfloat16, device=dev)
        hdl = symm.rendezvous(buf, grp)
        peers = [hdl.get_buffer(r, (world * n,), torch.bfloat16) for r in range(world)]
        side = torch.cuda.Stream(dev)

        def push(chunk=None):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                hdl.barrier()
                for r in range(world):
                    dst = peers[r][rank * n:(rank + 1) * n]
                    if chunk is None:
                        dst.copy_(x)
                    else:
                        for o in range(0, n, chunk):
                            dst[o:o + chunk].copy_(x[o:o + chunk])
                hdl.barrier()
            torch.cuda.current_stream().wait_stream(side)
        s = timed(push)
        ok = bool(torch.equal(buf[(1 - rank) * n:(2 - rank) * n][:1000], peers[1 - rank][(1 - rank) * n:][:1000]))
        if rank == 0: emit(probe="symm_push_ce", seconds=s, gbps=gb / s, ok=ok)
        s = timed(lambda: push(32 << 20))
        if rank == 0: emit(probe="symm_push_ce_64MB_pieces", seconds=s, gbps=gb / s)

        def pull():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                hdl.barrier()
                for r in range(world):
                    if r != rank:
                        out[r * n:(r + 1) * n].copy_(peers[r][r * n:(r + 1) * n])
                hdl.barrier()
            torch.cuda.current_stream().wait_stream(side)
        s = timed(pull)
        if rank == 0: emit(probe="symm_pull_ce", seconds=s, gbps=gb / s)
        # row-parallel pattern: (rows, cols) local -> columns [rank*cols, (rank+1)*cols) of a
        # (rows, world*cols) weight in each peer: strided destination, an SM copy kernel
        cols = 2432; rows = n // cols
        src2 = x[:rows * cols].view(rows, cols)

        def push_strided():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                hdl.barrier()
                for r in range(world):
                    dst = peers[r][:world * rows * cols].view(rows, world * cols)
                    dst[:, rank * cols:(rank + 1) * cols].copy_(src2)
                hdl.barrier()
            torch.cuda.current_stream().wait_stream(side)
        s = timed(push_strided)
        if rank == 0: emit(probe="symm_push_strided_sm", seconds=s, gbps=rows * cols * 2 / 1e9 / s)
    except Exception as e:
        if rank == 0: emit(probe="symm", error=repr(e)[:400], tb=traceback.format_exc()[-1500:])
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(dev)
        pool = torch.cuda.MemPool(backend.mem_allocator)
        backend.register_mem_pool(pool, symm=True)
        with torch.cuda.use_mem_pool(pool):
            xs = torch.empty_like(x).copy_(x)
            outs = torch.empty_like(out)
        s = timed(lambda: dist.all_gather_into_tensor(outs, xs))
        if rank == 0: emit(probe="nccl_symmetric_all_gather", seconds=s, gbps=gb / s)
    except Exception as e:
        if rank == 0: emit(probe="nccl_symmetric", error=repr(e)[:400])


def attention(dev):
    import triton
    from hybridengine.kernels import decode_attention as da
    B, hq, hkv, d, L = 256, 14, 2, 64, 768
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, hq, d, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn((B + 1) * L, hkv, d, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.arange(B, device=dev, dtype=torch.int32)
    seqlens = torch.full((B,), 640, device=dev, dtype=torch.int32)
    ref = da.decode_attention(q, k, v, slots, seqlens, L)
    kv_bytes = B * 640 * hkv * d * 2 * 2
    rows = []
    for splits in (1, 2, 4, 8):
        for block_n in (32, 64, 128):
            length = math.ceil(math.ceil(L / splits) / block_n) * block_n
            ns = math.ceil(L / length)
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    o = torch.empty(B, hq, ns, d, dtype=torch.float32, device=dev)
                    lse = torch.empty(B, hq, ns, dtype=torch.float32, device=dev)
                    res = torch.empty_like(q)

                    def run():
                        da._split_kernel[(B, hkv, ns)](
                            q, k, v, slots, seqlens, o, lse, L, 1 / math.sqrt(d),
                            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                            GROUP=hq // hkv, BLOCK_G=16, HEAD_DIM=d, BLOCK_N=block_n,
                            SPLIT_LEN=length, NUM_SPLITS=ns, PRECISION="tf32",
                            num_warps=warps, num_stages=stages)
                        da._merge_kernel[(B * hq,)](o, lse, res, NUM_SPLITS=ns,
                                                    SPLITS_P2=triton.next_power_of_2(ns), HEAD_DIM=d)
                    try:
                        run()
                        err = (res.float() - ref.float()).abs().max().item()
                        ms = triton.testing.do_bench_cudagraph(run, rep=50)
                        rows.append((ms, splits, block_n, warps, stages, err))
                    except Exception as e:
                        rows.append((1e9, splits, block_n, warps, stages, repr(e)[:80]))
    rows.sort()
    cur = triton.testing.do_bench_cudagraph(
        lambda: da.decode_attention(q, k, v, slots, seqlens, L), rep=50)
    emit(probe="attention", current_ms=cur, current_gbps=kv_bytes / cur / 1e6,
         best=[dict(ms=r[0], gbps=kv_bytes / r[0] / 1e6, splits=r[1], block_n=r[2], warps=r[3],
                    stages=r[4], err=r[5]) for r in rows[:12]])


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
    if rank == 0: emit(torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())))
    if os.environ.get("PROBE_TRANSPORT", "1") == "1":
        transport(rank, world, dev)
    if rank == 0:
        sampler(dev)
        attention(dev)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
