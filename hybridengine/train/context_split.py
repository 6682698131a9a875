"""One rank's view of a packed micro-batch under context parallelism (CP, issue 28).

Every rank of a CP group is handed the same micro-batch (as TP ranks are); each runs the model on
its load-balanced share of the tokens (parallel.context.shard_packed: two mirrored chunks of every
sequence), attention spanning the group through parallel.context.CPAttention. The per-token
outputs (log-probs, entropy, values: T numbers, not activations) are then gathered, so every CP
rank sees the whole micro-batch's outputs and the caller's loss is the cp = 1 loss; the backward
of the gather keeps each rank's own rows, so a rank's weight gradients cover its tokens only and
their sum over the CP group (done with the DP sum: parallel.mesh dp_cp_group) is the cp = 1
gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridengine.models.attention import PackedCausalAttention, PackedInput
from hybridengine.parallel.context import CPAttention, CPShard, shard_packed


@dataclass
class CPView:
    """`packed`: this rank's tokens (global positions; its bounds unused: `attention` knows the
    sequences); `shard`: which tokens they are."""

    packed: PackedInput
    shard: CPShard
    attention: CPAttention

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a per-token tensor of the real tokens [T, ...]."""
        return self.shard.take(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's per-token outputs [T_r, ...] -> the real tokens' [T, ...], every rank."""
        return self.shard.gather(x, self.attention.group)


def split_for_cp(packed: PackedInput, mesh, multiple_of: int = 1) -> CPView:
    """This CP rank's view of `packed` (mesh: parallel.mesh.ParallelMesh with cp > 1); its token
    count a multiple of `multiple_of` (the sequence-parallel degree)."""
    # the sequence-parallel pad of the whole batch is dropped: each rank pads its own share
    cu = packed.cu_seqlens[:-1] if packed.num_pad else packed.cu_seqlens
    shard = shard_packed(cu, mesh.cp, mesh.cp_rank, multiple_of)
    ids = shard.take(packed.input_ids[: packed.num_tokens - packed.num_pad])
    n = shard.num_tokens
    local = PackedInput(ids, shard.positions, torch.tensor([0, n], dtype=torch.int32,
                                                          device=ids.device), n)
    attention = CPAttention(shard, mesh.cp_group, mesh.layout.cp_attention,
                            inner=_packed_attention)
    return CPView(local, shard, attention)


def _packed_attention(cu: torch.Tensor, max_len: int) -> PackedCausalAttention:
    """The packed causal attention over bounds `cu` (Ulysses: the whole padded batch)."""
    return PackedCausalAttention(PackedInput(cu.new_empty(0), cu.new_empty(0), cu, max_len))
