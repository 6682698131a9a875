"""tools/bench_ppo.py: its --model shapes are Qwen2.5's (no weights written), and a --tiny run's
JSON puts the memory plan beside the measured peak."""
import json

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
    # per phase: the plan's GiB, nothing measured (the reshard inside the trainer's rollout)
    assert set(plan["phases_gb"]) >= {"reshard", "rollout", "old_log_prob", "update_actor"}
    assert "reshard" not in out["phases"]
    assert out["phases"]["update_actor"] == {"plan_gb": plan["phases_gb"]["update_actor"],
                                             "measured_gb": None, "measured_over_plan": None}
    assert out["steps"][0]["rollout/num_slots"] == plan["kv_slots"]
    assert out["cuda_allocator"] == "default"       # trainer.cuda_allocator as the trainer applied it
    assert out["steps"][0]["rollout/max_concurrent"] == 128      # 16 prompts x 8: all at once
    # each step's garbage collections: counts and milliseconds per generation
    assert set(out["gc_by_step"]) == {"1"} and set(out["gc_by_step"]["1"]) == {"collections", "ms"}
    assert len(out["gc_by_step"]["1"]["collections"]) == 3
    # trainer.gc_freeze_freq froze what lived after step 1: one full collection, both ways
    gc_full = out["gc_full_collection"]
    assert gc_full["frozen_objects"] > 0 and gc_full["tracked_objects"] >= gc_full["frozen_objects"]
    assert 0 <= gc_full["frozen_ms"] < gc_full["unfrozen_ms"]


def test_tiny_run_draws_response_lengths_and_logs_its_phases(bench_ppo_tiny):
    """--response-lengths lognormal:5:0.5 with EOS ignored: step 1's responses stop at the
    budgets of the first draw (16 prompts, capped at data.max_response_length=8); setup and
    each phase are logged as they end."""
    from bench_rollout import response_lengths
    returncode, stderr, out = bench_ppo_tiny
    assert returncode == 0, stderr[-3000:]
    budgets = response_lengths("lognormal:5:0.5", 16, 8, seed=1)
    assert len(set(budgets)) > 2           # a spread, not the cap
    assert out["steps"][0]["response_length/mean"] == pytest.approx(sum(budgets) / 16)
    assert out["response_lengths"] == "lognormal:5:0.5"
    lines = stderr.splitlines()
    assert any(ln.startswith("[bench_ppo] setup ") for ln in lines)
    for phase in ("rollout", "old_log_prob", "update_actor"):
        assert any(ln.startswith(f"[bench_ppo]   {phase}: ") for ln in lines), phase


def test_memory_check_puts_each_phase_peak_beside_the_plan(monkeypatch):
    """perf/max_memory_allocated_gb/<phase> of the steps (their largest) beside the plan's phase
    totals; the trainer's rollout against the larger of the plan's reshard and rollout."""
    from types import SimpleNamespace

    from hybridengine.train.memory_plan import MemoryPlan
    gib = 2**30
    plan = MemoryPlan({"reshard": {"actor.weights": 6 * gib}, "rollout": {"x": 8 * gib},
                       "update_actor": {"actor.weights": 10 * gib, "actor.activations": 10 * gib}},
                      {}, 0, 4, "max_num_seqs", 0)
    memory = load_tool("bench_memory")       # bench_ppo's memory check (tools/bench_memory.py)
    monkeypatch.setattr(memory, "plan_run_memory", lambda *a: plan)
    monkeypatch.setattr(memory, "device_budget", lambda *a: None)
    trainer = SimpleNamespace(cfg=None, layout=None, critic=None, device=torch.device("cpu"),
                              actor=SimpleNamespace(engine=SimpleNamespace(cfg=None)))
    peaks = {}
    for step in ({"perf/max_memory_allocated_gb/update_actor": 17.0,
                  "perf/max_memory_allocated_gb/rollout": 9.0, "perf/throughput": 1.0},
                 {"perf/max_memory_allocated_gb/update_actor": 18.0,
                  "perf/max_memory_allocated_gb/adv": 1.0}):
        memory.phase_peaks(peaks, step)
    out = memory.memory_check(trainer, 18.0, peaks)
    assert out["plan"]["peak_gb"] == 20.0 and out["plan"]["peak_phase"] == "update_actor"
    assert out["measured_over_plan"] == 0.9
    assert out["plan"]["phases_gb"] == {"reshard": 6.0, "rollout": 8.0, "update_actor": 20.0}
    assert out["phases"] == {
        "rollout": {"plan_gb": 8.0, "measured_gb": 9.0, "measured_over_plan": 9.0 / 8.0},
        "update_actor": {"plan_gb": 20.0, "measured_gb": 18.0, "measured_over_plan": 0.9},
        "adv": {"plan_gb": None, "measured_gb": 1.0, "measured_over_plan": None}}



def _plan_for(monkeypatch, capsys, *argv):
    monkeypatch.setattr("sys.argv", ["bench_ppo.py", "--workload", "fixed", "--algo", "grpo",
                                     "--defaults", *argv])
    bench.main()
    return json.loads(capsys.readouterr().out)


def test_plan_for_one_h200_picks_free_gradients_and_the_host_step(monkeypatch, capsys):
    """offload=auto on one H200 (139.8 GiB) at the GRPO step's shapes, planned without a GPU.
    3B: the gradient buckets freed during generation, so that the KV cache holds all 256
    sequences (measured 2026-12-02 without them: 124-135 slots, the run in two waves). 7B: the
    host step and freed gradients, nothing else: the weights' offload would add 28 GiB of host
    memory on top of the host step's 85 (12 bytes per parameter), more than the H200 machine's
    128 GB host can give. Too little host memory: one line naming the host."""
    h3 = _plan_for(monkeypatch, capsys, "--plan-for", "139.8", "--model", "3b")
    assert h3["auto_offload"] == ["actor.grad_offload=true"] and h3["kv_slots"] == 256
    assert h3["kv_layout"] == "static"          # kv_layout=auto: a row for every sequence
    assert h3["errors"] == [] and h3["host_gib_per_rank"] == 0
    h7 = _plan_for(monkeypatch, capsys, "--plan-for", "139.8", "--model", "7b")
    assert h7["auto_offload"] == ["actor.grad_offload=true", "actor.optimizer_offload=host_step"]
    assert h7["errors"] == [] and h7["kv_slots"] == 256
    n = 7_615_616_512                 # Qwen2.5-7B's parameters (test_model_choices_are_...)
    assert abs(h7["host_gib_per_rank"] * 2**30 / (12 * n) - 1) < 0.01
    assert h7["kv_layout"] == "static"
    # 16k-token responses: rows of 16,896 tokens for 128 of the 256 sequences at most, so
    # kv_layout=auto takes the paged layout (the offload still maximises the KV room)
    long = _plan_for(monkeypatch, capsys, "--plan-for", "139.8", "--model", "1.5b", "--set",
                     "data.max_response_length=16384")
    assert long["kv_layout"] == "paged" and 1 <= long["kv_slots"] < 256 and not long["errors"]
    short = _plan_for(monkeypatch, capsys, "--plan-for", "139.8", "--host-gib", "80",
                      "--model", "7b")
    assert len(short["errors"]) == 1 and short["errors"][0].startswith(
        "memory plan: the offloaded state needs 85.") and "80.00 GiB" in short["errors"][0]


def test_alternate_interleave_flips_in_abba_order_and_averages_each_side():
    """--alternate-interleave: warm-up steps alternate (both paths compiled and warm), the timed
    ones go a b b a a b b a, and each side's means take the keys its steps have."""
    assert [bench.side_a_at(s, 3) for s in range(1, 4)] == [True, False, True]
    assert [bench.side_a_at(s, 3) for s in range(4, 12)] == \
        [True, False, False, True, True, False, False, True]
    rows = [{"timing_s/update_critic_actor": 1.0, "timing_s/step": 2.0, "interleaved": True},
            {"timing_s/update_critic": 0.5, "timing_s/update_actor": 0.75,
             "timing_s/step": 3.0, "interleaved": False}]
    assert bench.means(rows) == {"timing_s/update_critic_actor": 1.0, "timing_s/step": 2.5,
                                 "timing_s/update_critic": 0.5, "timing_s/update_actor": 0.75}
    assert bench.side_means(rows, "interleaved", "a", "b") == {
        "a": {"timing_s/update_critic_actor": 1.0, "timing_s/step": 2.0},
        "b": {"timing_s/update_critic": 0.5, "timing_s/update_actor": 0.75, "timing_s/step": 3.0}}


def test_alternate_prefill_probe_clears_what_the_runner_keeps():
    """--alternate-prefill-probe's side b empties the kept peak that the runner's budget reads
    (a renamed attribute would otherwise leave both sides alike without a word)."""
    from types import SimpleNamespace
    from hybridengine.models.decoder import Decoder, ModelConfig
    from hybridengine.rollout.engine import Engine
    from hybridengine.rollout.rollout_config import RolloutConfig
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32)
    engine = Engine(Decoder(cfg), RolloutConfig(max_num_seqs=2, max_model_len=16))
    engine.runner._prefill_peak = ((16384, 16, 2), 1 << 20)
    bench.forget_prefill_peak(SimpleNamespace(generator=SimpleNamespace(engine=engine)))
    assert engine.runner._prefill_peak is None
    assert "_prefill_peak" in engine.runner._free_bytes_for_cache.__code__.co_names
    bench.forget_prefill_peak(SimpleNamespace(generator=SimpleNamespace(engine=None)))


def test_alternate_wgrad_fusion_switches_the_fused_layers_of_both_roles():
    """--alternate-wgrad-fusion builds both roles fused (its overrides) and flips exactly the
    layers that fuse: those of the actor and of the critic, no other."""
    from types import SimpleNamespace
    from hybridengine.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    args = bench.argparse.Namespace(set=["a=1"], offload="", lora=0, alternate_wgrad_fusion=True)
    assert bench.extra_overrides(args) == [
        "a=1", "actor_rollout_ref.actor.megatron.gradient_accumulation_fusion=true",
        "critic.megatron.gradient_accumulation_fusion=true"]
    actor = torch.nn.Sequential(ColumnParallelLinear(4, 8), RowParallelLinear(8, 4))
    critic = torch.nn.Sequential(ColumnParallelLinear(4, 8), RowParallelLinear(8, 4))
    actor[0].fuse_wgrad = actor[1].fuse_wgrad = critic[1].fuse_wgrad = True
    role = lambda model: SimpleNamespace(engine=SimpleNamespace(model=model))  # noqa: E731
    trainer = SimpleNamespace(actor=role(actor), critic=role(critic))
    assert bench.fused_linears(trainer) == [actor[0], actor[1], critic[1]]
    assert bench.fused_linears(SimpleNamespace(actor=role(actor), critic=None)) == \
        [actor[0], actor[1]]
