"""Run a function on N gloo (or nccl, one GPU each) ranks in fresh processes.

The ranks fork from multiprocessing's forkserver, which imported torch, transformers' model
classes and hybridengine once per test session: a spawned rank spent ~2-4 s of the 2-core CI
machine importing them again (a 2-rank run_dist started in 2.1 s, from the forkserver in 0.05 s).
The server itself is a fresh interpreter (no threads, no CUDA context), and each rank takes the
caller's environment as it is at the call, as a spawned one would."""
from __future__ import annotations

import multiprocessing
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what the ranks of nearly every test import (each name's import errors are ignored)
multiprocessing.set_forkserver_preload([
    "torch", "torch.distributed", "hybridengine.rl.trainer",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2"])


def _worker(rank, fn, world_size, port, args, backend, environ):
    os.environ.clear()              # a forked rank has the forkserver's, of its start
    os.environ.update(environ)
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


def run_dist(fn, world_size: int, *args, backend: str = "gloo",
             start_method: str = "forkserver") -> None:
    """Run fn(rank, world_size, *args) on `world_size` ranks; re-raises a rank's failure.
    A forked rank ends in os._exit: no atexit handler and no C++ static destructor runs, so a
    rank whose libraries clean up only there (vLLM's CPU build unlinks its /dev/shm segments,
    whose names do not change between runs) needs start_method="spawn"."""
    mp.start_processes(_worker, args=(fn, world_size, free_port(), args, backend,
                                      dict(os.environ)),
                       nprocs=world_size, join=True, start_method=start_method)
