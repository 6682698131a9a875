"""tools/bench_ppo.py: its --model shapes are Qwen2.5's (no weights written), and a --tiny run's
JSON puts the memory plan beside the measured peak."""
import pytest
import torch

from hybridengine.models.hf import read_model_config
from tool_utils import load_tool

bench = load_tool("bench_ppo")


# the published parameter counts of Qwen2.5-{0.5B, 1.5B, 3B, 7B} (their model cards)
@pytest.mark.parametrize("size, billions", [("0.5b", 0.49), ("1.5b", 1.54), ("3b", 3.09),
                                            ("7b", 7.61)])
def test_model_choices_are_qwen2_5_shapes(tmp_path, size, billions):
    from transformers import Qwen2ForCausalLM
    hf = bench.qwen25_config(size)
    hf.save_pretrained(str(tmp_path))          # config.json alone: what the trainer reads
    cfg = read_model_config(tmp_path)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e6, 1e-6, 32768)
    assert cfg.tie_word_embeddings == (size != "7b")
    with torch.device("meta"):                 # shapes only: no memory, no init
        model = Qwen2ForCausalLM(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert abs(cfg.num_params() / 1e9 - billions) < 0.02 * billions, cfg.num_params()


def test_tiny_run_reports_the_memory_plan(bench_ppo_tiny):
    """conftest.bench_ppo_tiny: the --tiny 1-step run tests/test_profiling.py profiles (with grads
    and optimizer offloaded: the plan is reported all the same)."""
    returncode, stderr, out = bench_ppo_tiny
    assert returncode == 0, stderr[-3000:]
    plan = out["plan"]
    assert plan["peak_gb"] > 0 and plan["peak_phase"] and plan["kv_slots"] == 128
    # the CPU reports no allocated peak, so there is nothing to divide
    assert out["measured_peak_gb"] is None and out["measured_over_plan"] is None
    assert out["steps"][0]["rollout/num_slots"] == plan["kv_slots"]
    assert out["steps"][0]["rollout/max_concurrent"] == 128      # 16 prompts x 8: all at once
