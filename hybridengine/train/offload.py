"""Park device tensors in host memory between the phases that use them, and bring them back.

    parking = HostParking(optimizer_state_tensors)        # once: which storages
    parking.park()      # device memory freed (storage resized to 0); values kept on the host
    parking.unpark()    # same storages re-allocated, values copied back

What moves is the tensors' *storages*, resized in place (as FSDP frees its flat parameters):
every view of them (a parameter's `main_grad`, an optimizer's slices of its buckets, an nn.Module's
parameters) stays the same Python object and is valid again after unpark(), at a new address.
Nothing may touch a parked tensor: its storage holds zero bytes and kernels do not check (a read
is undefined behaviour, on CPU a crash). Owners check `parked` before they use them
(TrainEngine.require).

keep_values=False is for buffers that hold nothing between uses (gradient buckets: zeroed at the
start of every update): park() frees them without a copy, unpark() re-allocates and zeroes them,
so parking costs no host memory and no PCIe traffic.

On CUDA the host buffers are pinned, allocated at the first park and reused, and both copies are
asynchronous on the current stream; park() waits for its copies before it frees the device
memory (the caching allocator would otherwise hand the blocks out while the copy still reads
them).
"""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch


class HostParking:
    """The storages of `tensors` (each once, however many tensors view it)."""

    def __init__(self, tensors: Iterable[torch.Tensor], keep_values: bool = True,
                 name: str = "tensors"):
        self.name, self.keep_values = name, keep_values
        self._storages: list[torch.UntypedStorage] = []
        self._nbytes: list[int] = []
        seen = set()
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            if not s.resizable():
                raise ValueError(f"cannot offload {self.name}: a storage of {s.nbytes()} bytes "
                                 f"is not resizable (memory not owned by torch, e.g. mmap)")
            seen.add(s.data_ptr())
            self._storages.append(s)
            self._nbytes.append(s.nbytes())
        self._host: list[torch.Tensor | None] = [None] * len(self._storages)   # at first park
        self._parked: list[int] = []            # indices of the storages parked now
        self.parked = False

    @property
    def nbytes(self) -> int:
        """Device bytes these storages hold when not parked."""
        return sum(self._nbytes)

    def _bytes_view(self, s: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)

    @property
    def parked_bytes(self) -> int:
        """Device bytes freed now."""
        return sum(self._nbytes[i] for i in self._parked)

    @property
    def host_bytes(self) -> int:
        """Host bytes held for these storages (allocated at the first park, kept for the next)."""
        return sum(h.numel() * h.element_size() for h in self._host if h is not None)

    @torch.no_grad()
    def park(self, skip: Iterable[torch.Tensor] = ()) -> float:
        """Copy to the host (keep_values) and free the device memory, except the storages of the
        tensors in `skip` (still in use elsewhere, e.g. shared with a generation model).
        Returns seconds."""
        if self.parked:
            return 0.0
        t0 = time.perf_counter()
        busy = {t.untyped_storage().data_ptr() for t in skip}
        self._parked = [i for i, s in enumerate(self._storages) if s.data_ptr() not in busy]
        if self.keep_values and self._parked:
            pin = self._storages[0].device.type == "cuda"
            for i in self._parked:
                s = self._storages[i]
                if self._host[i] is None:
                    self._host[i] = torch.empty(self._nbytes[i], dtype=torch.uint8,
                                                pin_memory=pin)
                self._host[i].copy_(self._bytes_view(s), non_blocking=True)
            _wait(self._storages[0].device)
        for i in self._parked:
            self._storages[i].resize_(0)
        self.parked = True
        return time.perf_counter() - t0

    @torch.no_grad()
    def unpark(self) -> float:
        """Re-allocate and restore the values (or zeros). Returns seconds."""
        if not self.parked:
            return 0.0
        t0 = time.perf_counter()
        for i in self._parked:
            s, n = self._storages[i], self._nbytes[i]
            s.resize_(n)
            view = self._bytes_view(s)
            if self.keep_values:
                view.copy_(self._host[i], non_blocking=True)
            else:
                view.zero_()
        # No wait: the host buffers stay allocated (pinned allocations are slow) and stream
        # order puts every later kernel after the copies.
        self.parked, self._parked = False, []
        return time.perf_counter() - t0


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
