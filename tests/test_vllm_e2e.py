"""End to end with the vLLM backend on CPU: a 3-step GRPO run of the default tiny job with
actor_rollout_ref.rollout.name=vllm (and a LoRA actor) logs the same metrics as the builtin run,
and its rollout log-probs match the actor's recomputed ones; tools/bench_rollout.py --vllm times both engines.

The default job's stories260K has head_dim 8, which vLLM's CPU attention does not support, so
the runs use a random Llama of the same vocabulary and tokenizer with head_dim 32."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dist_utils import free_port
from hybridengine.rl.tracking import read_metrics
from model_utils import STORIES
from test_vllm import ROOT, save_tiny_hd32, vllm_ok  # noqa: F401 - vllm_ok is a fixture

ENV = dict(os.environ, HYBRIDENGINE_NO_PROGRESS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def stories_hd32(tmp_path_factory):
    path = save_tiny_hd32(tmp_path_factory.mktemp("stories_hd32"), "llama", tied=True, vocab=512)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
              "generation_config.json"):
        shutil.copy(os.path.join(STORIES, f), path)
    return path


SMALLER = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
           "actor_rollout_ref.rollout.val_kwargs.n=2"]


def _run_tiny_job(model_dir, out_dir, name: str, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
           str(free_port()), str(ROOT / "launch" / "ppo.py"), "--config",
           str(ROOT / "configs" / "tiny.yaml"), f"actor_rollout_ref.model.path={model_dir}",
           f"actor_rollout_ref.rollout.name={name}", "trainer.total_training_steps=3",
           # not 1: both engines report the log-probs of the distribution they sampled from,
           # and the actor scores at the same temperature
           "actor_rollout_ref.rollout.temperature=0.7",
           # half the default job's prompts per step (still two mini-batches) and half its
           # validation samples: the check is which metrics each engine logs, not their values
           *SMALLER, f"trainer.default_local_dir={out_dir}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]    # a clean exit, vLLM included
    return read_metrics(out_dir / "metrics.jsonl")


@pytest.mark.usefixtures("vllm_ok")
def test_grpo_tiny_job_with_vllm_logs_the_builtin_metrics(stories_hd32, tmp_path):
    """The vLLM job trains a LoRA actor (tp 2, rollout tp 1: the adapter-only switches), so the
    weights vLLM loads every step are W + s·B·A: its log-probs must be the actor's while the
    actor moves away from the base (the KL to the reference grows)."""
    vllm = _run_tiny_job(stories_hd32, tmp_path / "vllm", "vllm",
                         "actor_rollout_ref.model.lora_rank=8")
    builtin = _run_tiny_job(stories_hd32, tmp_path / "builtin", "builtin")
    assert [r["step"] for r in vllm] == [r["step"] for r in builtin] == [0, 1, 2, 3]
    # the same metrics, but for the built-in engine's own KV-cache slots (rollout/num_slots,
    # rollout/max_concurrent, rollout/preemptions: vLLM's paged cache has no such figures)
    own = {"rollout/num_slots", "rollout/max_concurrent", "rollout/preemptions"}
    for a, b in zip(vllm, builtin):
        assert sorted(a) == sorted(set(b) - own), (a["step"], set(a) ^ (set(b) - own))
        assert a["step"] == 0 or own <= set(b)
    for r in vllm[1:]:
        assert r["response_length/mean"] > 0
        assert r["training/rollout_probs_diff_max"] < 1e-4, r    # vLLM's vs the actor's
    assert vllm[-1]["actor/kl_loss"] > 1e-4, vllm[-1]             # the adapters trained


@pytest.mark.usefixtures("vllm_ok")
def test_bench_rollout_vllm_on_cpu(capsys):
    """Batch 64 x 32 new tokens on the tiny model, both engines at one thread."""
    cmd = [sys.executable, str(ROOT / "tools" / "bench_rollout.py"), "--vllm", "--batch", "64",
           "--prompt-len", "16", "--new-tokens", "32"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(proc.stdout)
    ours, vllm = out["ours"], out["vllm"]
    for r in (ours, vllm):
        assert r["generated_tokens_per_s"] > 0
        assert r["logprob_max_abs_diff_vs_training_forward"] < 1e-4
    with capsys.disabled():
        print(f"\n[bench_rollout --vllm, CPU, tiny, 64 x 32 new tokens, 1 thread] built-in "
              f"{ours['generated_tokens_per_s']:.0f} tokens/s, vLLM "
              f"{vllm['generated_tokens_per_s']:.0f} tokens/s (vLLM engine start "
              f"{vllm['engine_start_s']:.1f} s, weight sync {vllm['weight_sync_s'] * 1e3:.0f} ms)")
