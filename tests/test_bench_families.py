"""The benchmarks' model-family shapes (issue 26, acceptance 3, prepared on CPU): tools/bench_ppo.py
--model qwen3-0.6b / qwen3-1.7b / gemma2-2b writes the checkpoints' configs (read back as
models.shapes' ModelConfigs, with their published parameter counts; no weights written), and
tools/bench_rollout.py --tiny --model M runs M's family at tiny sizes beside HF generate."""
import json

import pytest
import torch

from hybridengine.models.hf import read_model_config
from hybridengine.models.shapes import SHAPES
from tool_utils import load_tool

# their model cards' / config.json's counts (embeddings tied, counted once)
PARAMS = {"qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "gemma2-2b": 2_614_341_888,
          "qwen3-moe-1b": 1_062_638_592}     # the last: issue 29's MoE benchmark shape


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_bench_ppo_model_shapes_are_the_checkpoints(tmp_path, name):
    from transformers import AutoModelForCausalLM
    bench = load_tool("bench_ppo")
    assert name in bench.FAMILIES
    hf = bench.model_config(name)
    hf.save_pretrained(str(tmp_path))          # config.json alone: what the trainer reads
    cfg = read_model_config(tmp_path)
    assert cfg == SHAPES[name][0]
    assert cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-6
    if name.startswith("qwen3"):
        assert (cfg.qk_norm, cfg.head_dim, cfg.rope_theta, cfg.num_kv_heads) == (True, 128, 1e6, 8)
    else:
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.query_pre_attn_scalar) == (50, 30, 256)
        assert cfg.sliding_window == 4096 and cfg.is_sliding(0) and not cfg.is_sliding(1)
    with torch.device("meta"):                 # shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params() == PARAMS[name]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_bench_rollout_tiny_runs_the_family(capsys, one_thread, name):
    bench = load_tool("bench_rollout")
    bench.main(["--tiny", "--hf", "--model", name, "--repeat", "1"])
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == f"tiny-{name}"
    assert out["ours"]["generated_tokens_per_s"] > 0 and out["hf"]["generated_tokens_per_s"] > 0
    assert out["ours"]["logprob_max_abs_diff_vs_training_forward"] < 1e-4
