"""Adapter-only switches of a LoRA actor (hybrid.lora_switch, issue 24): with t_g < t the base's
generation shard moves once, then each switch moves only the adapter shards TP splits, and the
generation weights are W + s·B·A of the whole model's slice, switch after switch, while the
trained adapters change and the base stays bit for bit."""
import pytest
import torch

from dist_utils import run_dist
from hybridengine.hybrid.lora_switch import frozen_base
from hybridengine.hybrid.reshard import HybridEngine
from hybridengine.models.hf import load_decoder
from hybridengine.models.lora import add_lora, base_weights, lora_state_dict
from hybridengine.parallel.layout import GenLayout, Layout
from hybridengine.parallel.lora import lora_layers
from hybridengine.parallel.mesh import build_gen_mesh, build_mesh
from model_utils import save_tiny
from test_lora import ALPHA, RANK, _nonzero_b, _sharded_a, _sharded_b


def _train(model, step: int) -> None:
    """A stand-in for an optimizer step on the adapters, the same on every layout: the whole
    matrices change by a seeded amount and each rank keeps its part."""
    from hybridengine.parallel.tensor import group_rank, group_size
    tp, rank = group_size(model.tp_group), group_rank(model.tp_group)
    with torch.no_grad():
        for name, p in sorted(lora_state_dict(model).items()):
            split = _sharded_a(name) if ".lora_A." in name else _sharded_b(name)
            dim = 1 if ".lora_A." in name else 0
            shape = list(p.shape)
            shape[dim] *= tp if split else 1
            g = torch.Generator().manual_seed(sum(map(ord, name)) + 7919 * step)
            full = torch.randn(shape, generator=g, dtype=p.dtype) * 0.01
            p.add_(full.chunk(tp, dim=dim)[rank] if split else full)


def _split_bytes(model) -> int:
    """Bytes of this rank's adapter matrices that TP splits (B of column layers, A of row)."""
    return sum(p.numel() * p.element_size() for n, p in lora_state_dict(model).items()
               if (_sharded_a(n) if ".lora_A." in n else _sharded_b(n)))


def _worker(rank, world, model_dir):
    layout = Layout(tp=2, pp=1, dp=1)
    mesh, gm = build_mesh(layout), build_gen_mesh(GenLayout(layout, 1))
    plain = load_decoder(model_dir, mesh, dtype=torch.float64)
    plain_engine = HybridEngine(plain.cfg, mesh, gm, bucket_mb=0.05)
    plain_engine.to_generation(plain)
    plain_engine.to_training()
    base = plain_engine.reports[0]              # the switch of the same model without LoRA

    ref = load_decoder(model_dir, dtype=torch.float64)      # one process: the whole model
    add_lora(ref, RANK, ALPHA)
    _nonzero_b(ref)
    for keep in (False, True):
        model = load_decoder(model_dir, mesh, dtype=torch.float64)
        add_lora(model, RANK, ALPHA)
        _nonzero_b(model)
        ref_copy = {n: p.detach().clone() for n, p in lora_state_dict(ref).items()}
        base0 = {n: p.detach().clone() for n, p in frozen_base(model).items()}
        engine = HybridEngine(model.cfg, mesh, gm, bucket_mb=0.05, keep_weights=keep)
        adapter_bytes, addresses = _split_bytes(model), None     # k - 1 = 1 member's worth
        for step in range(3):
            gen = engine.to_generation(model)
            want = dict(base_weights(ref))
            for name, p in gen.named_parameters():
                w = want[name]      # the vocabulary keeps the training layout's pad rows (zero)
                assert torch.equal(p[:len(w)], w) and not p[len(w):].any(), (keep, step, name)
            got = engine.reports[-1]
            first = step == 0
            assert got.bytes_received == (base.bytes_received if first else 0) + adapter_bytes
            assert got.num_collectives == (base.num_collectives if first else 0) + 1
            merged = {n: p.data_ptr() for n, p in gen.named_parameters()
                      if n.endswith("proj.weight")}
            if keep and addresses is not None:
                assert merged == addresses          # refilled in place: CUDA graphs stay valid
            addresses = merged
            engine.to_training()
            if not keep:                            # the merged weights are released
                assert all(p.is_meta for n, p in gen.named_parameters() if n in merged)
            _train(model, step)
            _train(ref, step)
        assert all(torch.equal(p, base0[n]) for n, p in frozen_base(model).items())
        with torch.no_grad():                       # the reference for the next variant
            for n, p in lora_state_dict(ref).items():
                p.copy_(ref_copy[n])
        assert lora_layers(model)


@pytest.mark.multiproc
def test_lora_switches_move_the_base_once_then_adapters_only(tmp_path):
    d = save_tiny(tmp_path / "m", "qwen2", tied=False)
    run_dist(_worker, 2, d)
