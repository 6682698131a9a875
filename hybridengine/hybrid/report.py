"""What one switch between the training and generation layouts cost, and its step metrics.

Bytes are logical volumes counted from the collectives issued, independent of the collective
algorithm: an all-gather of chunks of c bytes over g ranks sends and receives (g−1)·c per rank.
"""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch

from hybridengine.device_memory import max_allocated


@dataclass
class SwitchReport:
    direction: str                 # "to_generation" | "to_training"
    mode: str                      # "zero_redundancy" | "naive"
    seconds: float                 # wall time of the switch, device work included
    bytes_sent: int = 0            # this rank
    bytes_received: int = 0        # this rank
    max_bytes_received: int = 0    # the busiest rank of the world (from every group's plan)
    num_collectives: int = 0
    peak_memory_before_gb: float = 0.0
    peak_memory_after_gb: float = 0.0
    offload_seconds: float = 0.0   # the trainer's offload / reload hook, inside `seconds`


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return max_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30   # Linux: KiB


def switch_metrics(reports: list[SwitchReport]) -> dict[str, float]:
    """Step metrics of the switches of one step (usually to_generation + to_training)."""
    if not reports:
        return {}
    return {
        "timing_s/reshard": sum(r.seconds for r in reports),
        "reshard/bytes_per_rank": float(max(r.max_bytes_received for r in reports)),
        "reshard/collectives": float(sum(r.num_collectives for r in reports)),
        "reshard/peak_memory_gb": max(r.peak_memory_after_gb for r in reports),
    }


class Stats:
    """Bytes received and collectives issued by one switch."""

    def __init__(self):
        self.bytes, self.collectives = 0, 0


def start_clock(device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)      # earlier queued work is not the switch's
    return time.perf_counter(), peak_memory_gb(device)


def timed(hook) -> float:
    if hook is None:
        return 0.0
    t0 = time.perf_counter()
    hook()
    return time.perf_counter() - t0
