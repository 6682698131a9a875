"""Run a function on N gloo (or nccl, one GPU each) ranks in fresh processes (mp.spawn)."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world_size, port, args, backend="gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_dist(fn, world_size: int, *args, backend: str = "gloo") -> None:
    """Run fn(rank, world_size, *args) on `world_size` ranks; re-raises a rank's failure."""
    mp.spawn(_worker, args=(fn, world_size, free_port(), args, backend), nprocs=world_size,
             join=True)
