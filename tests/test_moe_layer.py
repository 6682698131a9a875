"""The MoE MLP (models.moe) against Hugging Face's sparse blocks (Qwen3-MoE with and without
norm_topk_prob, Mixtral) on the same weights, in its routed and its sync-free (every expert)
forms. Its tensor-parallel shards: test_moe_model (tp 2, SP on and off, float64 gradients)."""
from dataclasses import dataclass

import pytest
import torch

from hybridengine.models.moe import MoEMLP

H, I, E, K, T = 16, 12, 6, 2, 40


@dataclass(frozen=True)
class Cfg:
    model_type: str
    norm_topk_prob: bool = True
    hidden_size: int = H
    moe_intermediate_size: int = I
    num_experts: int = E
    num_experts_per_tok: int = K
    hidden_act: str = "silu"


def _hf_block(model_type: str, norm_topk_prob: bool):
    if model_type == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        return MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=I,
                                                   num_local_experts=E, num_experts_per_tok=K))
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I,
                                                 num_experts=E, num_experts_per_tok=K,
                                                 norm_topk_prob=norm_topk_prob))


def _copy_from_hf(ours: MoEMLP, hf) -> None:
    """HF 5.x keeps the experts stacked: gate_up_proj [E, 2I, H] ([gate; up]), down_proj
    [E, H, I]."""
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])


@pytest.mark.parametrize("model_type,norm", [("qwen3_moe", True), ("qwen3_moe", False),
                                             ("mixtral", True)])
def test_moe_mlp_equals_transformers(model_type, norm):
    torch.manual_seed(0)
    hf = _hf_block(model_type, norm).float()
    with torch.no_grad():           # HF initialises the stacked experts to zero-ish; spread them
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = MoEMLP(Cfg(model_type, norm), None, False, torch.float32, "cpu")
    _copy_from_hf(ours, hf)
    x = torch.randn(T, H)
    want = hf(x.unsqueeze(0)).squeeze(0)
    want = want[0] if isinstance(want, tuple) else want
    got = ours(x)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    _, _, experts = ours.route(x)
    assert experts.unique().numel() == E          # every expert had tokens
    ours.sync_free = True           # the rollout's graph-safe form: the same sums, other GEMMs
    assert (ours(x) - got).abs().max().item() <= 1e-6 * got.abs().max().item()


def test_router_losses_are_hf_and_st_moe_and_reach_the_gradient():
    """Training with the coefficients set: the load-balancing loss of one layer is HF's
    load_balancing_loss_func on its router logits, the z-loss ST-MoE's; the router's gradient
    moves by exactly the coefficients' share of theirs (float64)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    torch.manual_seed(1)
    layer = MoEMLP(Cfg("qwen3_moe"), None, False, torch.float64, "cpu").train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(T, H, dtype=torch.float64)
    w = torch.randn(T, H, dtype=torch.float64)

    def router_grad():
        layer.zero_grad()
        (layer(x) * w).sum().backward()
        return layer.gate.weight.grad.clone()
    plain = router_grad()
    assert not layer.loss_sums.any()                  # off by default: nothing computed
    layer.aux_loss_coef, layer.z_loss_coef = 0.3, 0.05
    with_losses = router_grad()
    balance, z, n = layer.loss_sums.tolist()
    logits = torch.nn.functional.linear(x, layer.gate.weight.detach()).requires_grad_(True)
    hf = load_balancing_loss_func((logits,), E, K)
    assert n == 1 and abs(balance - hf.item()) <= 1e-6 * hf.item()    # HF sums in fp32
    z_ref = torch.logsumexp(logits, dim=-1).square().mean()
    assert abs(z - z_ref.item()) <= 1e-12
    probs = torch.softmax(logits, dim=-1)                 # HF's formula in float64
    counts = torch.bincount(torch.topk(probs, K).indices.reshape(-1), minlength=E).double()
    (0.3 * E * (counts / T * probs.mean(0)).sum() + 0.05 * z_ref).backward()
    expected = plain + logits.grad.T @ x
    torch.testing.assert_close(with_losses, expected, rtol=1e-10, atol=1e-12)
    layer.eval()                                      # no router losses outside training
    layer.loss_sums.zero_()
    router_grad()
    assert not layer.loss_sums.any()


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32), ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
def test_grouped_gemm_equals_the_expert_loop(device, dtype, monkeypatch):
    """The routed experts in two grouped GEMMs (torch._grouped_mm, where it runs: CPU fp32/bf16,
    CUDA bf16 on sm90+: the GPU case) against one call per expert, outputs and every gradient,
    with an expert that gets no tokens."""
    import hybridengine.models.moe as moe
    torch.manual_seed(2)
    # bf16 rows of 12 units (24 bytes) miss the kernel's 16-byte alignment: the loop takes them
    assert not moe.grouped_mm_runs(torch.zeros(1, H, dtype=torch.bfloat16), I)
    layer = MoEMLP(Cfg("qwen3_moe", moe_intermediate_size=16), None, False, dtype, device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.gate.weight[3] = 0.0          # expert 3 loses every top-k: an empty group
        layer.gate.weight[3, 0] = -100.0
    x = torch.randn(T, H, dtype=dtype, device=device)
    x[:, 0] = 1.0
    w = torch.randn(T, H, dtype=dtype, device=device)
    assert moe.grouped_mm_runs(x, 16)

    def run():
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out.float() * w.float()).sum().backward()
        # an expert without tokens: zeros from the grouped GEMMs, no gradient from the loop
        return [out.detach(), xi.grad] + [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                          for p in layer.parameters()]
    assert 3 not in layer.route(x)[2].unique().tolist()
    grouped = run()
    monkeypatch.setattr(moe, "grouped_mm_runs", lambda x, ffn: False)
    loop = run()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(grouped, loop):
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max(), \
            (a.float() - b.float()).abs().max()
