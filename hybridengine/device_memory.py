"""The run's peak device memory across the resets that measure one phase alone.

torch keeps one allocation peak per device. The rollout resets it to measure its prefill's
working set (rollout.model_runner sizes the KV cache from that), which erased what came before
in the step: the reshard's peak went missing from perf/max_memory_allocated_gb. reset_peak
carries the peak it erases, and max_allocated is the process's maximum since it started, as
torch.cuda.max_memory_allocated is in verl, which never resets it.

start_window / window_peak measure one span (a trainer phase: perf/max_memory_allocated_gb/
<phase>) on top of that: the window's peak survives the resets inside it too, and max_allocated
keeps its process-wide meaning. Windows do not nest.
"""
from __future__ import annotations

import torch

_carried: dict[int, int] = {}      # device -> the process's peak before the last reset
_carried_reserved: dict[int, int] = {}     # the same of the caching allocator's reserved bytes
_window: dict[int, int] = {}       # device -> the open window's peak before the last reset


def _index(device) -> int:
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def reset_peak(device=None) -> None:
    """torch.cuda.reset_peak_memory_stats, keeping the erased peak for max_allocated."""
    i = _index(device)
    erased = torch.cuda.max_memory_allocated(i)
    _carried[i] = max(_carried.get(i, 0), erased)
    _window[i] = max(_window.get(i, 0), erased)
    _carried_reserved[i] = max(_carried_reserved.get(i, 0), torch.cuda.max_memory_reserved(i))
    torch.cuda.reset_peak_memory_stats(i)


def start_window(device=None) -> None:
    """Open a window: window_peak counts from now (the peak so far carried, then reset)."""
    reset_peak(device)
    _window[_index(device)] = 0


def max_allocated(device=None) -> int:
    """Bytes: the most allocated on the device at any time in this process."""
    i = _index(device)
    return max(_carried.get(i, 0), torch.cuda.max_memory_allocated(i))


def max_reserved(device=None) -> int:
    """Bytes: the most the caching allocator held on the device at any time in this process
    (allocated, cached free blocks, and CUDA graphs' private pools, which replays use without
    allocating: train.cuda_graphs)."""
    i = _index(device)
    return max(_carried_reserved.get(i, 0), torch.cuda.max_memory_reserved(i))


def window_peak(device=None) -> int:
    """Bytes: the most allocated on the device since start_window."""
    i = _index(device)
    return max(_window.get(i, 0), torch.cuda.max_memory_allocated(i))
