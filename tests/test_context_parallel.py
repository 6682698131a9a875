"""Context-parallel attention (hybridengine.parallel.context, issue 28): on 4 gloo ranks (cp 4,
and cp 2 in two groups), a packed batch of uneven sequences split over the CP group (two
mirrored chunks per rank), the outputs and the q/k/v gradients of Ulysses and all-gather
attention equal one process's packed causal attention (fp64), with grouped-query heads."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_dist
from hybridengine.models.attention import PackedCausalAttention, PackedInput
from hybridengine.parallel.context import CPAttention, shard_packed

LENGTHS = [13, 5, 22, 1, 9]
HQ, HKV, D = 8, 4, 16


def _inputs():
    g = torch.Generator().manual_seed(0)
    t = sum(LENGTHS)
    q, k, v, w = (torch.randn(t, h, D, generator=g, dtype=torch.float64)
                  for h in (HQ, HKV, HKV, HQ))
    return q, k, v, w


def _packed_attention(cu: torch.Tensor, max_len: int):
    return PackedCausalAttention(PackedInput(torch.zeros(int(cu[-1]), dtype=torch.long),
                                             torch.zeros(int(cu[-1]), dtype=torch.long),
                                             cu, max_len))


def _reference():
    q, k, v, w = (x.clone().requires_grad_(i < 3) for i, x in enumerate(_inputs()))
    packed = PackedInput.from_lengths(torch.zeros(sum(LENGTHS), dtype=torch.long), LENGTHS)
    out = PackedCausalAttention(packed).attend(0, q, k, v)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank, world, ref):
    # cp 4 over the world, then cp 2 in two groups of two (every rank builds every group)
    groups = [dist.new_group(list(range(world)))] + [dist.new_group(r) for r in ([0, 1], [2, 3])]
    _check(groups[0], world, rank, ref)
    _check(groups[1 + rank // 2], 2, rank % 2, ref)


def _check(group, cp, rank, ref):
    out_ref, dq_ref, dk_ref, dv_ref = ref
    cu = PackedInput.from_lengths(torch.zeros(1), LENGTHS).cu_seqlens
    shard = shard_packed(cu, cp, rank)
    real = shard.source >= 0
    mine = shard.source[real]
    for mode in ("ulysses", "allgather"):
        q, k, v, w = (shard.take(x) for x in _inputs())
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        out = CPAttention(shard, group, mode, inner=_packed_attention).attend(0, q, k, v)
        assert out.shape == q.shape
        torch.testing.assert_close(out[real], out_ref[mine], rtol=1e-6, atol=1e-12)
        (out * w).sum().backward()
        # every rank's queries reach this rank's keys: gradients summed over the group
        for got, want in ((q.grad, dq_ref), (k.grad, dk_ref), (v.grad, dv_ref)):
            torch.testing.assert_close(got[real], want[mine], rtol=1e-6, atol=1e-12)
    # the split: every real token once, each rank the same number of tokens, positions right
    counts = torch.tensor([shard.num_tokens])
    dist.all_reduce(counts, group=group)
    assert counts.item() == cp * shard.num_tokens
    assert torch.equal(shard.positions[real], PackedInput.from_lengths(
        torch.zeros(sum(LENGTHS)), LENGTHS).position_ids[mine])


@pytest.mark.multiproc
def test_context_parallel_attention_equals_one_process():
    run_dist(_worker, 4, _reference())


def test_shard_is_load_balanced_and_complete():
    cu = PackedInput.from_lengths(torch.zeros(1), LENGTHS).cu_seqlens
    shards = [shard_packed(cu, 4, r) for r in range(4)]
    seen = torch.cat([s.source[s.source >= 0] for s in shards]).sort().values
    assert torch.equal(seen, torch.arange(sum(LENGTHS)))
    # causal work per rank (keys each query sees, padding included) is equal
    work = [int((s.positions + 1).sum()) for s in shards]
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="not one of"):
        CPAttention(shards[0], None, "ring")
