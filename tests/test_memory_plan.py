"""The memory plan against what the engines allocate: weights, gradient buckets, fp32 master and
Adam state of real TrainEngines after one step (tp, pp, dp layouts), the rollout's KV cache and
the HybridEngine's arena; the activation estimate against the bytes autograd saves; fit_error's
suggestions re-planned."""
import builtins
import dataclasses
import io
import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from dist_utils import run_dist
from hybridengine.hybrid.reshard import HybridEngine
from hybridengine.models.attention import PackedInput
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.models.shapes import QWEN2_5_7B
from hybridengine.parallel.layout import GenLayout, Layout
from hybridengine.parallel.mesh import build_gen_mesh, build_mesh
from hybridengine.rl import memory as rl_memory
from hybridengine.rl.residency import PHASE_USES
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.train import memory_plan as mp
from hybridengine.models.lora import LoRAConfig
from hybridengine.train.engine import MicroBatch, OptimConfig, TrainEngine
from hybridengine.train import memory_advice
from hybridengine.train.memory_advice import fit_error, kv_slots_short
from hybridengine.train.memory_plan import (RoleSpec, RolloutSpec, plan_memory, role_memory,
                                            stage_params)

# vocab 97: padded for tp = 2; 4 layers: two per stage at pp = 2; GQA 8 / 4 heads
CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=4,
                  num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True,
                  tie_word_embeddings=True, max_position_embeddings=64)
# The critic untied: TrainEngine decides "tied" per stage from model.value_head, which only the
# last stage has, so at pp > 1 a tied critic's first stage waits for an embedding all-reduce
# the last stage never joins (a hang, reported with this test).
CRITIC_CFG = dataclasses.replace(CFG, tie_word_embeddings=False)
BUCKET_MB = 0.1         # ~26k fp32 elements: several buckets, each padded
TOL = 0.05


def _allocated(engine: TrainEngine) -> dict[str, int]:
    """Bytes this rank actually holds: parameters, gradient buckets, master and Adam moments."""
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)    # noqa: E731
    opt = engine.optimizer
    return {"weights": nbytes(engine.model.parameters()),
            "grads": nbytes(b.grad for b in opt.buckets),
            "master": nbytes(b.master for b in opt.buckets),
            "optimizer": nbytes(t for b in opt.buckets for t in (b.exp_avg, b.exp_avg_sq))}


def _one_step(engine: TrainEngine, tp: int, value_head: bool) -> None:
    g = torch.Generator().manual_seed(0)
    lens = [7, 5, 9]
    ids = torch.randint(0, CFG.vocab_size, (sum(lens),), generator=g)
    mb = MicroBatch(PackedInput.from_lengths(ids, lens, multiple_of=tp),
                    {"targets": torch.roll(ids, -1)})
    key = "values" if value_head else "logprob"
    engine.train_step([mb], lambda out, mb: (out[key].float().sum() * 1e-3, {}))
    assert engine.optimizer.num_steps == 1          # Adam state exists and was written


def _compare(engine, spec: RoleSpec, pp_rank: int) -> dict[str, float]:
    planned = dataclasses.asdict(role_memory(spec, pp_rank))
    ratios = {k: planned[k] / v for k, v in _allocated(engine).items()}
    assert all(abs(r - 1) <= TOL for r in ratios.values()), (spec.layout, pp_rank, ratios)
    return ratios


def _check_layout(layout: Layout, rank: int, out: dict) -> None:
    """Actor (bf16, tied head) and critic (value head) on `layout` after one step; the actor's
    reshard arena and KV cache at each generation tp that divides the layout's tp."""
    mesh = build_mesh(layout)
    optim = OptimConfig(lr=1e-3, bucket_mb=BUCKET_MB)
    for value_head in (False, True):
        torch.manual_seed(0)
        cfg = CRITIC_CFG if value_head else CFG
        engine = TrainEngine(cfg, mesh, dtype=torch.bfloat16, optim=optim, value_head=value_head)
        _one_step(engine, layout.tp, value_head)
        spec = RoleSpec(cfg, layout, torch.bfloat16, value_head=value_head, bucket_mb=BUCKET_MB)
        out[f"{'critic' if value_head else 'actor'} rank{rank}"] = _compare(engine, spec,
                                                                            mesh.pp_rank)
    # a LoRA actor: base weights + adapters, the optimizer's state the adapters' only
    torch.manual_seed(0)
    lora = LoRAConfig(4, 8.0, ("q_proj", "v_proj", "down_proj"))
    engine = TrainEngine(CFG, mesh, dtype=torch.bfloat16, optim=optim, lora=lora)
    _one_step(engine, layout.tp, False)
    spec = RoleSpec(CFG, layout, torch.bfloat16, bucket_mb=BUCKET_MB, lora_rank=4,
                    lora_targets=lora.target_modules)
    out[f"lora actor rank{rank}"] = _compare(engine, spec, mesh.pp_rank)
    torch.manual_seed(0)                    # a LoRA critic: the value head trains as well
    critic = TrainEngine(CRITIC_CFG, mesh, dtype=torch.bfloat16, optim=optim, value_head=True,
                         lora=lora)
    _one_step(critic, layout.tp, True)
    critic_spec = RoleSpec(CRITIC_CFG, layout, torch.bfloat16, value_head=True,
                           bucket_mb=BUCKET_MB, lora_rank=4, lora_targets=lora.target_modules)
    out[f"lora critic rank{rank}"] = _compare(critic, critic_spec, mesh.pp_rank)
    for gen_tp in [t for t in (1, 2) if layout.tp % t == 0]:
        gen_layout = GenLayout(layout, gen_tp)
        hybrid = HybridEngine(CFG, mesh, build_gen_mesh(gen_layout), bucket_mb=0.05)
        torch.manual_seed(0)
        gen = hybrid.to_generation(TrainEngine(CFG, mesh, dtype=torch.bfloat16).model)
        rollout = RolloutSpec(max_model_len=32, gen_tp=gen_tp, max_num_seqs=3,
                              reshard_bucket_mb=0.05)
        actor = RoleSpec(CFG, layout, torch.bfloat16)
        p_arena, p_buffers, _, _ = mp.reshard_memory(actor, rollout, mesh.pp_rank)
        store = hybrid._store
        arena = 0 if store.arena is None else store.arena.numel() * store.arena.element_size()
        buffers = sum(b.numel() * b.element_size() for b in store.buffers)
        assert p_arena == arena, (layout, gen_tp, p_arena, arena)
        assert buffers <= p_buffers, (layout, gen_tp, p_buffers, buffers)
        plan = plan_memory({"actor": actor}, rollout, PHASE_USES)
        kv = _kv_bytes(gen, RolloutConfig(max_num_seqs=3, max_model_len=32))
        assert plan.kv_cache == kv, (layout, gen_tp, plan.kv_cache, kv)
        out[f"gen_tp{gen_tp} rank{rank}"] = {"arena": p_arena / max(arena, 1),
                                             "buffers": (buffers, p_buffers),
                                             "kv_cache": plan.kv_cache / kv}
        hybrid.to_training()
        if layout.pp == 1 and gen_tp < layout.tp:   # LoRA: the base kept, merged weights per switch
            lora_hybrid = HybridEngine(CFG, mesh, build_gen_mesh(gen_layout), bucket_mb=0.05)
            lora_gen = lora_hybrid.to_generation(engine.model)
            p_merged, _, _, p_kept = mp.reshard_memory(spec, rollout, 0)
            base = lora_hybrid._lora_base[1]       # an unadapted weight lies in the kept arena
            kept = base["layers.0.mlp.gate_up_proj.weight"].untyped_storage().nbytes()
            merged = [p for n, p in lora_gen.named_parameters() if n in lora_hybrid._lora_names]
            merged_bytes = sum(p.numel() * p.element_size() for p in merged)
            assert p_kept == kept, (layout, gen_tp, p_kept, kept)
            assert merged_bytes <= p_merged <= merged_bytes + 256 * len(merged), \
                (layout, gen_tp, p_merged, merged_bytes)
            lora_hybrid.to_training()


def _kv_bytes(model, config: RolloutConfig) -> int:
    """Bytes of the KV tensors a rollout Engine allocates for `model` (allocation is lazy: the
    first generate would do it; allocate() is that step)."""
    engine = Engine(model, config)
    engine.runner.allocate()
    cache = engine.runner.cache
    total = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
    assert total == cache.num_bytes
    engine.free_cache()
    return total


def _worker(rank, world, layouts, tmp):
    torch.set_num_threads(1)
    for lay in layouts:
        out = {}
        _check_layout(Layout(*lay, sequence_parallel=True), rank, out)
        with open(f"{tmp}/ratios_{lay}_{rank}.json", "w") as f:
            json.dump(out, f)


# --- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_stage_params_are_the_decoders_parameters(tied):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied, attention_bias=not tied)
    for pp in (1, 2, 3):
        for pp_rank in range(pp):
            for value_head in (False, True):
                model = Decoder(cfg, None, False, pp_rank, pp, value_head, device="meta")
                shift = lambda m: f"layers.{int(m.group(1)) + model.layer_start}."  # noqa: E731
                real = [(re.sub(r"layers\.(\d+)\.", shift, n), tuple(p.shape))
                        for n, p in model.named_parameters()]
                assert real == stage_params(cfg, 1, pp, pp_rank, value_head)


def test_one_rank_plan_equals_allocation(one_thread):
    """tp = pp = dp = 1: weights, buckets, master and Adam state; the arena (none: zero-copy)
    and the KV cache."""
    out = {}
    _check_layout(Layout(), 0, out)
    print(json.dumps(out))


@pytest.mark.multiproc
def test_plan_equals_allocation_across_layouts(tmp_path):
    """tp2, pp2, dp2 (ZeRO-1) on two ranks: every rank's bytes as planned."""
    layouts = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
    run_dist(_worker, 2, layouts, str(tmp_path))
    for f in sorted(tmp_path.glob("ratios_*.json")):
        print(f.name, f.read_text())
    assert len(list(tmp_path.glob("ratios_*.json"))) == 6


@pytest.mark.parametrize("tokens, seqs, slots", [(None, 3, 3), (5 * 32, 8, 4), (3 * 32, 8, 2)])
def test_kv_cache_as_the_runner_sizes_it(tokens, seqs, slots, one_thread):
    torch.manual_seed(0)
    model = Decoder(CFG, dtype=torch.bfloat16)
    kv = _kv_bytes(model, RolloutConfig(max_num_seqs=seqs, max_model_len=32,
                                        kv_cache_tokens=tokens))
    rollout = RolloutSpec(max_model_len=32, max_num_seqs=seqs, kv_cache_tokens=tokens)
    plan = plan_memory({"actor": RoleSpec(CFG, Layout())}, rollout, PHASE_USES)
    assert (plan.kv_cache, plan.kv_slots) == (kv, slots)
    assert plan.kv_cache == (slots + 1) * 32 * CFG.num_layers * 2 * 4 * 8 * 2
    assert plan.phases["rollout"]["rollout.kv_cache"] == kv


def _saved_bytes(model, packed) -> int:
    """Bytes autograd saves for backward in one forward (storages counted once, no weights)."""
    seen, params = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(packed)
    return sum(n for p, n in seen.items() if p not in params)


def test_activation_estimate_is_close_to_what_autograd_saves(one_thread):
    """fp32 on the CPU (SDPA per sequence, composite RMSNorm: close to CUDA's layout of saved
    tensors, not equal): the estimate within 25%; recomputation keeps about the layer inputs."""
    cfg = dataclasses.replace(CFG, hidden_size=128, intermediate_size=384, vocab_size=512)
    T = 512
    packed = PackedInput.from_lengths(torch.randint(0, 512, (T,)), [128] * 4)
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Decoder(cfg).train()
        model.recompute_layers = recompute
        saved = _saved_bytes(model, packed)
        spec = RoleSpec(cfg, Layout(), torch.float32, recompute=recompute, train_tokens=T)
        est = role_memory(spec, 0).activations
        if recompute:          # minus the one layer rebuilt in backward, which is not saved
            est -= T * mp.layer_activation_elements(cfg, 1, False) * 4
        print(f"recompute={recompute}: estimate {est} saved {saved} ({est / saved:.2f})")
        assert abs(est / saved - 1) < 0.25 if not recompute else 0.5 < est / saved <= 1.0


def _run_roles(layout, **actor):
    return {"actor": RoleSpec(QWEN2_5_7B, layout, train_tokens=8192, **actor),
            "ref": RoleSpec(QWEN2_5_7B, layout, trained=False, train_tokens=8192),
            "critic": RoleSpec(QWEN2_5_7B, layout, value_head=True, train_tokens=8192)}


def test_fit_error_names_the_largest_parts_and_settings_that_fit():
    """Qwen2.5-7B on 8 GPUs (tp 4, dp 2), no rollout: None on a large device; on one just below
    the peak one line naming the peak phase's largest parts and only settings that, re-planned,
    fit."""
    roles = _run_roles(Layout(4, 1, 2, True))
    plan = plan_memory(roles, None, PHASE_USES)
    assert fit_error(plan, plan.peak) is None
    device = plan.peak - (1 << 30)
    msg = fit_error(plan, device)
    print(msg)
    print(plan.table())
    assert msg and "\n" not in msg and f"{plan.peak_phase} needs" in msg
    biggest = max(plan.phases[plan.peak_phase].items(), key=lambda kv: kv[1])[0]
    assert biggest in msg and "fits with" in msg
    settings = re.findall(r"(\S+=\S+) \(peak", msg)
    candidates = {s: (r, g) for s, r, g in memory_advice._candidates(roles, None) if r is not None}
    assert settings and all(s in candidates for s in settings)
    for s in settings:
        new = plan_memory(candidates[s][0], candidates[s][1], PHASE_USES)
        assert new.peak <= device, s
    tiny = fit_error(plan, 1 << 30)
    assert "no combination" in tiny and "\n" not in tiny


def _apply(roles, rollout, settings):
    """Re-plan a chain of suggested settings, each taken from the candidates of the last."""
    for setting in settings:
        found = {s: (r, g) for s, r, g in memory_advice._candidates(roles, rollout) if r is not None}
        roles, rollout = found[setting]
    return roles, rollout


def test_fit_error_combines_settings_when_no_single_one_fits():
    roles = _run_roles(Layout(4, 1, 2, True))
    device = 30 << 30
    msg = fit_error(plan_memory(roles, None, PHASE_USES), device)
    print(msg)
    chain = re.search(r"fits with (.*) together$", msg).group(1).split(" and ")
    assert len(chain) >= 2
    new_roles, _ = _apply(roles, None, chain)
    assert plan_memory(new_roles, None, PHASE_USES).peak <= device
    assert plan_memory(_apply(roles, None, chain[:-1])[0], None, PHASE_USES).peak > device


def test_fit_error_suggests_the_host_step_only_where_the_host_holds_it():
    """Qwen2.5-7B actor and reference on one GPU of 60 GiB: the suggestions include the host
    step (the only way the update fits), unless host_fits refuses the plans that need it."""
    roles = {r: s for r, s in _run_roles(Layout(1, 1, 1)).items() if r != "critic"}
    plan, device = plan_memory(roles, None, PHASE_USES), 60 << 30
    msg = fit_error(plan, device)
    print(msg)
    assert "actor_rollout_ref.actor.megatron.optimizer_offload=host_step" in msg
    chain = re.search(r"fits with (.*) together$", msg).group(1).split(" and ")
    new_roles, _ = _apply(roles, None, chain)
    assert new_roles["actor"].host_step and plan_memory(new_roles, None, PHASE_USES).peak <= device
    small_host = fit_error(plan, device, host_fits=lambda p: p.host < (10 << 30))
    print(small_host)
    assert "host_step" not in small_host and "no combination" in small_host


def test_rollout_without_kv_room_and_short_cache_warnings():
    """With gpu_memory_utilization the cache takes what the rollout phase leaves; none left is a
    fit error that suggests the utilisation or an offload; fewer slots than the batch, a
    warning."""
    roles = _run_roles(Layout(4, 1, 2, True))
    rollout = RolloutSpec(max_model_len=4096, gen_tp=2, max_num_seqs=1024,
                          gpu_memory_utilization=0.5)
    device = 80 << 30
    plan = plan_memory(roles, rollout, PHASE_USES, device)
    msg = fit_error(plan, device)
    print(msg)
    assert plan.kv_slots == 0 and "\n" not in msg
    assert "gpu_memory_utilization=0.5 of 80.00 GiB leaves no room for one sequence" in msg
    setting = re.search(r"fits with (\S+) \(peak", msg).group(1)
    new_roles, new_rollout = _apply(roles, rollout, [setting])
    assert plan_memory(new_roles, new_rollout, PHASE_USES, device).kv_slots >= 1
    fits = plan_memory(roles, dataclasses.replace(rollout, gpu_memory_utilization=0.9),
                       PHASE_USES, device)
    assert fits.kv_slots > 0 and fits.kv_limit == "memory"
    assert fits.kv_cache == (fits.kv_slots + 1) * 4096 * 28 * 2 * 2 * 128 * 2
    assert fit_error(fits, device) is None
    assert kv_slots_short(fits, fits.kv_slots) is None
    warn = kv_slots_short(fits, fits.kv_slots + 1)
    assert warn and "\n" not in warn and "2 waves" in warn
    print(warn)


def test_offloaded_parts_leave_the_phases_that_do_not_use_them():
    layout = Layout(2, 1, 1, True)
    plain = plan_memory(_run_roles(layout), None, PHASE_USES)
    off = plan_memory(_run_roles(layout, offload=("params", "grads", "optimizer")), None,
                      PHASE_USES)
    actor_parts = {"actor.weights", "actor.grads", "actor.master", "actor.optimizer"}
    assert actor_parts <= set(off.phases["update_actor"])
    assert not actor_parts & set(off.phases["values"])
    assert "actor.weights" in off.phases["old_log_prob"]
    assert off.total("update_actor") == plain.total("update_actor")
    assert off.total("ref") < plain.total("ref")
    table = off.table().splitlines()
    assert table[-1].startswith("total") and len({len(line) for line in table}) == 1
    assert math.isclose(float(table[-1].split()[-1]), off.total("update_actor") / 2**30,
                        abs_tol=0.01)


def test_offloaded_actor_weights_during_generation_are_the_shared_ones():
    """param_offload parks the actor's weights after the gather except those the generation
    model uses in place: all of them at t_g = t (zero-copy), only the norms at t_g < t."""
    layout = Layout(2, 1, 1, True)
    for gen_tp, shared_all in ((2, True), (1, False)):
        roles = _run_roles(layout, offload=("params",))
        plan = plan_memory(roles, RolloutSpec(4096, gen_tp=gen_tp), PHASE_USES)
        weights = plan.roles["actor"].weights
        assert plan.phases["reshard"]["actor.weights"] == weights
        during = plan.phases["rollout"].get("actor.weights", 0)
        assert during == weights if shared_all else 0 < during < weights / 1000
        assert ("rollout.reshard" in plan.phases["rollout"]) != shared_all


# --- in a run: preflight refuses what cannot fit, the trainer prints the plan ---------------------

def test_a_run_that_cannot_fit_its_device_budget_exits_2_with_one_line(tmp_path):
    import sys
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(root / "launch" / "ppo.py"), "trainer.total_training_steps=1",
           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
           "trainer.val_before_train=false"]
    env = {**os.environ, "HYBRIDENGINE_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    from proc_utils import Launches
    launches = Launches()            # both runs at once (one thread each), own output folders
    try:
        for name, gb in (("small", 0.01), ("ok", 4)):
            launches.start(name, cmd + [f"trainer.default_local_dir={tmp_path / name}",
                                        f"trainer.device_memory_gb={gb}"], env=env, timeout=300)
        # the optimizer state offloaded by hand to a host that allows less than it
        launches.start("host", cmd + [f"trainer.default_local_dir={tmp_path / 'host'}",
                                      "trainer.device_memory_gb=4", "trainer.host_memory_gb=0.0001",
                                      "actor_rollout_ref.actor.megatron.optimizer_offload=true"],
                       env=env, timeout=300)
        small, ok, host = (launches.result(n) for n in ("small", "ok", "host"))
    finally:
        launches.close()
    errors = [ln for ln in small.stderr.splitlines() if ln.startswith("error: ")]
    assert small.returncode == 2, small.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith("error: memory plan: update_actor needs "), \
        small.stderr[-2000:]
    assert "but the device has 0.01 GiB" in errors[0]
    assert not (tmp_path / "small").exists()             # refused before anything was written
    errors = [ln for ln in host.stderr.splitlines() if ln.startswith("error: ")]
    assert host.returncode == 2 and len(errors) == 1, host.stderr[-2000:]
    assert errors[0].startswith("error: memory plan: the offloaded state needs ") and \
        "but the host has 0.00 GiB" in errors[0], errors[0]
    assert not (tmp_path / "host").exists()
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "memory plan (GiB per rank, the heaviest rank of each phase, device budget 4.0 GiB)" \
        in ok.stdout
    assert "actor.optimizer" in ok.stdout and "rollout.kv_cache" in ok.stdout


# --- offload=auto: the plan picks the offload ------------------------------------------------------

def _default_run(budget_gb=None, **flags):
    """The default job's tree (tp 1) with `flags` ("actor.grad_offload": True, ...), its layout
    and model shape."""
    from hybridengine.config import load_config, validate_config
    from hybridengine.models.hf import read_model_config
    root = Path(__file__).resolve().parent.parent
    cfg = load_config(["--config", str(root / "configs" / "tiny.yaml"),
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                       f"trainer.device_memory_gb={'null' if budget_gb is None else budget_gb}"])
    for key, value in flags.items():
        role, flag = key.split(".")
        setattr(rl_memory._megatron(cfg, role), flag, value)
    return cfg, validate_config(cfg, 1), read_model_config(cfg.actor_rollout_ref.model.path)


def test_plan_enters_the_old_log_prob_phase_only_where_a_step_does():
    """rl.memory.old_log_prob_runs (its agreement with the trainer: tests/test_on_policy.py,
    tests/test_bypass.py): one mini-batch of the whole batch (epochs aside) takes pi_old from its
    own forward, so the plan has no old_log_prob phase; more mini-batches, KL in the reward, the
    rollout's importance weights or a critic warm-up bring it back; bypass mode never has it."""
    cfg, layout, model = _default_run()
    cpu, a = torch.device("cpu"), cfg.actor_rollout_ref.actor

    def phases():
        return set(rl_memory.plan_run_memory(cfg, layout, model, model, cpu, None).phases)
    a.ppo_mini_batch_size = cfg.data.train_batch_size
    a.ppo_epochs = 2
    assert "old_log_prob" not in phases() and {"rollout", "update_actor"} <= phases()
    for key, value, back in (("data.train_batch_size", 2 * a.ppo_mini_batch_size, a.ppo_mini_batch_size),
                             ("algorithm.use_kl_in_reward", True, False),
                             ("algorithm.rollout_correction.rollout_is", "token", None),
                             ("trainer.critic_warmup", 2, 0)):
        OmegaConf.update(cfg, key, value)
        assert "old_log_prob" in phases(), key
        OmegaConf.update(cfg, key, back)
    assert "old_log_prob" not in phases()
    cfg.data.train_batch_size = 2 * a.ppo_mini_batch_size
    cfg.algorithm.rollout_correction.bypass_mode = True
    assert "old_log_prob" not in phases()


def _holds_batch(cfg, layout, model) -> bool:
    """The run fits its budget and the KV cache holds the whole batch at once."""
    budget = rl_memory.device_budget(cfg, torch.device("cpu"))
    plan = rl_memory.plan_run_memory(cfg, layout, model, model, torch.device("cpu"), budget)
    r = cfg.actor_rollout_ref.rollout
    want = min(r.max_num_seqs, cfg.data.train_batch_size * r.n)
    return fit_error(plan, budget) is None and plan.kv_slots >= want


def test_auto_offload_takes_the_cheapest_parts_that_make_the_batch_fit():
    cpu = torch.device("cpu")
    cfg, layout, model = _default_run()                 # no budget (the CPU): nothing moves
    assert cfg.actor_rollout_ref.actor.megatron.grad_offload == "auto"
    assert rl_memory.resolve_auto_offload(cfg, layout, model, model, cpu) == []
    assert cfg.actor_rollout_ref.actor.megatron.optimizer_offload is False
    assert rl_memory.offload_summary(cfg) == "none"
    lo = round(_static_batch_budget_gb() * 1024)    # MiB: holds its batch without offload
    cfg, layout, model = _default_run((lo - 1) / 1024)  # 1 MiB short: offload must help
    chosen = rl_memory.resolve_auto_offload(cfg, layout, model, model, cpu)
    assert chosen and chosen[0] == "actor.grad_offload=true", chosen   # free: no copy
    assert _holds_batch(cfg, layout, model)
    for dropped in chosen:               # each flag it set is needed
        fewer = dict(item.split("=") for item in chosen if item != dropped)
        fewer = {k: v == "true" if v in ("true", "false") else v for k, v in fewer.items()}
        assert not _holds_batch(*_default_run((lo - 1) / 1024, **{**dict.fromkeys(
            ("actor.param_offload", "actor.grad_offload", "actor.optimizer_offload",
             "ref.param_offload", "critic.param_offload", "critic.grad_offload",
             "critic.optimizer_offload"), False), **fewer})), dropped
    assert rl_memory.offload_summary(cfg).startswith("actor grads")
    # a flag set by hand stays as it is
    cfg, layout, model = _default_run((lo - 1) / 1024, **{"actor.grad_offload": False})
    assert "actor.grad_offload=true" not in rl_memory.resolve_auto_offload(cfg, layout, model,
                                                                           model, cpu)
    assert cfg.actor_rollout_ref.actor.megatron.grad_offload is False
    # nothing fits: every auto flag false, and preflight's error line as before
    cfg, layout, model = _default_run(0.01)
    assert rl_memory.resolve_auto_offload(cfg, layout, model, model, cpu) == []
    assert rl_memory.memory_errors(cfg, layout, model, model, cpu)[0].startswith(
        "memory plan: update_actor needs ")


def _static_batch_budget_gb() -> float:
    """The smallest budget (MiB steps) at which the default job (no offload) holds its whole
    batch in static rows."""
    lo, hi = 1, 4096
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _holds_batch(*_default_run(mid / 1024, **dict.fromkeys(
            ("actor.param_offload", "actor.grad_offload", "actor.optimizer_offload",
             "ref.param_offload", "critic.param_offload", "critic.grad_offload",
             "critic.optimizer_offload"), False))) else (mid + 1, hi)
    assert 1 < lo < 4096
    return lo / 1024


def test_auto_kv_layout_is_paged_only_where_static_rows_would_run_in_waves():
    cpu = torch.device("cpu")
    no_offload = dict.fromkeys(("actor.param_offload", "actor.grad_offload",
                                "actor.optimizer_offload", "ref.param_offload"), False)

    def resolved(budget_gb, *settings, **flags):
        cfg, layout, model = _default_run(budget_gb, **{**no_offload, **flags})
        for key, value in (s.split("=") for s in settings):
            setattr(cfg.actor_rollout_ref.rollout, key, int(value) if value.isdigit() else value)
        rl_memory.resolve_kv_layout(cfg, layout, model, model, cpu)
        report = rl_memory.memory_report(cfg, layout, model, model, cpu)
        return cfg.actor_rollout_ref.rollout.kv_layout, report[-1]

    enough = _static_batch_budget_gb()
    assert _default_run()[0].actor_rollout_ref.rollout.kv_layout == "auto"     # the default
    assert resolved(None)[0] == "static"                 # no budget (the CPU): static rows
    assert resolved(enough)[0] == "static"               # every sequence has its row
    layout, line = resolved(enough - 1 / 1024)           # one row short: waves -> paged
    assert layout == "paged", line
    assert line.startswith("KV cache: paged, blocks of 16 tokens in ") and \
        "a generation replica's 128 sequences are admitted as their blocks fit" in line, line
    # static, with the waves' warning, where paged cannot run or would not help
    for setting in ("attn_backend=flash", "name=vllm", "max_num_seqs=8"):
        layout, line = resolved(enough - 1 / 1024, setting)
        assert layout == "static", setting
        if setting != "name=vllm":
            assert line.startswith("warning: memory plan: the KV cache holds "), line
    layout, line = resolved(enough - 1 / 1024, "kv_layout=static")     # set by hand: kept,
    assert layout == "static" and line.endswith(                         # paged suggested
        "; actor_rollout_ref.rollout.kv_layout=paged (or auto) admits the whole batch in blocks")
    assert not resolved(enough - 1 / 1024, "attn_backend=flash")[1].endswith("in blocks")
    assert resolved(None, "kv_layout=paged")[0] == "paged"


def test_preflight_refuses_paged_where_the_rollout_cannot_take_it():
    from hybridengine.rl.preflight import preflight
    cfg = _default_run()[0]
    cfg.actor_rollout_ref.rollout.kv_layout = "paged"
    cfg.actor_rollout_ref.rollout.attn_backend = "flash"
    _, errors = preflight(cfg, 1)
    assert errors == ["actor_rollout_ref.rollout.kv_layout=paged: rollout.attn_backend=flash "
                      "reads static rows; use static or auto"], errors
    cfg.actor_rollout_ref.rollout.attn_backend = "auto"
    assert preflight(cfg, 1)[1] == []


def test_moe_plan_equals_allocation(one_thread):
    """A Qwen3-MoE actor (stacked experts, models.moe) on one rank: weights and optimizer state
    as planned (stage_params names the stacks); the reshard arena of an fp32 actor with a bf16
    rollout exactly (each stack one aligned run, hybrid.program)."""
    cfg = dataclasses.replace(CFG, model_type="qwen3_moe", qk_norm=True, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=24,
                              mlp_only_layers=(1,))
    mesh = build_mesh(Layout())
    torch.manual_seed(0)
    engine = TrainEngine(cfg, mesh, dtype=torch.bfloat16,
                         optim=OptimConfig(lr=1e-3, bucket_mb=BUCKET_MB))
    assert [(n, tuple(p.shape)) for n, p in engine.model.named_parameters()] == \
        stage_params(cfg, 1)
    _one_step(engine, 1, False)
    _compare(engine, RoleSpec(cfg, Layout(), torch.bfloat16, bucket_mb=BUCKET_MB), 0)
    hybrid = HybridEngine(cfg, mesh, build_gen_mesh(GenLayout(Layout(), 1)),
                          dtype=torch.bfloat16)
    hybrid.to_generation(TrainEngine(cfg, mesh, dtype=torch.float32).model)
    rollout = RolloutSpec(max_model_len=32, max_num_seqs=3, dtype=torch.bfloat16)
    arena, _, _, _ = mp.reshard_memory(RoleSpec(cfg, Layout(), torch.float32), rollout, 0)
    assert arena == hybrid._store.arena.numel() * hybrid._store.arena.element_size()
    hybrid.to_training()


def test_host_memory_is_what_the_offload_keeps_on_the_host(one_thread):
    """MemoryPlan.host: the host step's master and moments (HostStep's own state, after a step)
    and the host copies of offloaded weights and optimizer state (TrainEngine.park); offloaded
    gradients are freed, not kept."""
    mesh = build_mesh(Layout())
    spec = RoleSpec(CFG, Layout(), torch.bfloat16, bucket_mb=BUCKET_MB)
    torch.manual_seed(0)
    engine = TrainEngine(CFG, mesh, dtype=torch.bfloat16,
                         optim=OptimConfig(lr=1e-3, bucket_mb=BUCKET_MB, host_step=True))
    _one_step(engine, 1, False)
    host_step = dataclasses.replace(spec, host_step=True, offload=("optimizer", "grads"))
    state = engine.optimizer.memory_bytes()            # master and moments, on the host
    assert all(b.master.device.type == "cpu" for b in engine.optimizer.buckets)
    assert mp.host_memory(host_step, role_memory(host_step, 0)) == state
    def _fresh():                # host buffers stay allocated once parked: a new engine
        torch.manual_seed(0)
        e = TrainEngine(CFG, mesh, dtype=torch.bfloat16,
                        optim=OptimConfig(lr=1e-3, bucket_mb=BUCKET_MB))
        _one_step(e, 1, False)
        return e
    engine = _fresh()
    for parts in (("params",), ("optimizer",), ("grads",), ("params", "grads", "optimizer")):
        engine.park(list(parts))
        off = dataclasses.replace(spec, offload=parts)
        assert mp.host_memory(off, role_memory(off, 0)) == engine.host_bytes(), parts
        engine.unpark(list(parts))
        engine = _fresh()
    plan = plan_memory({"actor": host_step, "ref": dataclasses.replace(
        spec, trained=False, offload=("params",))}, None, PHASE_USES)
    assert plan.host == state + role_memory(spec, 0).weights


def test_host_step_keeps_master_and_moments_off_the_device_in_every_phase():
    """optimizer_offload=host_step (train/host_step.py): no fp32 master or Adam moment on the
    device in any phase; the update's new weight shards (parameter dtype, allocated after the
    backward) are bounded by the activations they follow. At the Qwen2.5-7B shape on one rank
    the update then needs weights + fp32 grads + activations + logits, not the 12 bytes per
    parameter more of the device step."""
    layout = Layout(1, 1, 1)
    device = RoleSpec(QWEN2_5_7B, layout, train_tokens=8192, compiled=True)
    host = dataclasses.replace(device, host_step=True, offload=("optimizer",))
    on, off = role_memory(device, 0), role_memory(host, 0)
    assert on.master > 0 and on.optimizer == 2 * on.master
    assert off.master == off.optimizer == 0
    assert (off.weights, off.grads, off.logits) == (on.weights, on.grads, on.logits)
    shards = on.master // 4 * 2                 # this rank's bf16 slice of every bucket
    assert off.activations == max(on.activations, shards)
    plan = plan_memory({"actor": host}, None, PHASE_USES)
    for phase, parts in plan.phases.items():
        assert not {"actor.master", "actor.optimizer"} & set(parts), phase
    assert plan.total("update_actor") == sum(
        (off.weights, off.grads, off.activations, off.logits))
    # a tiny budget's activations under the shards: the shards count instead
    small = dataclasses.replace(host, train_tokens=16)
    assert role_memory(small, 0).activations == shards


def test_host_budget_is_the_memory_available_at_start(monkeypatch):
    """The report printed once the offloaded state is pinned names the budget preflight
    checked against, not what the run itself has left of the host."""
    available = ["MemAvailable:   100000000 kB\n"]
    real_open = builtins.open
    def fake_open(path, *a, **k):
        if path == "/proc/meminfo":
            return io.StringIO("MemTotal:   130000000 kB\n" + available[0])
        return real_open(path, *a, **k)
    cfg = SimpleNamespace(trainer=SimpleNamespace(host_memory_gb=None))
    cuda = torch.device("cuda")
    rl_memory._host_available_at_start.cache_clear()
    monkeypatch.setattr(builtins, "open", fake_open)
    try:
        start = rl_memory.host_budget(cfg, cuda)
        assert start == int(rl_memory.HOST_SHARE * 100000000 * 1024)
        available[0] = "MemAvailable:   10000000 kB\n"        # the run pinned 86 GiB since
        assert rl_memory.host_budget(cfg, cuda) == start
        assert rl_memory.host_budget(cfg, torch.device("cpu")) is None
        cfg.trainer.host_memory_gb = 8.0
        assert rl_memory.host_budget(cfg, cuda) == 8 * 2**30
    finally:
        monkeypatch.undo()
        rl_memory._host_available_at_start.cache_clear()


def test_graphed_roles_hold_one_pool_of_training_activations_in_every_phase():
    """RoleSpec.graphed (train.cuda_graphs): the graphed roles' largest training activations,
    padded by the bucket (1/16), sit in one pool in every phase, in place of the update's own
    (forward-only passes keep their eager working set); a role trained eagerly keeps its
    activations in its update only. The start report's line names the graphed roles and the
    pool, or why a role asking for graphs trains eagerly. Through rl.memory, a
    run's use_cuda_graph plans the pool on CUDA where the engine graphs, not on the CPU."""
    layout, seq = Layout(), RolloutSpec(4096)
    actor = RoleSpec(QWEN2_5_7B, layout, train_tokens=8192)
    critic = RoleSpec(QWEN2_5_7B, layout, value_head=True, train_tokens=4096)
    plain = plan_memory({"actor": actor, "critic": critic}, seq, PHASE_USES)
    graphed = plan_memory({"actor": dataclasses.replace(actor, graphed=True),
                           "critic": dataclasses.replace(critic, graphed=True)}, seq, PHASE_USES)
    act = plain.roles["actor"].activations
    assert act > plain.roles["critic"].activations > 0
    pool = int(act * (1 + 1 / 16))
    for phase, parts in graphed.phases.items():
        assert parts["graphs.pool"] == pool, phase
        # the forward-only passes run eagerly: their working set stays theirs
        assert parts.get("actor.activations") == plain.phases[phase].get(
            "actor.activations") if phase == "old_log_prob" else "actor.activations" not in parts
    assert "critic.activations" not in graphed.phases["update_critic"]
    assert graphed.phases["rollout"] == {**plain.phases["rollout"], "graphs.pool": pool}
    update = graphed.phases["update_actor"]
    assert sum(update.values()) == sum(plain.phases["update_actor"].values()) + pool - act
    # one role graphed: the other's update keeps its own activations beside the pool
    half = plan_memory({"actor": actor, "critic": dataclasses.replace(critic, graphed=True)},
                       seq, PHASE_USES)
    assert half.phases["update_actor"]["actor.activations"] == act
    assert half.phases["update_actor"]["graphs.pool"] == \
        int(plain.roles["critic"].activations * (1 + 1 / 16))
    cfg, run_layout, model = _default_run(100)      # a budget: no device is asked its size
    cfg.actor_rollout_ref.actor.use_cuda_graph = True
    cfg.actor_rollout_ref.actor.megatron.param_dtype = "bfloat16"
    for device, planned in ((torch.device("cpu"), False), (torch.device("cuda", 0), True)):
        plan = rl_memory.plan_run_memory(cfg, run_layout, model, model, device, None)
        assert ("graphs.pool" in plan.phases["rollout"]) == planned, device
    cuda = torch.device("cuda", 0)
    pool = rl_memory.plan_run_memory(cfg, run_layout, model, model, cuda, None).phases[
        "rollout"]["graphs.pool"]
    # the start report: which roles run in graphs and the pool, or why a role trains eagerly
    line = rl_memory.memory_report(cfg, run_layout, model, model, cuda)[-1]
    assert line == f"training CUDA graphs: actor (a pool of {memory_advice.gib_text(pool)} " \
        f"held in every phase)", line
    assert rl_memory.memory_report(cfg, run_layout, model, model, torch.device("cpu"))[-1] == \
        "training CUDA graphs: actor eager: not on CUDA"
    rl_memory._megatron(cfg, "actor").grad_offload = True     # buckets move every step
    assert rl_memory.memory_report(cfg, run_layout, model, model, cuda)[-1].startswith(
        "training CUDA graphs: actor eager: its weights or gradients are offloaded")
    rl_memory._megatron(cfg, "actor").grad_offload = False
    cfg.actor_rollout_ref.model.enable_gradient_checkpointing = True
    assert rl_memory.memory_report(cfg, run_layout, model, model, cuda)[-1] == \
        "training CUDA graphs: actor eager: activation recomputation"
    cfg.actor_rollout_ref.actor.use_cuda_graph = False
    plan = rl_memory.plan_run_memory(cfg, run_layout, model, model, cuda, None)
    assert "graphs.pool" not in plan.phases["rollout"]
    assert not rl_memory.memory_report(cfg, run_layout, model, model, cuda)[-1].startswith(
        "training CUDA graphs")
