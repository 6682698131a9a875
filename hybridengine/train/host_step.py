"""Host optimizer step (ZeRO-Offload style) for DistributedOptimizer(host_step=True).

Where things live
    Each bucket's fp32 master slice (this rank's ZeRO-1 shard, or the whole bucket without ZeRO)
    and both Adam moments live in host memory, moved there bucket by bucket as the optimizer is
    built (the device never holds more than one bucket's state). Everything before the update
    stays on the device and is DistributedOptimizer's own code, unchanged: gradient buckets, the
    reduction over DP, the grad norm, the non-finite guard (a refused step touches nothing: it
    returns before any of this runs) and clipping (it scales the device gradient).

    Only the CPU reads and writes the state: every copy to or from the device goes through small
    staging buffers, pinned when CUDA is available (DMA, asynchronous; plain tensors otherwise).
    So the state itself is not pinned by default (HostStep(pin_state=True) pins it): page-locking
    12 bytes per parameter would speed up no copy, takes long to allocate, and torch's pinned
    allocator rounds every block up to a power of two (up to 2x the host memory).

The step, chunk by chunk
    Every bucket's shard is cut into chunks of `chunk_numel` elements (default 2^20: 4 MB of
    fp32), taken in order over all buckets. For chunk k:

        d2h stream   gradient chunk k+1 -> pinned grad buffer (k+1) % 2   (queued before the
                                                                           update of chunk k)
        CPU          wait for gradient chunk k; AdamW on master/moments[chunk k], in place;
                     master[chunk k] -> parameter dtype into pinned out buffer k % 2 (after
                     waiting for the copy that last read that buffer, chunk k-2)
        h2d stream   out buffer k % 2 -> this rank's device shard, parameter dtype

    So while the CPU updates chunk k, the copy engines bring gradient k+1 in and take weights
    k-1 out (two streams: PCIe is full duplex). Why chunks: with one copy per shard the CPU could
    start only after the whole gradient had arrived and the device would get nothing back before
    the whole update had finished; chunked, only the first gradient chunk and the last weight
    chunk are not hidden behind the CPU's work, which is the bottleneck (the update reads and
    writes ~30 bytes per element, a copy moves 4 + 2). Double buffering keeps the pinned staging
    at two chunks per direction and dtype instead of a host copy of the whole gradient, and the
    update's temporaries cache-sized. The streams first wait for the current stream (the reduced,
    clipped gradient; the freshly allocated device shards); at the end the current stream waits
    for the h2d stream, and publish_params all-gathers the shards over DP (ZeRO-1) and writes
    them into the parameters, exactly as after a device step.

Numerics
    The update is DistributedOptimizer._adamw itself (torch's fused AdamW kernel), run on views of
    one chunk, on torch's intra-op thread pool (torch.set_num_threads). The kernel is
    elementwise, so a chunk updates bit for bit as it would inside the whole bucket; on a CPU
    model the host step equals the device step bitwise (tests/test_host_step.py). Against a CUDA
    device step, the CUDA kernel may round an ulp differently from the CPU's vector code:
    expected within 1e-6 relative on the fp32 master (the gpu-marked test in
    tests/test_host_step.py checks it). The fp32 -> bf16 cast rounds to nearest even on both.

State
    state_dict()/load_state_dict() are DistributedOptimizer's: the same keys, shapes and dtypes,
    host tensors instead of device ones, so a checkpoint resumes bit-exactly in either mode.
    There is nothing on the device to park: TrainEngine's "optimizer" part is empty.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hybridengine.train.grad_buckets import fused_adam_lists

CHUNK_NUMEL = 1 << 20      # elements per chunk (a multiple of 64: whole vector blocks)


@dataclass
class _Chunk:
    """What DistributedOptimizer._adamw reads of a bucket, for elements [lo, hi) of its shard."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    shard_grad: torch.Tensor
    adam_runs: list[tuple[bool, int, int]]          # the bucket's, cut to the chunk


class _Staging:
    """Two pinned host buffers per (direction, dtype), each with the event of the last
    asynchronous copy that used it (None on the CPU, where copies are synchronous)."""

    def __init__(self, pin: bool, numel: int):
        self.pin, self.numel = pin, numel
        self.buffers: dict[tuple, list[torch.Tensor]] = {}
        self.events: dict[tuple, list] = {}

    def get(self, key: tuple, slot: int, n: int) -> torch.Tensor:
        """Buffer `slot` of `key` = (direction, dtype), first n elements, once its last copy is
        done."""
        if key not in self.buffers:
            self.buffers[key] = [torch.empty(self.numel, dtype=key[1], pin_memory=self.pin)
                                 for _ in range(2)]
            self.events[key] = [None, None]
        self.wait(key, slot)
        return self.buffers[key][slot][:n]

    def wait(self, key: tuple, slot: int) -> None:
        event = self.events[key][slot]
        if event is not None:
            event.synchronize()
            self.events[key][slot] = None

    def mark(self, key: tuple, slot: int, stream) -> None:
        if stream is not None:
            self.events[key][slot] = stream.record_event()


class HostStep:
    """The host side of a DistributedOptimizer built with host_step=True (module docstring)."""

    def __init__(self, opt, chunk_numel: int = CHUNK_NUMEL, pin_state: bool = False):
        if chunk_numel <= 0 or chunk_numel % 64:
            raise ValueError(f"host step chunk_numel={chunk_numel} must be a positive multiple "
                             f"of 64")
        self.opt, self.chunk_numel = opt, chunk_numel
        self.pin = torch.cuda.is_available()            # the staging buffers
        self.pin_state = pin_state and self.pin
        self._staging: _Staging | None = None
        self._streams: dict[torch.device, tuple] = {}

    def adopt(self, b) -> None:
        """Move bucket b's master slice and moments to host memory (as each bucket is built)."""
        for key in ("master", "exp_avg", "exp_avg_sq"):
            t = getattr(b, key)
            if t.device.type != "cpu" or (self.pin_state and not t.is_pinned()):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_state)
                setattr(b, key, host.copy_(t))

    def host_bytes(self) -> int:
        """Host bytes of optimizer state (master slices, moments) and pinned staging buffers."""
        staging = 0 if self._staging is None else sum(
            t.numel() * t.element_size() for ts in self._staging.buffers.values() for t in ts)
        return self.opt.memory_bytes() + staging

    @torch.no_grad()
    def step(self, lr: float, count: torch.Tensor) -> list[torch.Tensor]:
        """AdamW at `lr` on the host (DistributedOptimizer.step has synced, checked and clipped
        the gradients and counted the step: `count`, 0-d on the host). Returns this rank's shard
        of every bucket with the new weights, in the parameters' dtype, on the device:
        publish_params' input."""
        return self._run(lr, count)

    @torch.no_grad()
    def stage(self) -> list[torch.Tensor]:
        """The master weights as device shards in the parameters' dtype, without an update
        (publish_params outside a step, e.g. after load_state_dict)."""
        return self._run(None)

    # ------------------------------------------------------------------------------------------
    def _run(self, lr: float | None, count: torch.Tensor | None = None) -> list[torch.Tensor]:
        buckets = self.opt.buckets
        device = buckets[0].grad.device
        need = min(self.chunk_numel, max(b.shard_numel for b in buckets))
        if self._staging is None or self._staging.numel < need:    # first step, larger chunks
            self._staging = _Staging(self.pin, need)
        d2h = h2d = None
        if device.type == "cuda":
            if device not in self._streams:
                self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            d2h, h2d = self._streams[device]
            current = torch.cuda.current_stream(device)
            d2h.wait_stream(current)        # the reduced, clipped gradient
            h2d.wait_stream(current)        # the shards' memory, fresh from the allocator
        shards = [torch.empty(b.shard_numel, dtype=b.entries[0].param.dtype, device=device)
                  for b in buckets]
        n = self.chunk_numel
        jobs = [(i, lo, min(lo + n, b.shard_numel)) for i, b in enumerate(buckets)
                for lo in range(0, b.shard_numel, n)]
        grads: list[torch.Tensor | None] = [None] * len(jobs)
        if lr is not None and jobs:
            grads[0] = self._fetch(jobs[0], 0, d2h)
        for k, (i, lo, hi) in enumerate(jobs):
            b = buckets[i]
            if lr is not None:
                if k + 1 < len(jobs):                       # its copy overlaps this update
                    grads[k + 1] = self._fetch(jobs[k + 1], (k + 1) % 2, d2h)
                self._staging.wait(("grad", b.grad.dtype), k % 2)
                chunk = _Chunk(b.master[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi],
                               grads[k], [(d, max(a, lo) - lo, min(c, hi) - lo)
                                          for d, a, c in b.adam_runs if max(a, lo) < min(c, hi)])
                grads[k] = None
                self.opt._adamw(lr, fused_adam_lists([chunk]), [count])
            key = ("out", shards[i].dtype)
            out = self._staging.get(key, k % 2, hi - lo)
            out.copy_(b.master[lo:hi])                      # cast on the host: half the bytes
            with _on(h2d):
                shards[i][lo:hi].copy_(out, non_blocking=True)
            self._staging.mark(key, k % 2, h2d)
        if h2d is not None:
            torch.cuda.current_stream(device).wait_stream(h2d)
        return shards

    def _fetch(self, job, slot: int, d2h) -> torch.Tensor:
        """Queue the copy of a chunk's gradient into pinned grad buffer `slot`; returns it (to be
        read after _staging.wait)."""
        i, lo, hi = job
        b = self.opt.buckets[i]
        key = ("grad", b.grad.dtype)
        buf = self._staging.get(key, slot, hi - lo)
        with _on(d2h):
            buf.copy_(b.shard_grad[lo:hi], non_blocking=True)
        self._staging.mark(key, slot, d2h)
        return buf


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
