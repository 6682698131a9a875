"""The decode step's CUDA graphs: which batch sizes get one (`graph_buckets`), and their capture.

A decode step runs at the smallest bucket that holds its rows, the rest padding rows in the
scratch slot; the model runner captures one graph per (sampler mode, bucket) at its first use
(`DecodeGraphs.capture`), all in one memory pool, and replays it afterwards: the host launches
one replay per step. Graphs read parameters and the cache by address: the runner drops them
when the parameters moved or the cache is freed.
"""
from __future__ import annotations

from typing import Callable

import torch


def graph_buckets(max_rows: int) -> list[int]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... (powers
    of two and their midpoints: at most 1/3 padding rows), and max_rows. Few buckets: each is
    captured again after free_cache()."""
    sizes, b = [1, 2, 4], 4
    while b < max_rows:
        sizes += [b + b // 2, 2 * b] if b >= 16 else [2 * b]
        b *= 2
    return sorted({s for s in sizes if s < max_rows} | {max_rows})


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of every warm-up and capture on `device`. cuBLAS keeps a workspace
    per (handle, stream), allocated by torch's caching allocator and never freed (tens of MiB on
    Hopper), and torch hands out its 32 pooled streams round-robin: a new stream per capture
    left a workspace behind per capture until all 32 had one, memory the next KV cache could
    not have (the likely cause of the 3B GRPO run's KV slots falling 135, 131, 129, 126, 124
    over its first 5 steps, 2026-12-02)."""
    device = torch.device(device)
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


class DecodeGraphs:
    """The captured decode graphs by key, sharing one memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict = {}
        self.pool = None

    def get(self, key):
        return self.graphs.get(key)

    def clear(self) -> None:
        """Drop the graphs (the parameters moved); the pool stays."""
        self.graphs.clear()

    def capture(self, key, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Run step() once on a side stream (warm-up: cuBLAS / NCCL / allocator state), then
        capture it as the graph of key."""
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # torch.cuda.graph() without its gc.collect() and empty_cache(): captures happen again
        # after each free_cache(), inside a trainer with a large Python heap
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool)
            try:
                step()
            finally:
                graph.capture_end()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph
        return graph
