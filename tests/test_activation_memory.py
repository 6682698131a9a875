"""train.activation_memory against the bytes autograd saves in one decoder layer's forward, eager
and compiled as the training engine compiles it (inductor, on the CPU here). The attention is an
op that saves what CUDA's flash varlen_attn saves (q, k, v, out, an fp32 [h, T] logsumexp), so
the count follows the CUDA rule; the CPU's per-sequence SDPA saves other tensors."""
import dataclasses

import pytest
import torch

from hybridengine.models import attention
from hybridengine.models.attention import PackedCausalAttention, PackedInput
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.parallel.layout import Layout
from hybridengine.rl import memory as rl_memory
from hybridengine.train.activation_memory import layer_activation_elements
from hybridengine.train.compile_layers import compile_decoder_layers
from hybridengine.train.memory_plan import RoleSpec, role_memory

TOL = 0.05
T = 256
# GQA throughout (the repeat of K/V adds q - 2kv > 0 at each)
SHAPES = {
    "qwen2": dict(hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=1,
                  head_dim=32, attention_bias=True, model_type="qwen2"),
    "qwen3": dict(hidden_size=128, intermediate_size=320, num_heads=4, num_kv_heads=1,
                  head_dim=64, qk_norm=True, model_type="qwen3"),
    "gemma3": dict(hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=1,
                   head_dim=32, qk_norm=True, model_type="gemma3_text",
                   hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=32),
}


@torch.library.custom_op("hybridengine_tests::varlen_rule", mutates_args=())
def varlen_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence causal attention, out and a logsumexp [h, T] fp32 as flash returns them."""
    out = attention._per_sequence_attention(q, k, v, cu.tolist())
    return out, q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)


@varlen_rule.register_fake
def _(q, k, v, cu):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("hybridengine_tests::varlen_rule_backward", mutates_args=())
def varlen_rule_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor,
                         cu: torch.Tensor) -> list[torch.Tensor]:
    """Reads what flash's backward reads (out and lse too), so a traced backward saves them."""
    return attention.per_sequence_attention_backward(grad, q, k, v, cu)


@varlen_rule_backward.register_fake
def _(grad, q, k, v, out, lse, cu):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _grad(ctx, grad, _grad_lse):
    q, k, v, cu, out, lse = ctx.saved_tensors
    return (*varlen_rule_backward(grad, q, k, v, out, lse, cu), None)


varlen_rule.register_autograd(_grad, setup_context=_setup)


def _cuda_rule_attention(self, layer_idx, q, k, v, spec=None):
    return varlen_rule(q, k, v, self.cu)[0]


def _layer_saved_bytes(model: Decoder, packed: PackedInput) -> int:
    """Bytes the decoder layers save for backward in one forward (storages counted once, no
    weights; the RoPE tables, built once before the layers, not counted)."""
    seen, inside = {}, [False]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if inside[0]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(packed)
    return sum(n for p, n in seen.items() if p not in params)


def _inductor_compiles() -> bool:
    try:
        torch.compile(lambda x: x.sin() + 1, backend="inductor")(torch.ones(4))
        return True
    except Exception:           # no C++ compiler, or an inductor that cannot build for the CPU
        return False


@pytest.fixture(scope="module")
def inductor():
    if not _inductor_compiles():
        pytest.skip("inductor cannot compile on this machine")


def _measure(cfg: ModelConfig, compiled: bool, monkeypatch) -> float:
    """Elements per token one bf16 layer saves, by the CUDA rule for attention."""
    monkeypatch.setattr(PackedCausalAttention, "attend", _cuda_rule_attention)
    torch.manual_seed(0)
    model = Decoder(cfg, dtype=torch.bfloat16).train()
    if compiled:
        torch._dynamo.reset()
        compile_decoder_layers(model)
    packed = PackedInput.from_lengths(torch.randint(0, cfg.vocab_size, (T,)), [T // 4] * 4)
    # no compile cache: a cached graph of another test's attention op would be read back
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        saved = _layer_saved_bytes(model, packed)
    return saved / T / cfg.num_layers / 2


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma3"])
def test_compiled_layer_saves_the_compiled_estimate(name, inductor, monkeypatch, one_thread):
    """Inductor's partitioner keeps what backward's matmuls read and recomputes the pointwise
    ops between: a_compiled, about 0.65-0.8 of the eager count, within 5% of what it saves."""
    cfg = ModelConfig(vocab_size=256, num_layers=1, tie_word_embeddings=True, **SHAPES[name])
    measured = _measure(cfg, True, monkeypatch)
    est = layer_activation_elements(cfg, 1, False, compiled=True)
    print(f"{name} compiled: estimate {est:.0f}, saved {measured:.1f} elements per token")
    assert abs(est / measured - 1) < TOL
    assert est < layer_activation_elements(cfg, 1, False)


def test_the_plan_counts_compiled_layers_where_the_role_compiles():
    cfg = ModelConfig(vocab_size=256, num_layers=2, **SHAPES["qwen2"])
    eager, compiled = (role_memory(RoleSpec(cfg, Layout(), compiled=c, train_tokens=T), 0)
                       for c in (False, True))
    a = layer_activation_elements(cfg, 1, False, compiled=True)
    assert compiled.activations == int(2 * T * a * 2) < eager.activations
    assert compiled.fwd_activations == eager.fwd_activations     # forward-only: eager count
    assert rl_memory._compiled(dataclasses.make_dataclass("R", ["use_torch_compile"])(True),
                               torch.device("cuda")) == \
        {"compiled": True}
    assert not any(rl_memory._compiled(
        dataclasses.make_dataclass("R", ["use_torch_compile"])(True), torch.device("cpu"))
        .values())


GEMMA2 = dict(vocab_size=256, num_layers=1, tie_word_embeddings=True, hidden_size=128,
              intermediate_size=384, num_heads=4, num_kv_heads=1, head_dim=32,
              model_type="gemma2", hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=32)


def test_eager_gemma_layer_saves_the_estimate_with_its_fp32_norms(monkeypatch, one_thread):
    """Gemma's (1 + w) norms are an fp32 composite on every device (CPU and CUDA save the same):
    the eager bf16 count with them, by the CUDA rule for attention, within 5%."""
    cfg = ModelConfig(**GEMMA2)
    measured = _measure(cfg, False, monkeypatch)
    est = layer_activation_elements(cfg, 1, False)
    print(f"gemma2 eager: estimate {est:.0f}, saved {measured:.1f} elements per token")
    assert abs(est / measured - 1) < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_soft_capped_attention_saves_no_scores(dtype, one_thread):
    """Gemma 2's capped attention (models.spec_attention, the same path on CUDA) keeps q, k, v
    and recomputes in its backward: a layer saves the same bytes whether its T tokens are 8
    sequences of 32 or 2 of 128, but for the int32 sequence bounds (kept [h, n, n] scores would
    add ~1 KB a token in bf16 at n = 128 here)."""
    cfg = ModelConfig(attn_softcap=50.0, final_softcap=30.0, **GEMMA2)
    torch.manual_seed(0)
    model = Decoder(cfg, dtype=dtype).train()
    saved = {n: _layer_saved_bytes(model, PackedInput.from_lengths(
        torch.randint(0, cfg.vocab_size, (T,)), [n] * (T // n))) for n in (32, 128)}
    assert saved[32] - saved[128] == 4 * (T // 32 - T // 128)
