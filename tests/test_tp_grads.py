"""Gradients at tp=2 with sequence parallelism equal the single-process gradients."""
import pytest
import torch

from dist_utils import run_dist
from hybridengine.models.attention import PackedInput
from hybridengine.models.hf import _gather_full, load_decoder
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from hybridengine.parallel.tensor import sync_sequence_parallel_grads
from model_utils import save_tiny

LENGTHS = [9, 6, 12]


def _loss_and_grads(model, tp):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (sum(LENGTHS),), generator=g)
    packed = PackedInput.from_lengths(ids, LENGTHS, multiple_of=tp)
    targets = torch.nn.functional.pad(torch.roll(ids, -1), (0, packed.num_pad))
    model.zero_grad()
    hidden = model(packed)
    if model.value_head is not None:
        out = packed.strip(model.values(hidden))
        loss = (out * torch.linspace(-1, 1, out.shape[0])).sum()
    else:
        logp, ent = model.logprob_entropy(hidden, targets)
        loss = -packed.strip(logp).sum() + 0.1 * packed.strip(ent).sum()
    loss.backward()
    sync_sequence_parallel_grads(model, model.tp_group)
    grads = {}
    for name, p in model.named_parameters():
        grads.update(_gather_full(model, name, p.grad))
    return loss.detach(), grads


def _worker(rank, world, model_dir, ref):
    mesh = build_mesh(Layout(2, 1, 1))
    for value_head in (False, True):
        model = load_decoder(model_dir, mesh, sequence_parallel=True, value_head=value_head,
                             dtype=torch.float64)
        with torch.no_grad():
            if value_head:
                model.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
        loss, grads = _loss_and_grads(model, 2)
        ref_loss, ref_grads = ref[value_head]
        assert torch.allclose(loss, ref_loss, rtol=1e-10)
        assert grads.keys() == ref_grads.keys()
        for k in ref_grads:
            assert grads[k].shape == ref_grads[k].shape, (k, grads[k].shape, ref_grads[k].shape)
            err = (grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max().clamp_min(1e-30)
            assert err < 1e-5, f"{k} value_head={value_head}: {err}"


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["qwen2"])
def test_tp2_sp_gradients_equal_tp1(tmp_path, kind):
    d = save_tiny(tmp_path / kind, kind, tied=True)
    ref = {}
    for value_head in (False, True):
        model = load_decoder(d, value_head=value_head, dtype=torch.float64)
        with torch.no_grad():
            if value_head:
                model.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
        ref[value_head] = _loss_and_grads(model, 1)
    run_dist(_worker, 2, d, ref)
