"""DistributedOptimizer: AdamW parity with torch, DP (ZeRO-1 on/off) and TP parity, clipping,
weight decay placement, LR schedules, skip on non-finite norm, exact state round trip."""
import math

import pytest
import torch
from torch import nn

from dist_utils import run_dist
from hybridengine.train.optimizer import DistributedOptimizer, LRSchedule
from model_utils import rel_err, save_tiny

NUM_SAMPLES, NUM_STEPS = 8, 3


pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 24),
                         nn.GELU(), nn.Linear(24, 5))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(NUM_SAMPLES, 16, generator=g), torch.randn(NUM_SAMPLES, 5, generator=g)


def _train_mlp(model, opt, x, y, num_micro: int, normalizer: float):
    """NUM_STEPS updates; each micro-batch loss is sum_i l_i / normalizer."""
    norms = []
    for _ in range(NUM_STEPS):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(num_micro), y.chunk(num_micro)):
            (((model(xs) - ys) ** 2).sum() / normalizer).backward()
            assert all(p.grad is None for p in model.parameters())   # moved to main_grad
        norm, stepped = opt.step()
        assert stepped
        norms.append(norm)
    return norms


def test_adamw_bit_exact_vs_torch_and_clipping():
    """torch.optim.AdamW(fused=True), the kernel the optimizer calls: bit for bit without
    clipping (within 1e-6 with it: torch's norm is fp32, ours fp64)."""
    x, y = _data()
    for clip in (None, 0.5):
        model, ref_model = _mlp(), _mlp()
        opt = DistributedOptimizer(list(model.named_parameters()), lr=1e-2, weight_decay=0.1,
                                   grad_clip=clip, bucket_mb=0.002)   # several buckets
        assert len(opt.buckets) > 1
        groups = [{"params": [p for p in ref_model.parameters() if p.dim() >= 2]},
                  {"params": [p for p in ref_model.parameters() if p.dim() < 2],
                   "weight_decay": 0.0}]
        ref = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=True)
        norms = _train_mlp(model, opt, x, y, 2, NUM_SAMPLES)
        for step in range(NUM_STEPS):
            ref.zero_grad()
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                (((ref_model(xs) - ys) ** 2).sum() / NUM_SAMPLES).backward()
            params = list(ref_model.parameters())
            ref_norm = (torch.nn.utils.clip_grad_norm_(params, clip) if clip else
                        torch.nn.utils.get_total_norm([p.grad for p in params])).item()
            assert math.isclose(norms[step], ref_norm, rel_tol=1e-6)
            ref.step()
        if clip:
            assert min(norms) > clip      # clipping engaged on every step
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            if clip is None:   # identical arithmetic; clipping coefficients round differently
                assert torch.equal(p, q), name
            else:
                assert rel_err(p, q) < 1e-6, name


def test_weight_decay_skips_biases_and_norms():
    model = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = DistributedOptimizer(list(model.named_parameters()), lr=0.1, weight_decay=0.5)
    opt.zero_grad()
    (model(torch.randn(2, 16)).sum() * 0.0).backward()      # zero grads: Adam moves nothing
    opt.step()
    for n, p in model.named_parameters():
        expected = before[n] * (1 - 0.1 * 0.5) if p.dim() >= 2 else before[n]
        assert torch.equal(p, expected), n


def test_lr_schedules_hand_computed():
    const = LRSchedule(lr=1.0, total_steps=10, warmup_steps=4)
    assert [const.get_lr(s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert LRSchedule(lr=2.0).get_lr(0) == 2.0                   # no warm-up
    ratio = LRSchedule(lr=1.0, total_steps=20, warmup_steps_ratio=0.1)
    assert ratio.num_warmup_steps == 2 and ratio.get_lr(1) == 0.5
    cos = LRSchedule(lr=1.0, total_steps=12, warmup_steps=2, warmup_style="cosine",
                     min_lr_ratio=0.1)
    assert math.isclose(cos.get_lr(0), 0.1) and math.isclose(cos.get_lr(1), 0.55)
    assert math.isclose(cos.get_lr(2), 1.0)
    assert math.isclose(cos.get_lr(7), 0.1 + 0.9 * 0.5)         # progress 1/2: cos = 0
    assert math.isclose(cos.get_lr(12), 0.1)                     # end of the half cosine
    with pytest.raises(ValueError, match="warmup_style"):
        LRSchedule(lr=1.0, warmup_style="linear")
    model = _mlp()
    opt = DistributedOptimizer(list(model.named_parameters()), lr=const)
    opt.step_schedule()
    opt.step_schedule()
    assert opt.current_lr == 0.5


def test_non_finite_grad_norm_skips_step():
    model = _mlp()
    opt = DistributedOptimizer(list(model.named_parameters()), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    (model(torch.randn(2, 16)).sum() * float("inf")).backward()
    norm, stepped = opt.step()
    assert not stepped and not math.isfinite(norm) and opt.num_steps == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_state_dict_round_trip_is_exact_and_checks_layout():
    x, y = _data()
    model = _mlp()
    opt = DistributedOptimizer(list(model.named_parameters()), lr=1e-2, bucket_mb=0.002)
    _train_mlp(model, opt, x, y, 2, NUM_SAMPLES)
    tensors, meta = opt.state_dict()
    tensors = {k: v.clone() for k, v in tensors.items()}
    _train_mlp(model, opt, x, y, 2, NUM_SAMPLES)

    fresh = _mlp(seed=5)            # other weights: loading the optimizer state restores them
    fresh_opt = DistributedOptimizer(list(fresh.named_parameters()), lr=1e-2, bucket_mb=0.002)
    fresh_opt.load_state_dict(tensors, meta)
    assert fresh_opt.num_steps == NUM_STEPS
    _train_mlp(fresh, fresh_opt, x, y, 2, NUM_SAMPLES)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)

    other = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 32),
                          nn.GELU(), nn.Linear(32, 5))
    other_opt = DistributedOptimizer(list(other.named_parameters()), lr=1e-2, bucket_mb=0.002)
    with pytest.raises(ValueError, match=r"5.weight \[5, 24\].*5.weight \[5, 32\]"):
        other_opt.load_state_dict(tensors, meta)
    with pytest.raises(ValueError, match="already belongs"):
        DistributedOptimizer(list(fresh.named_parameters()))
    fresh_opt.release()
    DistributedOptimizer(list(fresh.named_parameters()))


def test_bad_arguments_raise_one_line_errors():
    params = list(_mlp().named_parameters())
    for kwargs, match in [({"grad_reduce": "avg"}, "grad_reduce='avg'"),
                          ({"betas": (0.9, 1.0)}, "optim.betas"),
                          ({"eps": 0.0}, "optim.eps=0.0")]:
        with pytest.raises(ValueError, match=match):
            DistributedOptimizer(params, **kwargs)
    with pytest.raises(ValueError, match="twice"):
        DistributedOptimizer(params + params[:1])
    with pytest.raises(ValueError, match="needs total_training_steps"):
        LRSchedule(lr=1.0, warmup_style="cosine")


# --- data parallel ------------------------------------------------------------------------------

DP_CASES = [(zero, reduce, bucket) for zero in (True, False) for reduce in ("sum", "mean")
            for bucket in (None, 0.002)]


def _dp_worker(rank, world, ref):
    from hybridengine.parallel.layout import Layout
    from hybridengine.parallel.mesh import build_mesh
    mesh = build_mesh(Layout(1, 1, 2))
    x, y = _data()
    x, y = x.chunk(2)[mesh.dp_rank], y.chunk(2)[mesh.dp_rank]
    ref_params, ref_norms, ref_bytes = ref
    for zero, reduce, bucket in DP_CASES:
        model = _mlp()
        opt = DistributedOptimizer(list(model.named_parameters()), mesh.dp_group, mesh.mp_group,
                                   lr=1e-2, weight_decay=0.1, grad_clip=0.5, bucket_mb=bucket,
                                   use_distributed_optimizer=zero, grad_reduce=reduce)
        # "sum": the loss is normalised by the global sample count; "mean": by the local one.
        norms = _train_mlp(model, opt, x, y, 2, NUM_SAMPLES if reduce == "sum" else len(x))
        case = f"zero={zero} reduce={reduce} bucket_mb={bucket}"
        for n, r in zip(norms, ref_norms):
            assert math.isclose(n, r, rel_tol=1e-6), (case, n, r)
        for (name, p), q in zip(model.named_parameters(), ref_params):
            assert rel_err(p, q) < 1e-5, (case, name, rel_err(p, q))
        if zero and bucket is None:
            ratio = opt.memory_bytes() / ref_bytes
            assert 0.45 < ratio < 0.55, (case, ratio)
        elif not zero:
            assert opt.memory_bytes() >= ref_bytes


@pytest.mark.multiproc
def test_dp2_matches_dp1_with_and_without_zero():
    x, y = _data()
    model = _mlp()
    opt = DistributedOptimizer(list(model.named_parameters()), lr=1e-2, weight_decay=0.1,
                               grad_clip=0.5, bucket_mb=None)
    norms = _train_mlp(model, opt, x, y, 4, NUM_SAMPLES)
    assert min(norms) > 0.5                                     # clipping engaged
    ref = ([p.detach().clone() for p in model.parameters()], norms, opt.memory_bytes())
    run_dist(_dp_worker, 2, ref)


# --- tensor parallel (sequence parallel) Decoder ------------------------------------------------

LENGTHS = [9, 6, 12]


def _train_decoder(model, opt, tp):
    from hybridengine.models.attention import PackedInput
    g = torch.Generator().manual_seed(3)
    norms = []
    for _ in range(NUM_STEPS):
        ids = torch.randint(0, 97, (sum(LENGTHS),), generator=g)
        packed = PackedInput.from_lengths(ids, LENGTHS, multiple_of=tp)
        targets = nn.functional.pad(torch.roll(ids, -1), (0, packed.num_pad))
        opt.zero_grad()
        logp, _ = model.logprob_entropy(model(packed), targets)
        (-packed.strip(logp).sum() / sum(LENGTHS)).backward()
        norm, stepped = opt.step()
        assert stepped
        norms.append(norm)
    return norms


def _full_params(model):
    from hybridengine.models.hf import _gather_full
    out = {}
    for name, p in model.named_parameters():
        out.update(_gather_full(model, name, p))
    return out


# float64: in fp32, Adam's g/sqrt(v) turns 1e-7 round-off in near-zero gradients into
# lr-sized differences within a few steps (norms drift ~1e-4 apart by step 3 at tp=2 vs tp=1).
def _tp_worker(rank, world, model_dir, ref):
    from hybridengine.models.hf import is_tp_replicated, load_decoder
    from hybridengine.parallel.layout import Layout
    from hybridengine.parallel.mesh import build_mesh
    mesh = build_mesh(Layout(2, 1, 1))
    model = load_decoder(model_dir, mesh, sequence_parallel=True, dtype=torch.float64)
    cfg = model.cfg

    def counted(name, p):     # TP-replicated parameters count once, on tp_rank 0
        return mesh.tp_rank == 0 or not is_tp_replicated(name, cfg, mesh.tp)

    opt = DistributedOptimizer(list(model.named_parameters()), mesh.dp_group, mesh.mp_group,
                               mesh.tp_group, lr=1e-2, weight_decay=0.1, grad_clip=0.3,
                               count_in_grad_norm=counted)
    norms = _train_decoder(model, opt, 2)
    ref_params, ref_norms = ref
    for n, r in zip(norms, ref_norms):
        assert math.isclose(n, r, rel_tol=1e-5), (n, r)
    full = _full_params(model)
    assert full.keys() == ref_params.keys()
    for k, v in ref_params.items():
        assert rel_err(full[k], v) < 1e-5, (k, rel_err(full[k], v))


@pytest.mark.multiproc
def test_tp2_sequence_parallel_decoder_matches_tp1(tmp_path):
    from hybridengine.models.hf import load_decoder
    model_dir = save_tiny(tmp_path / "qwen2", "qwen2", tied=True)
    model = load_decoder(model_dir, dtype=torch.float64)
    opt = DistributedOptimizer(list(model.named_parameters()), lr=1e-2, weight_decay=0.1,
                               grad_clip=0.3)
    norms = _train_decoder(model, opt, 1)
    assert min(norms) > 0.3                                     # clipping engaged
    run_dist(_tp_worker, 2, model_dir, (_full_params(model), norms))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_decided_on_the_device_equals_the_host_decided_one(monkeypatch, device):
    """step(on_device=True): no host read (Tensor.item and friends refused during it), and bit
    for bit the host-decided step over clipped steps and a non-finite one (refused by the
    kernel's found_inf: weights, moments and the count unchanged); norm and stepped as tensors.
    On CUDA, the same with the CUDA kernel."""
    x, y = (t.to(device) for t in _data())
    runs = {}
    for on_device in (False, True):
        model = _mlp().to(device)
        opt = DistributedOptimizer(list(model.named_parameters()), lr=1e-2, weight_decay=0.1,
                                   grad_clip=0.5, bucket_mb=0.002)
        out = []
        for step in range(4):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).sum() / NUM_SAMPLES
            (loss * float("inf") if step == 2 else loss).backward()
            with monkeypatch.context() as m:
                if on_device:
                    for name in ("item", "tolist", "__float__", "__bool__"):
                        m.setattr(torch.Tensor, name, lambda *a: pytest.fail("host read"))
                norm, stepped = opt.step(on_device=on_device)
            out.append((float(norm), bool(stepped)))
            if on_device:
                assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float64
                assert stepped.dtype == torch.float64
            assert opt.num_steps == step + (step < 2)
        runs[on_device] = (out, model, opt)
    (host_out, host_model, host_opt), (dev_out, dev_model, dev_opt) = runs[False], runs[True]
    assert [s for _, s in dev_out] == [True, True, False, True]
    for (a, sa), (b, sb) in zip(host_out, dev_out):
        assert sa == sb and (a == b or not (math.isfinite(a) or math.isfinite(b)))
    for p, q in zip(host_model.parameters(), dev_model.parameters()):
        assert torch.equal(p, q)
    for b, c in zip(host_opt.buckets, dev_opt.buckets):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(b, key), getattr(c, key)), key
