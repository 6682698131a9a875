"""End to end: the embedded default job learns; the seed's verl command, GRPO and DAPO run on
GSM8K with a tiny random Qwen2; checkpoints load in transformers; kill -9 + resume is exact."""
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


def test_seed_command_ppo_runs_two_steps(gsm8k_setup):
    out = gsm8k_setup / "ppo"
    # 4 prompts (the 152k vocabulary costs seconds per forward on the CPU)
    _launch(SEED_COMMAND + CPU_SIZES + ["algorithm.use_kl_in_reward=True", "trainer.save_freq=2",
                                        "data.train_batch_size=4",
                                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                        "critic.ppo_micro_batch_size_per_gpu=2",
                                        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                        f"trainer.default_local_dir={out}"], cwd=gsm8k_setup)
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
def test_grpo_and_dapo_run_two_steps(gsm8k_setup, algo):
    out = gsm8k_setup / algo
    # GRPO trains on every step: 4 prompts x 2 (a 152k vocabulary costs seconds per forward on
    # the CPU); DAPO (4 prompts x 4): its filter drops this random model's uniform groups, so it
    # trains little
    extra = ["actor_rollout_ref.rollout.n=2", "data.train_batch_size=4",
             "actor_rollout_ref.actor.ppo_mini_batch_size=2"] if algo == "grpo" else \
        ["actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
         "reward_model.overlong_buffer.len=8", "algorithm.filter_groups.max_num_gen_batches=2"]
    _launch(SEED_COMMAND + CPU_SIZES + ["--config", str(ROOT / "configs" / f"{algo}.yaml"),
                                        f"trainer.default_local_dir={out}", *extra],
            cwd=gsm8k_setup)
    rows = read_metrics(out / "metrics.jsonl")
    assert max(r["step"] for r in rows) == 2
    assert any("timing_s/step" in r or "train/num_gen_batches" in r for r in rows)


@pytest.mark.multiproc
def test_default_job_learns_shortened(tmp_path):
    """The embedded default job (2 ranks: actor tp=2, generation tp=1), 6 steps."""
    _launch([f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=6",
             "trainer.test_freq=6"], nproc=2)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    val = {r["step"]: r["val/reward/mean"] for r in rows if "val/reward/mean" in r}
    assert val[6] > val[0] + 0.15, val


def _strip(rows):
    """Training metrics only: wall-clock times and process memory differ between any two runs."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("timing_s/", "perf/")) and "memory" not in k} for r in rows]


@pytest.mark.multiproc
def test_kill9_then_resume_matches_uninterrupted_and_hf_loads(tmp_path, uninterrupted_run):
    # the uninterrupted run (conftest.uninterrupted_run) is tests/test_faults.py's reference too
    a_dir, args = uninterrupted_run
    killed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
         str(29600 + os.getpid() % 1000), str(ROOT / "launch" / "ppo.py"), *args,
         f"trainer.default_local_dir={tmp_path / 'b'}"],
        cwd=ROOT, env=dict(ENV, HYBRIDENGINE_KILL_AT_STEP="3"), capture_output=True, text=True,
        timeout=600)
    assert killed.returncode != 0
    assert (tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text() == "2"
    _launch(args + [f"trainer.default_local_dir={tmp_path / 'b'}", "trainer.resume_mode=auto"],
            nproc=2)
    a = read_metrics(a_dir / "metrics.jsonl")
    b = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert _strip(a) == _strip(b)
    from safetensors.torch import load_file
    for f in ("model-00001-of-00001.safetensors",):
        ta = load_file(str(a_dir / "global_step_4" / "actor" / f))
        tb = load_file(str(tmp_path / "b" / "global_step_4" / "actor" / f))
        assert all(torch.equal(ta[k], tb[k]) for k in ta)
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
