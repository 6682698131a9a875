"""End to end: the embedded default job learns; the seed's verl command, GRPO and DAPO run on
GSM8K with a tiny random Qwen2; checkpoints load in transformers (kill -9 + resume is exact:
tests/test_faults.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridengine.rl.tracking import read_metrics

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, HYBRIDENGINE_NO_PROGRESS="1", OMP_NUM_THREADS="1",
           PYTHONPATH=str(ROOT))

SEED_COMMAND = """
 data.train_files=data/processed/gsm8k/train.parquet data.val_files=data/processed/gsm8k/test.parquet
 data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=256
 actor_rollout_ref.model.path=pretrained_models/Qwen2.5-0.5B-Instruct
 actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
 actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.4
 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 critic.optim.lr=1e-5
 critic.model.path=pretrained_models/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4
 algorithm.kl_ctrl.kl_coef=0.001 trainer.logger=['console'] trainer.val_before_train=False
 trainer.default_hdfs_dir=null trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=10
 trainer.test_freq=10 trainer.total_epochs=15""".split()

DESIGN_METRICS = [
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
    "critic/vf_loss", "critic/vf_explained_var", "critic/score/mean", "critic/advantages/mean",
    "response_length/mean", "perf/throughput", "perf/mfu", "timing_s/gen", "timing_s/ref",
    "timing_s/values", "timing_s/update_actor", "timing_s/update_critic", "timing_s/reshard",
    "timing_s/step"]


def _launch(args, nproc=1, cwd=ROOT, check=True, timeout=600):
    cmd = [sys.executable, str(ROOT / "launch" / "ppo.py"), *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         "--master_port", str(29500 + os.getpid() % 1000), str(ROOT / "launch" / "ppo.py"), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


# The seed command's sizes are GPU-sized; these make 2 steps fit a 2-core CPU.
CPU_SIZES = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "data.max_response_length=16", "trainer.total_training_steps=2",
             "actor_rollout_ref.rollout.max_num_seqs=64", "trainer.save_freq=-1"]


def _gsm8k_args(out):
    """{run: its launch/ppo.py arguments} of the three GSM8K runs below."""
    # 4 prompts (the 152k vocabulary costs seconds per forward on the CPU)
    runs = {"ppo": SEED_COMMAND + CPU_SIZES + [
        "algorithm.use_kl_in_reward=True", "trainer.save_freq=2", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"trainer.default_local_dir={out / 'ppo'}"]}
    for algo in ("grpo", "dapo"):
        # GRPO trains on every step: 4 prompts x 2 (a 152k vocabulary costs seconds per forward
        # on the CPU); DAPO (4 prompts x 4): its filter drops this random model's uniform
        # groups, so it trains little
        extra = ["actor_rollout_ref.rollout.n=2", "data.train_batch_size=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2"] if algo == "grpo" else \
            ["actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
             "reward_model.overlong_buffer.len=8", "algorithm.filter_groups.max_num_gen_batches=2"]
        runs[algo] = SEED_COMMAND + CPU_SIZES + [
            "--config", str(ROOT / "configs" / f"{algo}.yaml"),
            f"trainer.default_local_dir={out / algo}", *extra]
    return runs


@pytest.fixture(scope="module")
def gsm8k_runs(gsm8k_setup):
    """The three one-process GSM8K runs, started at once, two at a time (tests/proc_utils.py:
    each is one thread); gsm8k_runs(name) waits for one and fails as _launch would."""
    from proc_utils import Launches
    launches = Launches()
    for name, args in _gsm8k_args(gsm8k_setup).items():
        launches.start(name, [sys.executable, str(ROOT / "launch" / "ppo.py"), *args],
                       cwd=gsm8k_setup, env=ENV, timeout=600)

    def result(name):
        proc = launches.result(name)
        if proc.returncode != 0:
            raise AssertionError(f"{proc.args} failed:\n{proc.stdout[-3000:]}\n"
                                 f"{proc.stderr[-5000:]}")
        return gsm8k_setup / name
    yield result
    launches.close()


def test_seed_command_ppo_runs_two_steps(gsm8k_runs):
    out = gsm8k_runs("ppo")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
    keys = set().union(*rows)
    missing = [k for k in DESIGN_METRICS if k not in keys]
    assert not missing, missing
    step = next(r for r in rows if r["step"] == 2)
    expected = step["perf/total_num_tokens"] / step["timing_s/step"] / 1
    assert step["perf/throughput"] == pytest.approx(expected)
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    AutoModelForCausalLM.from_pretrained(str(out / "global_step_2" / "actor"))
    critic = AutoModelForTokenClassification.from_pretrained(str(out / "global_step_2" / "critic"))
    assert critic.config.num_labels == 1


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_grpo_and_dapo_run_two_steps(gsm8k_runs, algo):
    out = gsm8k_runs(algo)
    rows = read_metrics(out / "metrics.jsonl")
    assert max(r["step"] for r in rows) == 2
    assert any("timing_s/step" in r or "train/num_gen_batches" in r for r in rows)


@pytest.mark.multiproc
def test_default_job_learns_shortened(default_job_run):
    """The embedded default job (2 ranks: actor tp=2, generation tp=1), 6 steps
    (conftest.default_job_run, whose console tests/test_console.py reads)."""
    out, _ = default_job_run
    rows = read_metrics(out / "metrics.jsonl")
    val = {r["step"]: r["val/reward/mean"] for r in rows if "val/reward/mean" in r}
    assert val[6] > val[0] + 0.15, val


@pytest.mark.multiproc
def test_uninterrupted_checkpoint_loads_in_hf_and_trained(uninterrupted_run):
    """The uninterrupted 4-step run (conftest.uninterrupted_run). Its kill -9 + resume_mode=auto
    counterpart is tests/test_faults.py::test_kill9_under_torchrun_restarts_resumes_and_matches_
    uninterrupted: rank 0 killed at step 3 of the same arguments, the group started again with
    resume_mode=auto (the default), resumed from global_step_2, every step logged once, metrics
    and global_step_4's actor weights and optimizer state equal to this run's (this module ran
    the same kill and resume as a second torchrun launch: the same check, once more)."""
    a_dir, _ = uninterrupted_run
    from safetensors.torch import load_file
    ta = load_file(str(a_dir / "global_step_4" / "actor" / "model-00001-of-00001.safetensors"))
    # The checkpoint is a complete HF model: transformers loads it and gives our logits.
    from transformers import AutoModelForCausalLM
    from hybridengine.models.attention import PackedInput
    from hybridengine.models.hf import load_decoder
    actor = a_dir / "global_step_4" / "actor"
    hf = AutoModelForCausalLM.from_pretrained(str(actor)).eval()
    ours = load_decoder(actor)
    ids = torch.tensor([1, 403, 261, 378, 306, 370, 265, 261])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = ours.logits(ours(PackedInput.from_lengths(ids, [len(ids)])))
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5
    base = load_file(str(ROOT / "models" / "stories260k" / "model.safetensors"))
    assert not torch.equal(ta["model.norm.weight"], base["model.norm.weight"])   # it trained
