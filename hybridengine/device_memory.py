"""The run's peak device memory across the resets that measure one phase alone.

torch keeps one allocation peak per device. The rollout resets it to measure its prefill's
working set (rollout.model_runner sizes the KV cache from that), which erased what came before
in the step: the reshard's peak went missing from perf/max_memory_allocated_gb. reset_peak
carries the peak it erases, and max_allocated is the process's maximum since it started, as
torch.cuda.max_memory_allocated is in verl, which never resets it.

start_window / window_peak measure one span (a trainer phase: perf/max_memory_allocated_gb/
<phase>) on top of that: the window's peak survives the resets inside it too, and max_allocated
keeps its process-wide meaning. Windows do not nest.

trainer.cuda_allocator picks the caching allocator's segments (configure_allocator):
expandable segments grow one mapping per stream instead of keeping blocks of every size that
freed memory splits into, so what the allocator reserves stays near what is allocated across
phases whose tensors differ in shape (the rollout's cache, the updates' activations).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch

# trainer.cuda_allocator (default: "default", torch's own, until a GPU run has measured the
# others): auto is expandable_segments, except with the vLLM rollout (its sleep mode's allocator
# and CUDA IPC refuse expandable segments) or where the environment already configures torch's
# allocator (the user's settings stand)
CUDA_ALLOCATORS = ("auto", "expandable_segments", "default")
ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

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


def allocator_choice(setting: str, rollout_backend: str,
                     environ: Mapping[str, str] = os.environ) -> str:
    """trainer.cuda_allocator resolved: "expandable_segments" or "default" (CUDA_ALLOCATORS)."""
    if setting != "auto":
        return setting
    if rollout_backend == "vllm" or any(environ.get(k) for k in ALLOC_CONF_ENVS):
        return "default"
    return "expandable_segments"


def configure_allocator(setting: str, rollout_backend: str, device: torch.device) -> str:
    """Switch this process's CUDA caching allocator to trainer.cuda_allocator's choice
    (allocator_choice, returned) for the segments it maps from now on (those mapped before keep
    their kind); nothing off CUDA."""
    choice = allocator_choice(setting, rollout_backend)
    if device.type == "cuda" and choice == "expandable_segments":
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return choice
