"""Context-parallel attention (hybridengine.parallel.context, issue 28): on 4 gloo ranks (cp 4,
and cp 2 in two groups), a packed batch of uneven sequences split over the CP group (two
mirrored chunks per rank), the outputs and the q/k/v gradients of Ulysses, all-gather and ring
attention equal one process's packed causal attention (fp64), with grouped-query heads (2 K/V
heads at cp 4: Ulysses repeats them). Then the training engine with CP against cp 1, and the
layout arithmetic of CP ranks."""
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from dist_utils import run_dist
from hybridengine.models.attention import PackedCausalAttention, PackedInput
from hybridengine.parallel.context import CPAttention, shard_packed
from hybridengine.parallel.layout import GenLayout, Layout
from hybridengine.parallel.mesh import build_mesh
from hybridengine.train.engine import MicroBatch, OptimConfig, TrainEngine
from model_utils import rel_err, save_tiny

LENGTHS = [13, 5, 22, 1, 9]
HQ, D = 8, 16
KV_HEADS = (4, 2)


def _inputs(hkv):
    g = torch.Generator().manual_seed(0)
    t = sum(LENGTHS)
    q, k, v, w = (torch.randn(t, h, D, generator=g, dtype=torch.float64)
                  for h in (HQ, hkv, hkv, HQ))
    return q, k, v, w


def _packed_attention(cu: torch.Tensor, max_len: int):
    return PackedCausalAttention(PackedInput(torch.zeros(int(cu[-1]), dtype=torch.long),
                                             torch.zeros(int(cu[-1]), dtype=torch.long),
                                             cu, max_len))


def _reference(hkv):
    q, k, v, w = (x.clone().requires_grad_(i < 3) for i, x in enumerate(_inputs(hkv)))
    packed = PackedInput.from_lengths(torch.zeros(sum(LENGTHS), dtype=torch.long), LENGTHS)
    out = PackedCausalAttention(packed).attend(0, q, k, v)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank, world, ref):
    # cp 4 over the world, then cp 2 in two groups of two (every rank builds every group)
    groups = [dist.new_group(list(range(world)))] + [dist.new_group(r) for r in ([0, 1], [2, 3])]
    _check(groups[0], world, rank, ref)
    _check(groups[1 + rank // 2], 2, rank % 2, ref)


def _check(group, cp, rank, refs):
    for hkv, multiple_of in zip(KV_HEADS, (1, 3)):
        shard = _check_heads(group, cp, rank, refs[hkv], hkv, multiple_of)
        assert shard.num_tokens % multiple_of == 0


def _check_heads(group, cp, rank, ref, hkv, multiple_of):
    out_ref, dq_ref, dk_ref, dv_ref = ref
    cu = PackedInput.from_lengths(torch.zeros(1), LENGTHS).cu_seqlens
    shard = shard_packed(cu, cp, rank, multiple_of)
    real = shard.source >= 0
    mine = shard.source[real]
    for mode in ("ulysses", "allgather", "ring"):
        q, k, v, w = (shard.take(x) for x in _inputs(hkv))
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        out = CPAttention(shard, group, mode, inner=_packed_attention).attend(0, q, k, v)
        assert out.shape == q.shape
        torch.testing.assert_close(out[real], out_ref[mine], rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(shard.gather(out.detach(), group), out_ref, rtol=1e-6,
                                   atol=1e-12)
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
    return shard


@pytest.mark.multiproc
def test_context_parallel_attention_equals_one_process():
    run_dist(_worker, 4, {hkv: _reference(hkv) for hkv in KV_HEADS})


def test_shard_is_load_balanced_and_complete():
    cu = PackedInput.from_lengths(torch.zeros(1), LENGTHS).cu_seqlens
    shards = [shard_packed(cu, 4, r) for r in range(4)]
    seen = torch.cat([s.source[s.source >= 0] for s in shards]).sort().values
    assert torch.equal(seen, torch.arange(sum(LENGTHS)))
    # causal work per rank (keys each query sees, padding included) is equal
    work = [int((s.positions + 1).sum()) for s in shards]
    assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="not one of"):
        CPAttention(shards[0], None, "p2p_a2a")


# --- the training engine under context parallelism -------------------------------------------

NUM_SEQS, NUM_MICRO, STEPS = 8, 2, 3
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5, bucket_mb=0.01)
# (tp, pp, cp, attention) on 4 ranks; dp fills the rest. With pp > 1 only the training steps
ENGINE_LAYOUTS = [(1, 1, 2, "ulysses"), (1, 1, 4, "ulysses"), (2, 1, 2, "ulysses"),
                  (1, 1, 2, "allgather"), (1, 1, 4, "allgather"), (2, 1, 2, "allgather"),
                  (1, 1, 4, "ring"), (2, 1, 2, "ring"), (1, 2, 2, "ring")]


def _sequences(step):
    g = torch.Generator().manual_seed(200 + step)
    lens = torch.randint(2, 23, (NUM_SEQS,), generator=g).tolist()     # uneven, some < 2·cp
    return [torch.randint(0, 97, (n,), generator=g) for n in lens]


def _microbatches(seqs, dp=1, dp_rank=0, tp=1):
    mine = seqs[dp_rank::dp]
    per = len(mine) // NUM_MICRO
    mbs = []
    for i in range(NUM_MICRO):
        chunk = mine[i * per:(i + 1) * per]
        targets = torch.cat([torch.roll(s, -1) for s in chunk])
        mask = torch.cat([torch.arange(len(s)) < len(s) - 1 for s in chunk]).double()
        packed = PackedInput.from_lengths(torch.cat(chunk), [len(s) for s in chunk],
                                          multiple_of=tp)
        mbs.append(MicroBatch(packed, {"targets": targets, "mask": mask}))
    return mbs


def _loss_fn(total):
    def loss_fn(out, mb):
        mask = mb.tensors["mask"]
        loss = -((out["logprob"] + 0.1 * out["entropy"]) * mask).sum() / total
        return loss, {"loss": loss.detach()}
    return loss_fn


def _engine(layout, model_dir, optim=None):
    return TrainEngine(model_dir, build_mesh(layout), sequence_parallel=True, optim=optim,
                       dtype=torch.float64)


def _outputs(engine, mbs):
    """Per micro-batch: full logits, log-probs, entropy; and the gradient of the loss (weights
    summed over the CP group: tp = 1 only)."""
    engine.model.requires_grad_(True)
    views = engine._cp_views(mbs)
    total = sum(int(mb.tensors["mask"].sum()) for mb in mbs)
    result = []
    for mb, view in zip(mbs, views):
        assert (view is None) == (engine.mesh.cp == 1)
        packed, ctx = (mb.packed, None) if view is None else (view.packed, view.attention)
        with torch.no_grad():
            logits = engine.model.logits(engine.model(packed, None, attn_ctx=ctx))
            logits = mb.packed.strip(logits) if view is None else view.gather(logits)
        out = engine._stage_outputs(mb, None, view)
        _loss_fn(total)(out, mb)[0].backward()
        result.append((logits.detach(), out["logprob"].detach(), out["entropy"].detach()))
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    if engine.mesh.cp > 1 and engine.mesh.tp == 1:
        for g in grads.values():
            dist.all_reduce(g, group=engine.mesh.cp_group)
    return result, grads


def _train(layout, model_dir, out_dir):
    engine = _engine(layout, model_dir, OPTIM)
    history = []
    for step in range(STEPS):
        seqs = _sequences(step)
        total = sum(len(s) - 1 for s in seqs)
        mbs = _microbatches(seqs, layout.dp, engine.mesh.dp_rank, layout.tp)
        m = engine.train_step(mbs, _loss_fn(total))
        history.append((m["loss"] * NUM_MICRO * layout.dp, m["grad_norm"]))
    engine.save_hf(out_dir)
    return history


def _saved(out_dir) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out_dir.glob("*.safetensors"))
            for k, v in load_file(str(f)).items()}


def _check_outputs(engine, ref_outputs, ref_grads):
    outputs, grads = _outputs(engine, _microbatches(_sequences(0), tp=engine.mesh.tp))
    layout = engine.mesh.layout
    for got, want in zip(outputs, ref_outputs):
        for g, w in zip(got, want):
            assert rel_err(g, w) < 1e-6, (layout, rel_err(g, w))
    if layout.tp == 1:
        for name, g in grads.items():
            assert rel_err(g, ref_grads[name]) < 1e-6, (layout, name, rel_err(g, ref_grads[name]))


def _engine_worker(rank, world, model_dir, ref, tmp):
    ref_outputs, ref_grads, ref_history, ref_params = ref
    for tp, pp, cp, attention in ENGINE_LAYOUTS:
        layout = Layout(tp, pp, world // (tp * pp * cp), True, cp, attention)
        name = f"cp_{tp}_{pp}_{cp}_{attention}"
        if pp == 1:
            _check_outputs(_engine(layout, model_dir), ref_outputs, ref_grads)
        history = _train(layout, model_dir, tmp / name)
        for (loss, norm), (loss0, norm0) in zip(history, ref_history):
            assert abs(loss - loss0) <= 1e-6 * abs(loss0) and abs(norm - norm0) <= 1e-6 * norm0, \
                (layout, loss, loss0, norm, norm0)
        if rank == 0:
            params = _saved(tmp / name)
            assert params.keys() == ref_params.keys()
            for k, v in ref_params.items():
                assert rel_err(params[k], v) < 1e-6, (layout, k)


@pytest.mark.multiproc
def test_engine_with_context_parallelism_equals_cp1(tmp_path):
    """Logits, log-probs, entropy and gradients with cp 2 and 4 (alone and with tp 2, sequence
    parallel), Ulysses, all-gather and ring, equal one process's on packed batches of uneven
    lengths; 3 AdamW steps give the same losses, grad norms and weights (fp64), also with pp 2."""
    model_dir = save_tiny(tmp_path / "m", "qwen2", tied=True, layers=2)
    one = Layout()
    outputs, grads = _outputs(_engine(one, model_dir), _microbatches(_sequences(0)))
    history = _train(one, model_dir, tmp_path / "ref")
    params = _saved(tmp_path / "ref")
    run_dist(_engine_worker, 4, model_dir, (outputs, grads, history, params), tmp_path)


@pytest.mark.parametrize("tp, pp, dp, cp, gen_tp", [
    (2, 1, 1, 2, 1), (2, 2, 1, 2, 2), (1, 2, 2, 2, 1), (2, 1, 2, 2, 2), (4, 1, 1, 2, 2),
    (1, 1, 2, 4, 1)])
def test_cp_ranks_are_replicas(tp, pp, dp, cp, gen_tp):
    """Megatron's order (tp fastest, then cp, dp, pp); the dp·cp replicas of (tp, pp, dp, cp)
    have the gradient, model-parallel and generation groups of (tp, pp, dp·cp)."""
    lay, flat = Layout(tp, pp, dp, cp=cp), Layout(tp, pp, dp * cp)
    for rank in range(lay.world_size):
        p, d, t = lay.coords(rank)
        c = lay.cp_rank(rank)
        assert rank == lay.rank(p, d, t, c) == ((p * dp + d) * cp + c) * tp + t
    for groups, size in ((lay.cp_groups(), cp), (lay.dp_groups(), dp), (lay.tp_groups(), tp)):
        assert sorted(r for g in groups for r in g) == list(range(lay.world_size))
        assert all(len(g) == size for g in groups)
    for g in lay.cp_groups():
        assert len({lay.coords(r) for r in g}) == 1 and \
            sorted(lay.cp_rank(r) for r in g) == list(range(cp))
    assert lay.dp_cp_groups() == flat.dp_groups() and lay.mp_groups() == flat.mp_groups()
    gen, gen_flat = GenLayout(lay, gen_tp), GenLayout(flat, gen_tp)
    assert gen.dp == gen_flat.dp == dp * cp * tp * pp // gen_tp
    assert gen.gen_tp_groups() == gen_flat.gen_tp_groups()
    assert gen.micro_dp_groups() == gen_flat.micro_dp_groups()
    assert [gen.coords(r) for r in range(lay.world_size)] == \
        [gen_flat.coords(r) for r in range(lay.world_size)]
