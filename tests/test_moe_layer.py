"""The MoE MLP (models.moe) against Hugging Face's sparse blocks (Qwen3-MoE with and without
norm_topk_prob, Mixtral) on the same weights, in its routed and its sync-free forms; the
grouped GEMMs on the stacked expert parameters (in place, no per-call copy) against the
per-expert loop, in training and in the sync-free decode form. Its tensor-parallel shards:
test_moe_model (tp 2, SP on and off, float64 gradients)."""
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
    """HF 5.x keeps the experts stacked as we do: gate_up_proj [E, 2I, H] ([gate; up]),
    down_proj [E, H, I]."""
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)


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
    ours.sync_free = True           # the rollout's graph-safe form: no host sync, the same sums
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


def test_router_losses_skip_padding_rows():
    """With real_rows (the sequence-parallel pad at the end, a CP shard's inside its sequences)
    the losses and the router's gradient are those of the real rows alone; a shard of padding
    only adds nothing."""
    torch.manual_seed(2)
    layer = MoEMLP(Cfg("qwen3_moe"), None, False, torch.float64, "cpu").train()
    layer.aux_loss_coef, layer.z_loss_coef = 0.3, 0.05
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(T, H, dtype=torch.float64)
    real = torch.rand(T, generator=torch.Generator().manual_seed(0)) < 0.7
    assert 0 < real.sum() < T

    def losses_and_router_grad(rows, mask=None):
        layer.zero_grad()
        layer.loss_sums.zero_()
        logits, _, experts = layer.route(rows)
        layer._router_loss(logits, experts, mask).backward()
        return layer.loss_sums[:2].clone(), layer.gate.weight.grad.clone()
    want_sums, want_grad = losses_and_router_grad(x[real])
    got_sums, got_grad = losses_and_router_grad(x, real)
    torch.testing.assert_close(got_sums, want_sums, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)
    sums, grad = losses_and_router_grad(x, torch.zeros(T, dtype=torch.bool))
    assert not sums.any() and not grad.any()


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
        # an expert without tokens: zeros in its slice of the stacked gradients either way
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


def _spread(layer: MoEMLP, empty: int = 3) -> None:
    """Weights spread, and expert `empty` losing every top-k (for inputs with x[:, 0] = 1)."""
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.gate.weight[empty] = 0.0
        layer.gate.weight[empty, 0] = -100.0


def test_grouped_gemms_read_the_stacked_parameters_in_place(monkeypatch):
    """The experts are stored stacked: both grouped GEMMs read views of the parameters
    themselves (no torch.stack, no copy per call), and the gradients land in them."""
    import hybridengine.models.moe as moe
    torch.manual_seed(3)
    layer = MoEMLP(Cfg("qwen3_moe", moe_intermediate_size=16), None, False, torch.float32,
                   "cpu")
    _spread(layer)
    x = torch.randn(T, H)
    x[:, 0] = 1.0
    assert moe.grouped_mm_runs(x, 16)
    operands, stacks, inner = [], [], torch._grouped_mm

    def grouped_mm(a, b, offs=None, **kw):
        operands.append((b, offs))
        return inner(a, b, offs=offs, **kw)

    def stack(*args, **kw):
        stacks.append(args)
        return torch.cat([t.unsqueeze(0) for t in args[0]])
    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
    monkeypatch.setattr(torch, "stack", stack)
    layer(x).square().sum().backward()
    assert not stacks and len(operands) == 2
    experts = layer.experts
    for (b, offs), p in zip(operands, (experts.gate_up_proj, experts.down_proj)):
        assert b.data_ptr() == p.data_ptr() and b._base is p
        assert b.shape == p.transpose(1, 2).shape
        assert offs.dtype == torch.int32 and offs.tolist()[-1] == T * K
        assert p.grad is not None and p.grad[3].abs().max() == 0 and p.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_free_grouped_decode_equals_the_loop(dtype, monkeypatch):
    """The rollout's sync-free form (CUDA graphs, compiled decode) where the grouped GEMM runs:
    rows sorted by expert on the device, the group ends a device int32 tensor, no host sync
    (no .tolist() / .item()), only the routed experts' GEMMs; equal to the loop with an expert
    that gets no tokens, at decode batch sizes. Where the grouped GEMM does not run it falls
    back to every expert over every token: equal too."""
    import hybridengine.models.moe as moe
    torch.manual_seed(4)
    layer = MoEMLP(Cfg("qwen3_moe", moe_intermediate_size=16), None, False, dtype, "cpu")
    _spread(layer)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for tokens in (1, 3, T):
        x = torch.randn(tokens, H, dtype=dtype)
        x[:, 0] = 1.0
        assert 3 not in layer.route(x)[2].unique().tolist()
        with torch.no_grad():
            loop = layer._loop(*_sorted_rows(layer, x))       # one call per expert
            loop_out = torch.zeros_like(x).index_add_(0, *_weighted(layer, x, loop))
            calls = []
            with monkeypatch.context() as m:
                inner = torch._grouped_mm
                m.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(kw["offs"])
                          or inner(*a, **kw))
                for name in ("tolist", "item"):
                    m.setattr(torch.Tensor, name, _no_host_sync)
                layer.sync_free = True
                grouped = layer(x)
                m.setattr(moe, "grouped_mm_runs", lambda x, ffn: False)
                every = layer(x)
            layer.sync_free = False
        assert len(calls) == 2 and calls[0].dtype == torch.int32 and calls[0].numel() == E
        for got in (grouped, every):
            err = (got.float() - loop_out.float()).abs().max()
            assert err <= tol * loop_out.float().abs().max(), (tokens, err)


def _no_host_sync(*_):
    raise AssertionError("host synchronisation in the sync-free MoE form")


def _sorted_rows(layer: MoEMLP, x):
    """The routed rows sorted by expert and the rows per expert (the reference loop's input)."""
    _, _, experts = layer.route(x)
    order = torch.argsort(experts.reshape(-1), stable=True)
    counts = torch.bincount(experts.reshape(-1), minlength=E).tolist()
    return x[order // K], counts


def _weighted(layer: MoEMLP, x, y):
    """(token index, routing-weighted expert output) of each sorted row."""
    _, weights, experts = layer.route(x)
    order = torch.argsort(experts.reshape(-1), stable=True)
    return order // K, (y * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)


def test_row_permutations_match_indexing_and_need_no_scatter():
    """The routed path's row moves (_PermuteRows, _UnpermuteRows): values and fp64 gradients
    equal plain indexing with a scatter-add by token (the form they replace), and neither
    direction calls index_add / index_put (atomics on CUDA, nondeterministic)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridengine.models.moe import _PermuteRows, _UnpermuteRows
    g = torch.Generator().manual_seed(0)
    T, k, H = 7, 3, 5
    experts = torch.randint(0, 4, (T, k), generator=g)
    order = torch.argsort(experts.reshape(-1), stable=True)
    inverse = torch.argsort(order)
    x = torch.randn(T, H, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(T, k, dtype=torch.float64, generator=g, requires_grad=True)
    probe = torch.randn(T * k, H, dtype=torch.float64, generator=g)

    def ours():
        rows = _PermuteRows.apply(x, order, inverse, k)
        y = torch.tanh(rows) * probe                    # a row-wise "expert"
        pairs = _UnpermuteRows.apply(y, order, inverse) * w.reshape(-1, 1)
        return pairs.view(T, k, H).sum(1)

    def reference():
        tokens = order // k
        y = torch.tanh(x[tokens]) * probe
        scaled = y * w.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, tokens, scaled)

    class AtenOps(TorchDispatchMode):         # every aten op that runs, backward's too
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func._schema.name)
            return func(*args, **(kwargs or {}))

    grad_out = torch.randn(T, H, dtype=torch.float64, generator=g)
    with AtenOps() as seen_reference:
        want = reference()
        want_grads = torch.autograd.grad(want, (x, w), grad_out)
    with AtenOps() as seen:
        got = ours()
        got_grads = torch.autograd.grad(got, (x, w), grad_out)
    scatters = {"aten::index_add", "aten::index_add_", "aten::index_put", "aten::index_put_",
                "aten::_index_put_impl_", "aten::scatter_add", "aten::scatter_add_"}
    assert seen_reference.names & scatters and not seen.names & scatters, seen.names & scatters
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
