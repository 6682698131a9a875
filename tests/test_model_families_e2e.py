"""Every model family through the trainer (issue 26, acceptance 1): a 2-step GRPO run of
`torchrun --nproc_per_node=2 launch/ppo.py` (the default job's config, actor tp 2 with sequence
parallelism, rollout tp 1) on a tiny random model of the family with stories260K's tokenizer, and
the bytes each switch moved as HybridFlow's formula says: (n - t_g) / (t_g·n) of the model per
rank, n = t·p = 2, t_g = 1 (tests/test_reshard.py), exactly, counting the TP-sharded weights.

The models are those of test_model_families(_gemma) with stories260K's 512-token vocabulary:
Qwen3 (tied), Llama 3 (llama3 RoPE scaling, untied), Mistral, Gemma 2 and Gemma 3 (tied)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import test_model_families as base
import test_model_families_gemma as gemma
from dist_utils import free_port
from hybridengine.models.decoder import Decoder
from hybridengine.models.hf import is_tp_replicated, read_model_config
from hybridengine.rl.tracking import read_metrics
from model_utils import STORIES

ROOT = Path(__file__).resolve().parent.parent

ENV = dict(os.environ, HYBRIDENGINE_NO_PROGRESS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
FAMILIES = {"qwen3": (base.family_hf_model, "qwen3_tied"),
            "llama3": (base.family_hf_model, "llama3_rope"),
            "mistral": (gemma.family_hf_model, "mistral"),
            "gemma2": (gemma.family_hf_model, "gemma2"),
            "gemma3": (gemma.family_hf_model, "gemma3")}
# 4 prompts x 4 samples, 16 new tokens, no validation or checkpoint: the run's cost is the
# start-up of two ranks and the two switches per step
SHORT = ["trainer.total_training_steps=2", "trainer.val_before_train=False",
         "trainer.test_freq=-1", "trainer.save_freq=-1", "data.max_response_length=16",
         "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]


# a dense reward: the keywords of the default job's reward are rare in a random model's text,
# which leaves every group's advantages (and the first step's gradient) zero
VOWEL_SHARE = """
def vowel_share(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c in "aeiou" for c in solution_str) / max(len(solution_str), 1)
"""


def with_stories_tokenizer(hf_model, path) -> str:
    """Save a tiny HF model (512-token vocabulary) with stories260K's tokenizer files."""
    hf_model.save_pretrained(str(path))
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
              "generation_config.json"):
        shutil.copy(os.path.join(STORIES, f), str(path))
    return str(path)


def grpo_two_steps(tmp_path, model_dir: str, *overrides) -> list[dict]:
    """The 2-step run on the default job's config (actor tp 2 + SP, rollout tp 1) with the
    vowel-share reward; its metrics rows of the actor updates."""
    out, reward = tmp_path / "run", tmp_path / "reward.py"
    reward.write_text(VOWEL_SHARE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
           str(free_port()), str(ROOT / "launch" / "ppo.py"), "--config",
           str(ROOT / "configs" / "tiny.yaml"), f"actor_rollout_ref.model.path={model_dir}",
           f"trainer.default_local_dir={out}", f"custom_reward_function.path={reward}",
           "custom_reward_function.name=vowel_share", *SHORT, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [r for r in read_metrics(out / "metrics.jsonl") if "actor/pg_loss" in r]


@pytest.mark.multiproc
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grpo_two_steps_tp2_to_rollout_tp1(tmp_path, family):
    make, case = FAMILIES[family]
    model_dir = with_stories_tokenizer(make(case, vocab=512), tmp_path / family)
    rows = grpo_two_steps(tmp_path, model_dir)
    assert [r["step"] for r in rows] == [1, 2]
    formula = (2 - 1) / (1 * 2) * _sharded_bytes(model_dir)
    for r in rows:
        assert r["reshard/bytes_per_rank"] == formula, (family, r["step"], formula)
        assert r["response_length/mean"] > 0 and r["actor/grad_norm"] > 0, r


def _sharded_bytes(model_dir) -> int:
    """fp32 bytes (the rollout dtype) of the TP-sharded parameters: the norms, whole on every
    rank, stay where they are (the vocabulary, 512 rows, needs no padding at tp 2)."""
    cfg = read_model_config(model_dir)
    model = Decoder(cfg, device="meta")
    return 4 * sum(p.numel() for n, p in model.named_parameters()
                   if not is_tp_replicated(n, cfg, 2))
