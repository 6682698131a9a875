"""The run's peak device memory across the resets that measure one phase alone.

torch keeps one allocation peak per device. The rollout resets it to measure its prefill's
working set (rollout.model_runner sizes the KV cache from that), which erased what came before
in the step: the reshard's peak went missing from perf/max_memory_allocated_gb. reset_peak
carries the peak it erases, and max_allocated is the process's maximum since it started, as
torch.cuda.max_memory_allocated is in verl, which never resets it.
"""
from __future__ import annotations

import torch

_carried: dict[int, int] = {}


def _index(device) -> int:
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def reset_peak(device=None) -> None:
    """torch.cuda.reset_peak_memory_stats, keeping the erased peak for max_allocated."""
    i = _index(device)
    _carried[i] = max(_carried.get(i, 0), torch.cuda.max_memory_allocated(i))
    torch.cuda.reset_peak_memory_stats(i)


def max_allocated(device=None) -> int:
    """Bytes: the most allocated on the device at any time in this process."""
    i = _index(device)
    return max(_carried.get(i, 0), torch.cuda.max_memory_allocated(i))
