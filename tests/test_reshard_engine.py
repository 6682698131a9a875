"""HybridEngine on one process: rollout dtype casts, hooks and their order, kept weights, and
one-line errors for misuse."""
import pytest
import torch

from hybridengine.hybrid.reshard import HybridEngine
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.parallel.layout import GenLayout, Layout
from hybridengine.parallel.mesh import build_gen_mesh, build_mesh

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, attention_bias=True)


def _engine(**kw):
    layout = Layout()
    return HybridEngine(CFG, build_mesh(layout), build_gen_mesh(GenLayout(layout, 1)), **kw)


def test_rollout_dtype_is_a_cast_copy_and_memory_is_released():
    torch.manual_seed(0)
    train = Decoder(CFG)
    engine = _engine(dtype=torch.bfloat16)
    gen = engine.to_generation(train)
    for (name, g), t in zip(gen.named_parameters(), train.parameters()):
        assert g.dtype == torch.bfloat16 and torch.equal(g, t.detach().to(torch.bfloat16)), name
        assert not g.requires_grad
    assert not gen.sp and gen.pp_size == 1
    engine.to_training()
    assert all(p.is_meta for p in gen.parameters())
    metrics = engine.pop_metrics()
    assert set(metrics) == {"timing_s/reshard", "reshard/bytes_per_rank", "reshard/collectives",
                            "reshard/peak_memory_gb"}
    assert metrics["reshard/bytes_per_rank"] == 0 and metrics["timing_s/reshard"] > 0
    assert engine.pop_metrics() == {}


def test_hooks_run_around_the_rollout_in_order():
    calls = []
    engine = _engine(offload=lambda: calls.append("offload"), reload=lambda: calls.append("reload"))
    train = Decoder(CFG)
    engine.to_generation(train)
    calls.append("rollout")
    engine.to_training()
    assert calls == ["offload", "rollout", "reload"]
    assert engine.reports[0].offload_seconds >= 0 and engine.reports[0].direction == "to_generation"


def test_kept_weights_keep_their_addresses_and_follow_training():
    train = Decoder(CFG)
    engine = _engine(dtype=torch.bfloat16, keep_weights=True)
    gen = engine.to_generation(train)
    before = {n: p.data_ptr() for n, p in gen.named_parameters()}
    engine.to_training()
    with torch.no_grad():
        for p in train.parameters():
            p.add_(1.0)
    gen = engine.to_generation(train)
    for (name, g), t in zip(gen.named_parameters(), train.parameters()):
        assert g.data_ptr() == before[name], name
        assert torch.equal(g, t.detach().to(torch.bfloat16)), name
    engine.to_training()


def test_misuse_is_one_clear_error():
    with pytest.raises(ValueError, match="reshard_mode"):
        _engine(mode="fast")
    with pytest.raises(ValueError, match="reshard_bucket_mb"):
        _engine(bucket_mb=0)
    critic = Decoder(CFG, value_head=True)          # no language-model head: cannot generate
    with pytest.raises(ValueError, match="lm_head.weight"):
        _engine().to_generation(critic)
    engine = _engine()
    engine.to_generation(Decoder(CFG))
    with pytest.raises(RuntimeError, match="twice"):
        engine.to_generation(Decoder(CFG))
    engine.to_training()
    with pytest.raises(RuntimeError, match="without a preceding"):
        engine.to_training()
    with pytest.raises(ValueError, match="does not belong"):
        HybridEngine(CFG, build_mesh(Layout()), build_gen_mesh(GenLayout(Layout(), 1)).__class__(
            build_gen_mesh(GenLayout(Layout(), 1)).gen_layout, rank=3))


MOE = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, model_type="qwen3_moe", qk_norm=True,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
                  mlp_only_layers=(1,))


@pytest.mark.parametrize("mode", ["zero_redundancy", "naive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_experts_switch_as_one_view(dtype, mode):
    """The plan moves experts one by one; the generation model's stacked experts are one view
    of them: the training stacks themselves when nothing moves (zero-copy), else one run of
    the arena, refilled in place when the weights are kept."""
    torch.manual_seed(1)
    train = Decoder(MOE)
    layout = Layout()
    engine = HybridEngine(MOE, build_mesh(layout), build_gen_mesh(GenLayout(layout, 1)),
                          dtype=dtype, keep_weights=True, mode=mode)
    stacks = [n for n, _ in train.named_parameters() if ".experts." in n]
    assert stacks == ["layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj"]
    for step in range(2):
        gen = engine.to_generation(train)
        got, want = dict(gen.named_parameters()), dict(train.named_parameters())
        assert got.keys() == want.keys()
        for n in stacks:
            assert torch.equal(got[n], want[n].detach().to(dtype)) and got[n].is_contiguous()
            assert (got[n].data_ptr() == want[n].data_ptr()) == (dtype == torch.float32)
        if step == 0:
            before = {n: got[n].data_ptr() for n in stacks}
        assert all(got[n].data_ptr() == before[n] for n in stacks)
        engine.to_training()
        with torch.no_grad():
            for n in stacks:
                want[n].add_(1.0)
