"""The KV cache: slot bookkeeping (pure Python) and the device tensors.

Layout: one row ("slot") of max_model_len tokens per running sequence; per layer

    k, v  [num_slots + 1, max_model_len, h_kv, d]

Token t of the sequence in slot s lives at [s, t], i.e. at flat index s·max_model_len + t of
the layer's [(num_slots + 1)·max_model_len, h_kv, d] view: the packed-varlen layout that flash
attention reads with cu_seqlens_k = slot·max_model_len and seqused_k = length; gathered rows
transposed to [B, h_kv, L, d] serve masked SDPA. The extra last slot is scratch: padding rows
of a CUDA-graph bucket write there. A paged cache (vLLM) would also lend the rows' unused tails
to other sequences; rollouts cap prompt + response at max_model_len, static rows keep every
decode shape fixed for the graphs, and they need no block table, which the varlen kernel of an
older torch (2.11 on the GPU machine) may not take.

The budget is a token count, or on CUDA a share of device memory (like vLLM's
gpu_memory_utilization) minus what is allocated now, the measured activation peak and
DEVICE_RESERVE of the device.
"""
from __future__ import annotations

import heapq

import torch

# share of device memory a CUDA cache budget leaves free: the decode graphs' pool, the
# allocator's fragmentation and NCCL (the model runner and train.memory_plan both subtract it,
# so that the plan's KV slots are the runner's)
DEVICE_RESERVE = 0.05


class SlotAllocator:
    """Free list of cache slots; the lowest free slot first, so that running sequences stay
    packed at low slot numbers (decode rows are sorted by slot)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV-cache slot (check can_allocate first)")
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise RuntimeError(f"slot {slot} is not allocated")
        heapq.heappush(self._free, slot)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """K and V of one token over this rank's layers and KV heads."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def plan_num_slots(max_num_seqs: int, max_model_len: int, bytes_per_token: int,
                   kv_cache_tokens: int | None = None, budget_bytes: int | None = None) -> int:
    """Slots that fit the budget (tokens, else bytes, else max_num_seqs), capped at max_num_seqs;
    (num_slots + 1) rows are allocated, the extra one being scratch."""
    if kv_cache_tokens is not None:
        fit = kv_cache_tokens // max_model_len - 1
        what = f"kv_cache_tokens={kv_cache_tokens}"
    elif budget_bytes is not None:
        fit = budget_bytes // (bytes_per_token * max_model_len) - 1
        what = (f"the KV-cache budget ({budget_bytes / 2**30:.2f} GiB = gpu_memory_utilization "
                f"· device memory - memory in use - activation peak)")
    else:
        return max_num_seqs
    if fit < 1:
        raise ValueError(f"{what} holds no sequence of max_model_len={max_model_len} tokens "
                         f"({bytes_per_token} bytes per token); raise the budget or lower "
                         f"max_model_len")
    return min(max_num_seqs, fit)


def check_fits_device(num_bytes: int, kv_cache_tokens: int | None, device) -> None:
    """An explicit kv_cache_tokens whose cache (num_bytes) exceeds the device's free memory:
    one clear error instead of an out-of-memory part way through the layers' allocation (the
    budget path sizes itself from the free memory)."""
    if kv_cache_tokens is None or torch.device(device).type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if num_bytes > free:
        raise ValueError(f"kv_cache_tokens={kv_cache_tokens} needs {num_bytes / 2**30:.2f} GiB "
                         f"of KV cache but {free / 2**30:.2f} GiB of the device are free; lower "
                         f"it, or leave it unset to size the cache by gpu_memory_utilization")


def layer_tensors(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                  device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V tensors of `shape` for each layer (the static and the paged cache). Zeros, not
    empty: masked SDPA multiplies masked positions by probability 0, and uninitialised memory
    may hold NaN bit patterns (0 · NaN = NaN)."""
    return ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])


class KVCache:
    """Device tensors of the cache, one K and one V tensor per layer (a mutation under
    torch.compile then touches one whole input, never a view of a shared base)."""

    def __init__(self, num_layers: int, num_slots: int, max_model_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_slots, self.max_model_len = num_slots, max_model_len
        self.scratch_slot = num_slots
        self.k, self.v = layer_tensors(num_layers, (num_slots + 1, max_model_len, num_kv_heads,
                                                    head_dim), dtype, device)

    @property
    def num_bytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.k)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K, V as [(num_slots + 1)·max_model_len, h_kv, d] (packed-varlen view)."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """slots, positions [N] int64; k, v [N, h_kv, d]."""
        write_rows(self.k[layer], self.v[layer], slots, positions, k, v)

    def gather_slots(self, layer: int, slots: torch.Tensor, max_len: int):
        """K, V of the given slots' first max_len positions as [B, h_kv, max_len, d] (copies)."""
        k = self.k[layer][:, :max_len].index_select(0, slots)               # [B, L, h_kv, d]
        v = self.v[layer][:, :max_len].index_select(0, slots)
        return k.transpose(1, 2), v.transpose(1, 2)


def write_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One layer's cache rows [slots[i], positions[i]] = k[i], v[i] (KVCache.write)."""
    k_cache[slots, positions] = k.to(k_cache.dtype)
    v_cache[slots, positions] = v.to(v_cache.dtype)
