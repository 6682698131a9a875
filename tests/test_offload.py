"""Host offload (megatron.param_offload / grad_offload / optimizer_offload): parking keeps values
and views, the phases find what they need on the device, and training is bit-identical."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_utils import run_dist
from hybridengine.config import load_config
from hybridengine.train.engine import TrainEngine
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh, build_meshes
from hybridengine.train.offload import HostParking
from hybridengine.rl.tracking import read_metrics

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT / "models" / "stories260k"


def test_parking_keeps_values_and_views():
    w = torch.nn.Parameter(torch.randn(4, 5, dtype=torch.float64))
    buf = torch.arange(20.0)
    view = buf[5:10]                               # e.g. a parameter's main_grad
    before_w, before_buf = w.detach().clone(), buf.clone()
    parking = HostParking([w, w.view(-1)[3:], buf, view])
    assert parking.nbytes == 20 * 8 + 20 * 4      # each storage once
    parking.park()
    assert w.untyped_storage().nbytes() == 0 and buf.untyped_storage().nbytes() == 0
    assert parking.parked_bytes == parking.nbytes
    parking.unpark()
    assert torch.equal(w.detach(), before_w) and torch.equal(buf, before_buf)
    view.add_(1)                                   # the old view is live again
    assert buf[5] == 6


def test_parking_skips_shared_storages_and_frees_dead_buffers():
    a, b = torch.ones(8), torch.ones(8)
    parking = HostParking([a, b])
    parking.park(skip=[b[2:]])                     # b is in use elsewhere (zero-copy sharing)
    assert a.untyped_storage().nbytes() == 0 and b.untyped_storage().nbytes() == 32
    assert parking.parked_bytes == 32
    parking.unpark()
    assert a.sum() == 8 and b.sum() == 8
    grads = HostParking([a], keep_values=False)    # gradient buckets: freed, come back zeroed
    grads.park()
    grads.unpark()
    assert a.sum() == 0


def test_parking_memory_torch_does_not_own_is_one_clear_error():
    with pytest.raises(ValueError, match="cannot offload optimizer: a storage of 24 bytes is not "
                                         "resizable"):
        HostParking([torch.from_numpy(np.zeros(3))], name="optimizer")


def test_engine_refuses_to_run_on_parked_parts(one_thread):
    from hybridengine.train.engine import OptimConfig
    engine = TrainEngine(STORIES, build_mesh(Layout(1, 1, 1)), optim=OptimConfig(lr=1e-3))
    engine.park(["params"])
    with pytest.raises(RuntimeError, match="params of this engine are offloaded"):
        engine.forward_only([])
    with pytest.raises(RuntimeError, match="params of this engine are offloaded"):
        engine.train_step([], None)
    engine.unpark(["params"])
    frozen = TrainEngine(STORIES, build_mesh(Layout(1, 1, 1)))
    with pytest.raises(ValueError, match="cannot offload 'optimizer'"):
        frozen.park(["optimizer"])


# ----------------------------------------------------------------------------- in the trainer

OFFLOAD_ALL = [f"{role}.megatron.{flag}=true"
               for role in ("actor_rollout_ref.actor", "critic")
               for flag in ("param_offload", "grad_offload", "optimizer_offload")] + [
    "actor_rollout_ref.ref.megatron.param_offload=true"]


def tiny_ppo_trainer(world, out_dir, *overrides):
    """PPO (critic, reference, KL loss) on stories260k, 2 steps of 8 prompts, responses of up to
    8 tokens, on `world` ranks (the defaults: actor tp=2, generation tp=1)."""
    from hybridengine.rl.preflight import checked_layout
    from hybridengine.rl.trainer import Trainer
    cfg = load_config(["--config", str(ROOT / "configs" / "tiny.yaml"),
                       f"data.train_files={ROOT / 'data/stories_keywords/train.jsonl'}",
                       "data.val_files=null", f"actor_rollout_ref.model.path={STORIES}",
                       "algorithm.adv_estimator=gae", "data.train_batch_size=8",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "critic.optim.lr=1e-3",
                       "data.max_response_length=8", "trainer.total_training_steps=2",
                       "trainer.val_before_train=False", "trainer.test_freq=-1",
                       "trainer.save_freq=-1", "trainer.logger=[]",
                       f"trainer.default_local_dir={out_dir}", *overrides])
    return Trainer(cfg, build_meshes(checked_layout(cfg, world), cfg.trainer.collective_timeout_s))


def _fit(rank, world, out_dir, overrides):
    """tiny_ppo_trainer, one response a prompt: the generation weights are gathered copies (tp 1
    against the actor's 2), so the actor's own weights can go to the host."""
    trainer = tiny_ppo_trainer(world, out_dir, "actor_rollout_ref.rollout.n=1",
                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                               "critic.ppo_micro_batch_size_per_gpu=4", *overrides)
    trainer.fit()
    # fit ends with everything back on the device: every weight can be read
    weights = {f"{role}.{n}": p.detach().clone()
               for role, eng in (("actor", trainer.actor.engine), ("critic", trainer.critic.engine))
               for n, p in eng.model.named_parameters()}
    torch.save(weights, Path(out_dir) / f"weights_{rank}.pt")
    trainer.save(2)
    if rank == 0:
        (Path(out_dir) / "residency.json").write_text(
            json.dumps(trainer.residency.parked_by_phase))


def _training_metrics(path):
    """Without wall-clock times and process memory, which differ between any two runs."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("timing_s/", "perf/")) and "memory" not in k}
            for r in read_metrics(path / "metrics.jsonl")]


def _fit_plain_then_offloaded(rank, world, tmp):
    """Both runs in the same two ranks (one start-up of the processes): fresh Trainers."""
    _fit(rank, world, f"{tmp}/plain", [])
    _fit(rank, world, f"{tmp}/offload", OFFLOAD_ALL)


@pytest.mark.multiproc
def test_offloading_every_part_trains_identically(tmp_path):
    run_dist(_fit_plain_then_offloaded, 2, str(tmp_path))
    plain, off = tmp_path / "plain", tmp_path / "offload"
    assert _training_metrics(plain) == _training_metrics(off)
    assert "timing_s/offload" in read_metrics(off / "metrics.jsonl")[0]
    for rank in range(2):
        a = torch.load(plain / f"weights_{rank}.pt")
        b = torch.load(off / f"weights_{rank}.pt")
        assert all(torch.equal(a[k], b[k]) for k in a)
    # The saved checkpoint holds the real optimizer state (unparked for the save).
    from safetensors.torch import load_file
    sa = load_file(str(plain / "global_step_2" / "state" / "rank_00000.safetensors"))
    sb = load_file(str(off / "global_step_2" / "state" / "rank_00000.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    parked = json.loads((off / "residency.json").read_text())   # the last step's, per phase
    # During generation the actor's weights, gradients and optimizer state are all on the host
    # (the generation model holds gathered copies), the critic and reference entirely too.
    assert parked["generation"]["actor"] > 0
    assert parked["update_actor"]["actor"] == 0 and parked["update_actor"]["critic"] > 0
    assert parked["update_critic"]["critic"] == 0 and parked["update_critic"]["actor"] > 0
    assert parked["ref"]["ref"] == 0 and parked["old_log_prob"]["ref"] > 0
    assert parked["generation"]["actor"] > parked["rollout"]["actor"] > 0


@pytest.mark.gpu
def test_parking_on_cuda_frees_device_memory_and_restores_values():
    w = torch.randn(1024, 1024, device="cuda")
    g = torch.randn(1024, 1024, device="cuda")
    before = w.clone()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    values, dead = HostParking([w]), HostParking([g], keep_values=False)
    values.park(), dead.park()
    assert torch.cuda.memory_allocated() == allocated - 2 * 4 * 2**20
    values.unpark(), dead.unpark()
    assert torch.equal(w, before) and not g.any()
    assert torch.cuda.memory_allocated() == allocated


@pytest.mark.gpu
def test_offload_on_cuda_runs_and_keeps_the_first_step(tmp_path):
    """The trainer on one GPU with every offload flag (pinned host buffers, storages resized on
    the device): fp32 training weights with a bf16 rollout, so the generation weights are copies
    and the actor's own weights go to the host during generation. The first step's rollout and
    forward passes see the same weights with and without offload."""
    one_gpu = ["trainer.device=cuda", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
               "actor_rollout_ref.actor.megatron.param_dtype=float32",
               "critic.megatron.param_dtype=float32", "actor_rollout_ref.rollout.dtype=bfloat16"]
    _fit(0, 1, str(tmp_path / "plain"), one_gpu)
    _fit(0, 1, str(tmp_path / "offload"), one_gpu + OFFLOAD_ALL)
    plain, off = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("plain", "offload"))
    assert off[0]["timing_s/offload"] > 0
    for key in ("response_length/mean", "critic/score/mean", "actor/pg_loss", "critic/vf_loss"):
        assert off[0][key] == pytest.approx(plain[0][key], rel=1e-4, abs=1e-6), key
    parked = json.loads((tmp_path / "offload" / "residency.json").read_text())
    assert parked["generation"]["actor"] > 0 and parked["update_actor"]["critic"] > 0
