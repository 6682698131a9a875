"""Gradient-accumulation fusion (parallel/wgrad_accumulation.py, Megatron's
gradient_accumulation_fusion): the fused linear's outputs and gradients against F.linear's
(float64; eager, aot_eager and inductor; micro-batches in 1F1B order), the engine's train steps
with it against without it, the config keys, the C++ kernel's CPU build; on a GPU, bf16 weights
into fp32 buckets through cuBLAS against the unfused engine (eager layers, compiled layers,
CUDA graphs)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from hybridengine.config.loading import load_config
from hybridengine.models.lora import LoRAConfig
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from hybridengine.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from hybridengine.parallel.wgrad_accumulation import dtype_out_accumulates, linear
from hybridengine.train.engine import OptimConfig, TrainEngine
from model_utils import STORIES
from train_utils import assert_grads_close, train_steps


class _Block(torch.nn.Module):
    """column (bias) -> relu -> row, as a decoder layer's MLP."""

    def __init__(self):
        super().__init__()
        self.up = ColumnParallelLinear(16, 48, bias=True, dtype=torch.float64)
        self.down = RowParallelLinear(48, 16, bias=True, dtype=torch.float64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_fused_linear_gives_f_linear_outputs_and_gradients(backend, one_thread):
    """Three micro-batches, all forwards before any backward (1F1B's order: the buckets change
    between a forward and its backward), weights' main_grad views of one flat buffer: outputs,
    input and bias gradients as F.linear's; each weight's main_grad holds the sum of its three
    gradients, and no .grad is made."""
    torch.manual_seed(0)
    ref, fused = _Block(), _Block()
    fused.load_state_dict(ref.state_dict())
    flat = torch.zeros(sum(p.numel() for p in fused.parameters()), dtype=torch.float64)
    at = 0
    for p in fused.parameters():
        p.main_grad = flat[at:at + p.numel()].view_as(p)
        at += p.numel()
    fused.up.fuse_wgrad = fused.down.fuse_wgrad = True
    run = torch.compile(fused, backend=backend, dynamic=True) if backend else fused
    xs = [torch.randn(n, 16, dtype=torch.float64, requires_grad=True) for n in (5, 11, 7)]
    x_refs = [x.detach().clone().requires_grad_() for x in xs]
    outs = [run(x) for x in xs]
    for x, out in zip(x_refs, outs):
        torch.testing.assert_close(out, ref(x), rtol=1e-12, atol=1e-12)
    for i, out in enumerate(outs):
        (out * (i + 1)).sum().backward()
        (ref(x_refs[i]) * (i + 1)).sum().backward()
        torch.testing.assert_close(xs[i].grad, x_refs[i].grad, rtol=1e-12, atol=1e-12)
    for (name, want), got in zip(ref.named_parameters(), fused.parameters()):
        if name.endswith("weight"):
            assert got.grad is None, name
            torch.testing.assert_close(got.main_grad, want.grad, rtol=1e-12, atol=1e-12)
        else:                       # biases: autograd's .grad, as unfused
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)


def test_switching_fusion_off_at_run_time_takes_the_unfused_path_when_compiled(one_thread):
    """The layers read fuse_wgrad at each forward, and a compiled module guards on it: switched
    off between steps (tools/bench_ppo.py --alternate-wgrad-fusion's side b), the same compiled
    layers give autograd's .grad (the optimizer's hook path) and leave main_grad alone; switched
    on again, main_grad takes the gradient and no .grad is made."""
    torch.manual_seed(0)
    block = _Block()
    weights = [block.up.weight, block.down.weight]
    for w in weights:
        w.main_grad = torch.zeros_like(w)
    run = torch.compile(block, backend="aot_eager", dynamic=True)
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    grads = []
    for fuse in (True, False, True):
        block.up.fuse_wgrad = block.down.fuse_wgrad = fuse
        for w in weights:
            w.grad = None
            w.main_grad.zero_()
        run(x).square().sum().backward()
        for w in weights:
            assert (w.grad is None) == fuse
            assert bool(w.main_grad.abs().sum() > 0) == fuse
        grads.append([(w.main_grad if fuse else w.grad).clone() for w in weights])
    for on, off in zip(grads[0], grads[1]):         # the same gradients either way
        torch.testing.assert_close(on, off, rtol=1e-12, atol=1e-12)


def test_plain_linear_where_there_is_nothing_to_fuse():
    """No main_grad, a frozen weight, or no grad mode: F.linear (the weight's .grad, if any, as
    autograd makes it)."""
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.float64)
    linear(x, w, fuse=True).sum().backward()
    assert w.grad is not None
    w.main_grad = torch.zeros_like(w)
    w.grad = None
    linear(x, w, fuse=False).sum().backward()
    assert w.grad is not None and not w.main_grad.any()
    with torch.no_grad():
        assert linear(x, w, fuse=True).grad_fn is None
    w.requires_grad_(False)
    assert linear(x, w, fuse=True).grad_fn is None


def test_bf16_weights_on_the_cpu_add_the_bf16_product():
    """Where the fused GEMM is not available (bf16 inputs into fp32 on the CPU), the product in
    the inputs' dtype is added into main_grad: the unfused path's arithmetic."""
    assert not dtype_out_accumulates(torch.device("cpu"), torch.bfloat16, torch.float32)
    w = torch.randn(8, 6, dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.ones(8, 6)
    x = torch.randn(5, 6, dtype=torch.bfloat16)
    g = torch.randn(5, 8, dtype=torch.bfloat16)
    linear(x, w, fuse=True).backward(g)
    torch.testing.assert_close(w.main_grad, 1 + (g.t() @ x).float(), rtol=0, atol=0)


def _engine(fusion: bool, dtype=torch.float64, device="cpu", lora=None, **kw):
    return TrainEngine(STORIES, build_mesh(Layout(1, 1, 1)), dtype=dtype, device=device,
                       optim=OptimConfig(lr=1e-3, grad_clip=1.0), lora=lora,
                       wgrad_fusion=fusion, **kw)


@pytest.mark.parametrize("recompute", [False, True])
def test_engine_trains_the_same_with_the_fusion(recompute, one_thread):
    """float64 stories260K, four AdamW steps of two or three packed micro-batches: losses, grad
    norms and every parameter's accumulated gradient as without the fusion; every projection
    of every layer fused (qkv, o, gate_up, down); a LoRA engine's frozen base is not."""
    plain_hist, plain_grads = train_steps(_engine(False, recompute=recompute), device="cpu")
    engine = _engine(True, recompute=recompute)
    assert engine.wgrad_fused == 4 * engine.cfg.num_layers
    hist, grads = train_steps(engine, device="cpu")
    torch.testing.assert_close(hist, plain_hist, rtol=1e-10, atol=1e-12)
    assert_grads_close(grads, plain_grads, 1e-10)
    lora = _engine(True, lora=LoRAConfig(rank=4, alpha=8, target_modules=("all-linear",)))
    assert lora.wgrad_fused == 0


def test_config_key_and_verl_override_spelling():
    """actor_rollout_ref.actor.megatron.gradient_accumulation_fusion (the critic follows it);
    verl's +...megatron.override_transformer_config.gradient_accumulation_fusion sets it, the
    section's other fields are ignored as before; a wrong value names the key."""
    cfg = load_config([])
    assert cfg.actor_rollout_ref.actor.megatron.gradient_accumulation_fusion is False
    cfg = load_config(["+actor_rollout_ref.actor.megatron.override_transformer_config."
                       "gradient_accumulation_fusion=True",
                       "+actor_rollout_ref.actor.megatron.override_transformer_config."
                       "recompute_method=uniform"])
    assert cfg.actor_rollout_ref.actor.megatron.gradient_accumulation_fusion is True
    assert cfg.critic.megatron.gradient_accumulation_fusion is True
    cfg = load_config(["actor_rollout_ref.actor.megatron.gradient_accumulation_fusion=true",
                       "+critic.megatron.override_transformer_config."
                       "gradient_accumulation_fusion=false"])
    assert cfg.critic.megatron.gradient_accumulation_fusion is False
    with pytest.raises(ValueError, match="megatron.gradient_accumulation_fusion"):
        load_config(["actor_rollout_ref.actor.megatron.gradient_accumulation_fusion=maybe"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_layers,graphs", [(False, False), (True, False), (False, True)])
def test_fused_accumulation_matches_unfused_on_cuda(compile_layers, graphs):
    """bf16 stories260K on CUDA: this torch's addmm.dtype_out accumulates bf16 products into an
    fp32 C in place (the fused GEMM, not the fallback); four train steps at lr 0 give the
    unfused engine's losses and gradients to bf16's rounding (the fused sum is the more exact
    one: no bf16 gradient per micro-batch), with eager layers, compiled layers, and the
    training CUDA graphs capturing the fused backward. The direct call goes through the op's
    Python kernel, the engines' through its C++ one (the first engine registers it)."""
    assert dtype_out_accumulates(torch.device("cuda"), torch.bfloat16, torch.float32)
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(300, 32, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.ones(32, 64, device="cuda")
    linear(x, w, fuse=True).backward(g)
    torch.testing.assert_close(w.main_grad, 1 + g.t().double() @ x.double(),
                               rtol=1e-5, atol=1e-4, check_dtype=False)

    def engine(fusion):
        return TrainEngine(STORIES, build_mesh(Layout(1, 1, 1)), dtype=torch.bfloat16,
                           device="cuda", optim=OptimConfig(lr=0.0, grad_clip=1.0),
                           compile_layers=compile_layers, cuda_graphs=graphs,
                           wgrad_fusion=fusion)
    plain_hist, plain_grads = train_steps(engine(False))
    # compiled layers: the fused engine's graphs compile afresh (on the plain one's code objects
    # they would pile up past dynamo's recompile limit, and the rest would run eager)
    torch._dynamo.reset()
    fused = engine(True)
    assert fused.wgrad_fused == 4 * fused.cfg.num_layers
    # the engine registered the op's C++ CUDA kernel (csrc/wgrad_accumulation.cpp)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hybridengine::accumulate_wgrad",
                                                          "CUDA")
    assert (fused.graphs is not None) == graphs
    hist, grads = train_steps(fused)
    torch.testing.assert_close(hist, plain_hist, rtol=1e-2, atol=1e-3)
    assert_grads_close(grads, plain_grads, 2e-2)
    fused.optimizer.zero_grad()
    assert all(p.grad is None for p in fused.model.parameters())


_CPP_CHECK = r"""
import sys, torch
from torch.utils.cpp_extension import load
import hybridengine.parallel.wgrad_accumulation as W
load(name="hybridengine_wgrad_cpu_check", sources=[sys.argv[1]], is_python_module=False,
     extra_cflags=["-O1", "-DHYBRIDENGINE_WGRAD_KEY=CPU"], build_directory=sys.argv[2])
assert torch._C._dispatch_has_kernel_for_dispatch_key("hybridengine::accumulate_wgrad", "CPU")
g = torch.randn(3, 5, 8, dtype=torch.float64)
x = torch.randn(3, 5, 6, dtype=torch.float64)
main_grad = torch.ones(8, 6, dtype=torch.float64)
W.accumulate_wgrad(main_grad, g, x)
torch.testing.assert_close(main_grad, 1 + g.reshape(-1, 8).t() @ x.reshape(-1, 6))
try:
    W.accumulate_wgrad(torch.zeros(7, 6, dtype=torch.float64), g, x)
except RuntimeError as e:
    assert "main_grad [7, 6]" in str(e), e
else:
    raise AssertionError("a wrong main_grad shape was accepted")
print("ok")
"""


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="no C++ compiler")
def test_cpp_kernel_builds_and_sums_as_the_python_one(tmp_path):
    """csrc/wgrad_accumulation.cpp, built for the CPU key in a process of its own (the CUDA
    build is the GPU test's): it compiles, registers for the op, gives the Python kernel's sum
    and refuses a main_grad of the wrong shape with a line that names it."""
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                          "wgrad_accumulation.cpp")
    proc = subprocess.run([sys.executable, "-c", _CPP_CHECK, source, str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
