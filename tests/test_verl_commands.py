"""verl users' first day: README's verl command runs as written (a tiny local model and data in
place of its paths), trainer.critic_warmup means what it means in verl, and trainer.logger=wandb
logs the metrics of metrics.jsonl (offline unless WANDB_MODE says otherwise)."""
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from hybridengine.config import load_config
from hybridengine.rl.tracking import Tracker, read_metrics
from test_ppo_e2e import CPU_SIZES, _launch

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT / "models" / "stories260k"
TRAIN = ROOT / "data" / "stories_keywords" / "train.jsonl"


def readme_verl_command() -> list[str]:
    """The arguments of the launch/ppo.py command in README's "Coming from verl" block."""
    section = (ROOT / "README.md").read_text().split("## Coming from verl", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    args = shlex.split(next(line for line in block.splitlines() if "launch/ppo.py" in line))
    return args[args.index("launch/ppo.py") + 1:]


def test_readme_verl_command_runs_a_step_as_written(gsm8k_setup):
    """Its relative paths are where gsm8k_setup put a tiny Qwen2 and GSM8K parquet; only the
    GPU-sized batch and lengths are shrunk after it, and one step is asked for."""
    args = readme_verl_command()
    assert "actor_rollout_ref.model.path=pretrained_models/Qwen2.5-0.5B-Instruct" in args
    out = gsm8k_setup / "readme"
    # 4 prompts, as the seed command's test (the 152k vocabulary costs per token on the CPU)
    _launch(args + CPU_SIZES + ["trainer.total_training_steps=1", "trainer.test_freq=-1",
                                "data.train_batch_size=4", f"trainer.default_local_dir={out}"],
            cwd=gsm8k_setup)
    (row,) = read_metrics(out / "metrics.jsonl")
    assert row["step"] == 1 and "actor/pg_loss" in row and "critic/vf_loss" in row


def _gae_trainer(tmp_path, *overrides):
    from hybridengine.rl.trainer import Trainer
    cfg = load_config(["--config", str(ROOT / "configs" / "tiny.yaml"),
                       f"data.train_files={TRAIN}", "data.val_files=null",
                       f"actor_rollout_ref.model.path={STORIES}", f"critic.model.path={STORIES}",
                       "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=false",
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                       "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                       "critic.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=8",
                       "trainer.logger=[]", f"trainer.default_local_dir={tmp_path}", *overrides])
    return Trainer(cfg)


def test_critic_warmup_updates_the_critic_alone_until_its_step(tmp_path):
    """verl: the actor updates once global_steps >= trainer.critic_warmup (steps count from 1)."""
    trainer = _gae_trainer(tmp_path, "trainer.critic_warmup=2")
    actor = trainer.actor.engine.model
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    first = trainer.train_step(1, [0, 1, 2, 3], lambda: None)
    assert "critic/vf_loss" in first and not [k for k in first if k.startswith("actor/")]
    assert all(torch.equal(before[k], v) for k, v in actor.state_dict().items())
    assert trainer.critic.engine.optimizer.num_steps == 1
    second = trainer.train_step(2, [4, 5, 6, 7], lambda: None)
    assert "actor/pg_loss" in second and trainer.actor.engine.optimizer.num_steps == 1


def test_wandb_logger_gets_the_metrics_of_metrics_jsonl_offline(tmp_path, monkeypatch):
    runs = []

    def init(**kwargs):
        run = SimpleNamespace(kwargs=kwargs, logged=[], finished=False)
        run.log = lambda values, step: run.logged.append((step, values))
        run.finish = lambda: setattr(run, "finished", True)
        runs.append(run)
        return run
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with Tracker(["wandb"], tmp_path, "proj", "exp") as tracker:
        tracker.log({"actor/pg_loss": 0.5, "perf/mfu": 0.1}, 1)
    (run,) = runs
    assert run.kwargs == {"project": "proj", "name": "exp", "mode": "offline", "dir": str(tmp_path)}
    assert run.logged == [(1, {"actor/pg_loss": 0.5, "perf/mfu": 0.1})] and run.finished
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row == {"step": 1, "actor/pg_loss": 0.5, "perf/mfu": 0.1}
    monkeypatch.setenv("WANDB_MODE", "online")
    Tracker(["wandb"], tmp_path / "b", "proj", "exp").close()
    assert runs[1].kwargs["mode"] == "online"
