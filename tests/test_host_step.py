"""Host optimizer step (DistributedOptimizer(host_step=True), train/host_step.py): the same
weights as the device step (bit for bit on a CPU model), with clipping, an LR schedule, weight
decay, a refused non-finite step, bf16 parameters, ZeRO-1 over dp=2, and bit-exact resume across
modes through a checkpoint file."""
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dist_utils import run_dist
from hybridengine.train.checkpoint import load_checkpoint, save_checkpoint
from hybridengine.train.optimizer import DistributedOptimizer, LRSchedule
from model_utils import rel_err

NUM_SAMPLES = 8
CHUNK = 128         # elements: many chunks per bucket, decay runs cut by chunk boundaries
BAD_STEP = 2        # this step's loss is infinite: refused

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 24),
                         nn.GELU(), nn.Linear(24, 5)).to(dtype)


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(NUM_SAMPLES, 16, generator=g).to(dtype),
            torch.randn(NUM_SAMPLES, 5, generator=g).to(dtype))


def _opt(model, host: bool, group=None, zero=True, **kw) -> DistributedOptimizer:
    schedule = LRSchedule(1e-2, total_steps=8, warmup_steps=2, warmup_style="cosine",
                          min_lr_ratio=0.1)
    opt = DistributedOptimizer(list(model.named_parameters()), group, group, lr=schedule,
                               weight_decay=0.1, grad_clip=0.5, bucket_mb=0.004, host_step=host,
                               use_distributed_optimizer=zero, **kw)
    if host:
        opt.host_step.chunk_numel = CHUNK
    return opt


def _train(model, opt, x, y, steps, first=0, normalizer=NUM_SAMPLES):
    """`steps` updates (schedule advanced after each); returns [(grad_norm, stepped)]."""
    out = []
    for step in range(first, first + steps):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            loss = ((model(xs).float() - ys.float()) ** 2).sum() / normalizer
            (loss * float("inf") if step == BAD_STEP else loss).backward()
        out.append(opt.step())
        opt.step_schedule()
    return out


def _state(opt) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.state_dict()[0].items()}


def _assert_same(a: dict, b: dict, what: str, exact: bool = True):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].device.type == "cpu" and a[k].dtype == b[k].dtype, (what, k)
        if exact:
            assert torch.equal(a[k], b[k]), (what, k, rel_err(a[k], b[k]))
        else:
            assert rel_err(a[k], b[k]) < 1e-6, (what, k, rel_err(a[k], b[k]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_step_equals_device_step(dtype):
    x, y = _data(dtype)
    runs = {}
    for host in (False, True):
        model = _mlp(dtype=dtype)
        opt = _opt(model, host)
        assert len(opt.buckets) > 1 and opt.zero is False
        assert (opt.host_step is not None) == host
        before = None
        history = []
        for step in range(5):
            if step == BAD_STEP:
                before = (_state(opt), [p.detach().clone() for p in model.parameters()])
            history += _train(model, opt, x, y, 1, first=step)
            if step == BAD_STEP:        # refused: weights and moments untouched
                assert history[-1][1] is False and not math.isfinite(history[-1][0])
                _assert_same(_state(opt), before[0], "refused step")
                assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[1]))
        assert [s for _, s in history] == [True, True, False, True, True]
        assert min(n for n, s in history if s) > 0.5            # clipping engaged
        assert opt.num_steps == 4 and opt.schedule_step == 5
        runs[host] = (history, _state(opt), {n: p.detach().clone()
                                             for n, p in model.named_parameters()})
    (dev_hist, dev_state, dev_params), (host_hist, host_state, host_params) = runs[0], runs[1]
    assert [n for n, s in dev_hist if s] == [n for n, s in host_hist if s]
    _assert_same(host_state, dev_state, "optimizer state")
    _assert_same(host_params, dev_params, "model weights")


def test_host_step_with_one_chunk_and_more_threads():
    """Default chunk size (one chunk per bucket here) and two intra-op threads: still bitwise."""
    x, y = _data()
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for host in (False, True):
            model = _mlp()
            opt = DistributedOptimizer(list(model.named_parameters()), lr=1e-2, grad_clip=None,
                                       bucket_mb=None, host_step=host)
            _train(model, opt, x, y, 2, first=BAD_STEP + 1)
            results.append(_state(opt))
    finally:
        torch.set_num_threads(threads)
    _assert_same(results[1], results[0], "one chunk")


def test_resume_is_bit_exact_across_modes(tmp_path):
    """k steps in one mode, a checkpoint file, k more in either mode == 2k uninterrupted."""
    x, y = _data(torch.bfloat16)
    k = 3
    full = {}
    for host in (False, True):
        model = _mlp(dtype=torch.bfloat16)
        opt = _opt(model, host)
        _train(model, opt, x, y, 2 * k)
        full[host] = (_state(opt), {n: p.detach().clone() for n, p in model.named_parameters()})
    _assert_same(full[True][0], full[False][0], "uninterrupted")
    for saved_by in (False, True):
        model = _mlp(dtype=torch.bfloat16)
        opt = _opt(model, saved_by)
        _train(model, opt, x, y, k)
        tensors, meta = opt.state_dict()
        save_checkpoint(tmp_path / f"host{int(saved_by)}", k, tensors, meta)
        for host in (False, True):
            fresh = _mlp(seed=5, dtype=torch.bfloat16)  # other weights: the state restores them
            fresh_opt = _opt(fresh, host)
            loaded, loaded_meta = load_checkpoint(tmp_path / f"host{int(saved_by)}",
                                                  restore_rng_state=False)
            fresh_opt.load_state_dict(loaded, loaded_meta)
            assert (fresh_opt.num_steps, fresh_opt.schedule_step) == (k - 1, k)  # 1 refused
            assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
            _train(fresh, fresh_opt, x, y, k, first=k)
            case = f"saved by host={saved_by}, resumed by host={host}"
            _assert_same(_state(fresh_opt), full[False][0], case)
            _assert_same({n: p.detach() for n, p in fresh.named_parameters()}, full[False][1],
                         case)


def test_engine_host_step_trains_the_same_and_parks_nothing(tmp_path):
    from hybridengine.models.attention import PackedInput
    from hybridengine.parallel.layout import Layout
    from hybridengine.parallel.mesh import build_mesh
    from hybridengine.train.engine import MicroBatch, OptimConfig, TrainEngine
    stories = Path(__file__).resolve().parent.parent / "models" / "stories260k"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (24,), generator=g)
    mbs = [MicroBatch(PackedInput.from_lengths(ids, [10, 14]), {"targets": torch.roll(ids, -1)})]
    params = {}
    for host in (False, True):
        engine = TrainEngine(stories, build_mesh(Layout(1, 1, 1)),
                             optim=OptimConfig(lr=1e-3, host_step=host))
        engine.park(["optimizer"])
        assert engine.parked_bytes() == (0 if host else engine.optimizer.memory_bytes())
        engine.unpark(["optimizer"])
        m = engine.train_step(mbs, lambda out, _: (-out["logprob"].mean(), {}))
        assert m["stepped"] == 1.0
        params[host] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    _assert_same(params[True], params[False], "engine")


# --- ZeRO-1 over data parallel ------------------------------------------------------------------

def _dp_worker(rank, world, ref):
    from hybridengine.parallel.layout import Layout
    from hybridengine.parallel.mesh import build_mesh
    mesh = build_mesh(Layout(1, 1, 2))
    x, y = _data()
    x, y = x.chunk(2)[mesh.dp_rank], y.chunk(2)[mesh.dp_rank]
    ref_params, ref_history = ref
    for zero in (True, False):
        out = {}
        for host in (False, True):
            model = _mlp()
            opt = DistributedOptimizer(list(model.named_parameters()), mesh.dp_group,
                                       mesh.mp_group, lr=1e-2, weight_decay=0.1, grad_clip=0.5,
                                       bucket_mb=0.004, host_step=host,
                                       use_distributed_optimizer=zero)
            assert opt.zero == zero
            if host:
                opt.host_step.chunk_numel = CHUNK
            history = []
            for step in range(4):
                opt.zero_grad()
                for xs, ys in zip(x.chunk(2), y.chunk(2)):
                    loss = ((model(xs) - ys) ** 2).sum() / NUM_SAMPLES
                    (loss * float("inf") if step == BAD_STEP else loss).backward()
                history.append(opt.step())
            out[host] = (history, _state(opt), [p.detach().clone() for p in model.parameters()])
            case = f"zero={zero} host={host}"
            assert [s for _, s in history] == [s for _, s in ref_history], case
            for (n, s), (r, _) in zip(history, ref_history):
                assert not s or math.isclose(n, r, rel_tol=1e-6), (case, n, r)
            for p, q in zip(model.parameters(), ref_params):       # dp=2 vs dp=1: sum order
                assert rel_err(p, q) < 1e-5, (case, rel_err(p, q))
        _assert_same(out[True][1], out[False][1], f"zero={zero} state")    # same dp: bitwise
        assert all(torch.equal(p, q) for p, q in zip(out[True][2], out[False][2]))


@pytest.mark.multiproc
def test_dp2_zero1_host_step_matches_dp1():
    x, y = _data()
    model = _mlp()
    opt = DistributedOptimizer(list(model.named_parameters()), lr=1e-2, weight_decay=0.1,
                               grad_clip=0.5, bucket_mb=0.004)
    history = []
    for step in range(4):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            loss = ((model(xs) - ys) ** 2).sum() / NUM_SAMPLES
            (loss * float("inf") if step == BAD_STEP else loss).backward()
        history.append(opt.step())
    run_dist(_dp_worker, 2, ([p.detach().clone() for p in model.parameters()], history))


# --- on the device machine: the CPU update against the CUDA one -------------------------------

@pytest.mark.gpu
def test_cuda_host_step_close_to_device_step():
    """fp32 model: the CPU kernels round a few ops differently from CUDA's (addcdiv's association,
    fused multiply-adds), an ulp of an update; the fp32 master stays within 1e-6."""
    x, y = (t.cuda() for t in _data())
    out = {}
    for host in (False, True):
        model = _mlp().cuda()
        opt = _opt(model, host)
        if host:
            assert all(b.master.device.type == "cpu" and b.grad.is_cuda for b in opt.buckets)
        history = _train(model, opt, x, y, 5)
        assert [s for _, s in history] == [True, True, False, True, True]
        if host:
            assert all(t.is_pinned() for ts in opt.host_step._staging.buffers.values()
                       for t in ts)
        out[host] = {k: v.cpu() for k, v in _state(opt).items()}
    for k in out[False]:
        if k.endswith(".master"):
            err = rel_err(out[True][k], out[False][k])
            assert err <= 1e-6, (k, err)


# --- from the config: actor_rollout_ref.actor.megatron.optimizer_offload=host_step --------------

def test_config_selects_the_host_step_and_a_run_trains_with_it(tmp_path):
    from hybridengine.config import load_config
    from hybridengine.rl.trainer import Trainer
    root = Path(__file__).resolve().parent.parent
    args = ["--config", str(root / "configs" / "tiny.yaml"),
            f"data.train_files={root / 'data' / 'stories_keywords' / 'train.jsonl'}",
            "data.val_files=null", f"actor_rollout_ref.model.path={root / 'models' / 'stories260k'}",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "data.max_response_length=8", "trainer.logger=[]", "trainer.total_training_steps=1",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
            "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.optim.weight_decay=0.1"]
    with pytest.raises(ValueError, match=r"optimizer_offload=.hoststep.: expected true, false, "
                                          r"host_step or auto"):
        load_config(args + ["actor_rollout_ref.actor.megatron.optimizer_offload=hoststep"])
    weights = {}
    # host_step_freed: what offload=auto picks for a 7B actor on one H200 (the gradient
    # buckets freed outside the update as well)
    for name, mode, grads in (("false", "false", "false"), ("host_step", "host_step", "false"),
                              ("host_step_freed", "host_step", "true")):
        trainer = Trainer(load_config(args + [
            f"actor_rollout_ref.actor.megatron.optimizer_offload={mode}",
            f"actor_rollout_ref.actor.megatron.grad_offload={grads}",
            f"trainer.default_local_dir={tmp_path / name}"]))
        opt = trainer.actor.engine.optimizer
        assert (opt.host_step is not None) == (mode == "host_step")
        assert "optimizer" not in trainer.residency.roles.get("actor", (None, ()))[1]
        before = [p.detach().clone() for p in trainer.actor.engine.model.parameters()]
        trainer.fit()
        assert opt.num_steps == 1
        weights[name] = [p.detach().clone() for p in trainer.actor.engine.model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, weights["host_step"]))   # it stepped
    for name in ("host_step", "host_step_freed"):
        assert all(torch.equal(a, b) for a, b in zip(weights["false"], weights[name])), name
