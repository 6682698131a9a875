"""Training engine parity: 3 AdamW steps agree across (tp, pp, dp) layouts (with recomputation,
with gradient-accumulation fusion); the forward-only schedule at pp=2 gives the pp=1
log-probs."""
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_dist
from hybridengine.train.engine import MicroBatch, OptimConfig, TrainEngine
from hybridengine.models.attention import PackedInput
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from model_utils import save_tiny

NUM_SEQS, NUM_MICRO, STEPS = 16, 4, 3
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5, bucket_mb=0.01)


def _sequences(step):
    g = torch.Generator().manual_seed(100 + step)
    lens = torch.randint(3, 12, (NUM_SEQS,), generator=g).tolist()
    return [torch.randint(0, 97, (n,), generator=g) for n in lens]


def _microbatches(seqs, dp, dp_rank, tp):
    mine = seqs[dp_rank::dp]
    per = len(mine) // NUM_MICRO
    mbs = []
    for i in range(NUM_MICRO):
        chunk = mine[i * per:(i + 1) * per]
        ids = torch.cat(chunk)
        targets = torch.cat([torch.roll(s, -1) for s in chunk])
        mask = torch.cat([torch.arange(len(s)) < len(s) - 1 for s in chunk]).float()
        packed = PackedInput.from_lengths(ids, [len(s) for s in chunk], multiple_of=tp)
        mbs.append(MicroBatch(packed, {"targets": targets, "mask": mask}))
    return mbs


def _train(layout, model_dir, out_dir, recompute=False, wgrad_fusion=False):
    mesh = build_mesh(layout)
    # float64: the optimizer keeps fp64 masters for fp64 params, so layouts agree to ~1e-13;
    # in fp32 Adam's g/sqrt(v) turns round-off of near-zero gradients into visible drift.
    engine = TrainEngine(model_dir, mesh, sequence_parallel=True, optim=OPTIM,
                         dtype=torch.float64, recompute=recompute, wgrad_fusion=wgrad_fusion)
    history = []
    for step in range(STEPS):
        seqs = _sequences(step)
        total = sum(len(s) - 1 for s in seqs)

        def loss_fn(out, mb):
            loss = -(out["logprob"] * mb.tensors["mask"]).sum() / total
            return loss, {"loss": loss.detach()}
        mbs = _microbatches(seqs, layout.dp, mesh.dp_rank, layout.tp)
        m = engine.train_step(mbs, loss_fn)
        history.append((m["loss"] * NUM_MICRO * layout.dp, m["grad_norm"]))
    engine.save_hf(out_dir)
    return history


def _forward_only(layout, model_dir):
    """Per-token log-probs from the forward-only schedule (no optimizer) on every rank."""
    mesh = build_mesh(layout)
    engine = TrainEngine(model_dir, mesh, sequence_parallel=True)
    outs = engine.forward_only(_microbatches(_sequences(0), 1, 0, layout.tp))
    return torch.cat([o["logprob"] for o in outs]), torch.cat([o["entropy"] for o in outs])


def _worker(rank, world, layouts, model_dir, tmp):
    if world == 2:       # forward-only schedule at pp=2 (and tp=2) against pp=1, on every rank
        ref = torch.load(f"{tmp}/forward_only_ref.pt")
        for lay in [(1, 2, 1), (2, 1, 1)]:
            logp, ent = _forward_only(Layout(*lay), model_dir)
            assert (logp - ref[0]).abs().max() < 1e-5 and (ent - ref[1]).abs().max() < 1e-5, lay
    for i, lay in enumerate(layouts):
        # a 4th element: the same layout with activation recomputation ("recompute"), or with
        # the weight gradients accumulated by their GEMMs ("wgrad": parallel.wgrad_accumulation;
        # at pp 2, 1F1B runs two forwards before their backwards)
        hist = _train(Layout(*lay[:3]), model_dir, f"{tmp}/out_{lay}", recompute="recompute" in
                      lay[3:], wgrad_fusion="wgrad" in lay[3:])
        if rank == 0:
            with open(f"{tmp}/hist_{lay}.json", "w") as f:
                json.dump(hist, f)


def _compare(tmp, lay, ref_hist, ref_params):
    hist = json.load(open(f"{tmp}/hist_{lay}.json"))
    for (l1, g1), (l0, g0) in zip(hist, ref_hist):
        assert abs(l1 - l0) <= 1e-5 * abs(l0), (lay, l1, l0)
        assert abs(g1 - g0) <= 1e-5 * abs(g0), (lay, g1, g0)
    params = {}
    for f in sorted((tmp / f"out_{lay}").glob("*.safetensors")):
        params.update(load_file(str(f)))
    assert params.keys() == ref_params.keys()
    for k, v in ref_params.items():
        err = ((params[k] - v).abs().max() / v.abs().max()).item()
        assert err < 1e-5, (lay, k, err)


@pytest.mark.multiproc
def test_three_adamw_steps_agree_across_layouts(tmp_path):
    model_dir = save_tiny(tmp_path / "m", "qwen2", tied=True, layers=4)
    torch.save(_forward_only(Layout(1, 1, 1), model_dir), tmp_path / "forward_only_ref.pt")
    ref_hist = _train(Layout(1, 1, 1), model_dir, tmp_path / "ref")
    ref_params = load_file(str(next((tmp_path / "ref").glob("*.safetensors"))))
    two = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
    four = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 2, 1, "recompute"),
            (2, 2, 1, "wgrad")]
    run_dist(_worker, 2, two, model_dir, tmp_path)
    run_dist(_worker, 4, four, model_dir, tmp_path)
    for lay in two + four:
        _compare(tmp_path, lay, ref_hist, ref_params)


def test_recompute_keeps_only_layer_inputs_for_backward(tmp_path, one_thread):
    """With recomputation a layer saves its input for backward, not its activations; the
    gradients are the same."""
    model_dir = save_tiny(tmp_path / "m", "qwen2", tied=True, layers=4)
    mbs = _microbatches(_sequences(0), 1, 0, 1)
    saved, grads = {}, {}
    for recompute in (False, True):
        engine = TrainEngine(model_dir, build_mesh(Layout(1, 1, 1)), dtype=torch.float64,
                             recompute=recompute)
        engine.model.requires_grad_(True).train()
        nbytes = []

        def pack(t):
            nbytes.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = engine.model(mbs[0].packed)
        hidden.pow(2).sum().backward()
        saved[recompute] = sum(nbytes)
        grads[recompute] = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    assert saved[True] < saved[False] / 4, saved
    for name, g in grads[False].items():
        assert torch.allclose(grads[True][name], g, rtol=1e-12, atol=1e-14), name


def _host_reads_worker(rank, world, model_dir, counts):
    """Host reads of tensor values (each a device sync on GPU) in train_step, by micro-batches."""
    mesh = build_mesh(Layout(1, 1, 1))
    engine = TrainEngine(model_dir, mesh, optim=OPTIM)
    reads = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in ("__float__", "item", "tolist")}

    def counting(name):
        def read(self, *a, **kw):
            # CPU attention reads each micro-batch's sequence bounds; CUDA's varlen kernel not
            if sys._getframe(1).f_code.co_name != "_per_sequence":
                reads["n"] += 1
            return originals[name](self, *a, **kw)
        return read
    for num_micro in (2, 8):
        seqs = _sequences(0)[:num_micro]
        mbs = [MicroBatch(PackedInput.from_lengths(s, [len(s)]),
                          {"targets": torch.roll(s, -1)}) for s in seqs]

        def loss_fn(out, mb):
            loss = -out["logprob"].mean()
            return loss, {"loss": loss.detach(), "tokens": float(mb.num_tokens)}
        reads["n"] = 0
        for name in originals:
            setattr(torch.Tensor, name, counting(name))
        try:
            engine.train_step(mbs, loss_fn)
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
        counts.append(reads["n"])
    torch.save(counts, f"{model_dir}/reads.pt")


def test_train_step_reads_no_values_per_micro_batch(tmp_path):
    """Metrics stay on the device until the step ends: the host reads as many values for 8
    micro-batches as for 2 (on GPU a read per micro-batch would stall the queue every time)."""
    model_dir = save_tiny(tmp_path / "m", "qwen2", tied=False)
    run_dist(_host_reads_worker, 1, str(model_dir), [])
    two, eight = torch.load(f"{model_dir}/reads.pt")
    assert two == eight, (two, eight)
