"""Config loading, verl compatibility, one-line errors, cross-field checks, layouts."""
import fnmatch
import logging
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from hybridengine.config import ConfigError, derive_layout, describe_layers, load_config, validate_config
from hybridengine.config.checks import RANGES
from hybridengine.config.loading import ALIASES, CHOICES, IGNORED, SPECS

# The seed's verl quickstart command, verbatim after `launch/ppo.py`.
VERL_COMMAND = """
 data.train_files=data/processed/gsm8k/train.parquet data.val_files=data/processed/gsm8k/test.parquet \
 data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=256 \
 actor_rollout_ref.model.path=pretrained_models/Qwen2.5-0.5B-Instruct \
 actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
 actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 critic.optim.lr=1e-5 \
 critic.model.path=pretrained_models/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4 \
 algorithm.kl_ctrl.kl_coef=0.001 trainer.logger=['console'] trainer.val_before_train=False \
 trainer.default_hdfs_dir=null trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=10 \
 trainer.test_freq=10 trainer.total_epochs=15
"""
RECIPE = ["--config", "configs/gsm8k_qwen2_5_0_5b.yaml"]


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch):
    """trainer.device=auto resolves to the CPU here, on a GPU machine too: these tests read the
    CPU defaults (the CUDA ones: test_cuda_defaults_*)."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def test_verl_command_is_accepted(caplog):
    with caplog.at_level(logging.WARNING, logger="hybridengine.config"):
        cfg = load_config(shlex.split(VERL_COMMAND))
    assert cfg.data.train_batch_size == 256 and cfg.data.max_response_length == 256
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.critic.optim.lr == pytest.approx(1e-5)
    assert cfg.trainer.logger == ["console"] and cfg.trainer.val_before_train is False
    # interpolations follow the overrides
    assert cfg.actor_rollout_ref.rollout.response_length == 256
    assert cfg.critic.ppo_mini_batch_size == 64
    assert cfg.trainer.default_local_dir == "checkpoints/hybridengine/gsm8k"
    assert "default_hdfs_dir" not in cfg.trainer
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring verl keys that have no meaning in hybridengine: trainer.default_hdfs_dir"]
    layout = validate_config(cfg, world_size=1)
    assert layout.critic is not None and layout.ref is None     # PPO with GAE, KL off


def test_every_error_of_a_config_comes_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(["trainer.total_trainig_steps=1", "data.train_batch_size=x", "nonsense",
                     "--config", str(tmp_path / "nope.yaml")])
    assert info.value.errors == [
        "argument 'nonsense' is not a key=value override",
        f"--config file {tmp_path / 'nope.yaml'} does not exist",
        "unknown config key 'trainer.total_trainig_steps' (nearest known key: "
        "'trainer.total_training_steps')",
        "data.train_batch_size='x': expected an integer, got str"]
    # verl's quickstart without its micro-batch sizes: each missing key in one go
    dropped = ("critic.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.log_prob_micro",
               "actor_rollout_ref.actor.ppo_micro")
    cfg = load_config([a for a in shlex.split(VERL_COMMAND) if not a.startswith(dropped)])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, world_size=1)
    assert info.value.errors == [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu must be set when "
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "critic.ppo_micro_batch_size_per_gpu must be set when critic.use_dynamic_bsz=false",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu must be set when "
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false"]


def test_config_layers_are_described_in_merge_order(tmp_path):
    mine = tmp_path / "mine.yaml"
    assert describe_layers(["a.b=1", "--config", "configs/grpo.yaml", f"--config={mine}", "c=2"]) \
        == f"defaults (configs/ppo_trainer.yaml) + configs/grpo.yaml + {mine} + 2 command-line overrides"
    assert describe_layers([]) == "defaults (configs/ppo_trainer.yaml)"


def test_recipe_file_equals_the_command():
    from_file = load_config(RECIPE)
    from_command = load_config(shlex.split(VERL_COMMAND))
    assert from_file == from_command


def test_defaults_are_self_consistent():
    from omegaconf import OmegaConf
    cfg = load_config([])
    leaves = set(_leaves(OmegaConf.to_container(cfg)))
    tables = list(SPECS) + list(CHOICES) + list(ALIASES.values()) + [k for _, _, keys in RANGES for k in keys]
    assert not [k for k in tables if k not in leaves]
    # an ignore pattern must never swallow a real key
    assert not [(k, p) for k in leaves for p in IGNORED if fnmatch.fnmatchcase(k, p)]
    for key, choices in CHOICES.items():
        assert OmegaConf.select(cfg, key) in choices


def test_choice_lists_are_the_subsystems_own():
    """One copy of every choice list: the config layer's are the very tuples of the modules that
    act on the values."""
    from hybridengine.rl import advantages, kl, losses
    from hybridengine.rollout import rollout_config
    assert CHOICES["actor_rollout_ref.actor.loss_agg_mode"] is losses.LOSS_AGG_MODES
    assert CHOICES["algorithm.kl_penalty"] is kl.KL_KINDS
    assert CHOICES["algorithm.filter_groups.metric"] is advantages.FILTER_METRICS
    assert CHOICES["actor_rollout_ref.rollout.attn_backend"] is rollout_config.BACKENDS
    assert CHOICES["actor_rollout_ref.rollout.prefill_attention"] is \
        rollout_config.PREFILL_ATTENTION
    assert set(CHOICES["algorithm.adv_estimator"]) == set(advantages._ADV_ESTIMATORS)


@pytest.mark.parametrize("override, nearest", [
    ("actor_rollout_ref.actor.ppo_mini_batchsize=4", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("actor_rollout_ref.actr.optim.lr=1", "actor_rollout_ref.actor.optim.lr"),
    ("algorithm.kl_ctrl.kl_coeff=0.1", "algorithm.kl_ctrl.kl_coef"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
])
def test_unknown_key_names_nearest(override, nearest):
    key = override.partition("=")[0]
    with pytest.raises(ValueError, match=f"unknown config key '{key}' .*'{nearest}'"):
        load_config([override])


def test_ignored_keys_warn_once(caplog):
    with caplog.at_level(logging.WARNING, logger="hybridengine.config"):
        cfg = load_config(["actor_rollout_ref.model.use_remove_padding=True",
                           "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                           "+ray_init.num_cpus=4",
                           "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null",
                           "trainer.balance_batch=True", "trainer.balance_batch=True"])
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert message.count("trainer.balance_batch") == 1
    for key in ("use_remove_padding", "fsdp_config.param_offload", "ray_init.num_cpus",
                "virtual_pipeline"):
        assert key in message
    assert "fsdp_config" not in cfg.actor_rollout_ref.actor


def test_unsupported_feature_rejected_unless_neutral():
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=2 is not supported"):
        load_config(["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"])
    # expert parallelism is built (MoE): a key of the tree, typed like the other sizes
    cfg = load_config(["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"])
    assert cfg.actor_rollout_ref.actor.megatron.expert_model_parallel_size == 2
    assert cfg.critic.megatron.expert_model_parallel_size == 2        # the critic follows
    with pytest.raises(ValueError, match="expert_model_parallel_size='x': expected an integer"):
        load_config(["actor_rollout_ref.actor.megatron.expert_model_parallel_size=x"])


@pytest.mark.parametrize("override, message", [
    ("data.train_batch_size=abc", "data.train_batch_size='abc': expected an integer, got str"),
    ("data.train_batch_size=True", "expected an integer, got bool"),
    ("data.train_batch_size=8.5", "expected an integer, got float"),
    ("trainer.logger=5", "trainer.logger=5: expected a list of strings, got int"),
    ("trainer.logger=[console,5]", "expected a list of strings"),
    ("trainer.logger={a: 1}", "expected a list of strings, got dict"),
    ("actor_rollout_ref.actor.use_kl_loss=maybe", "expected true/false"),
    ("actor_rollout_ref.actor.optim.lr=fast", "expected a number"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=x", "expected an integer or null"),
    ("data.train_files=null", "data.train_files=null: expected a path or a list of paths"),
    ("algorithm.adv_estimator=ppo", "choose one of gae, grpo, rloo, reinforce_plus_plus"),
    ("actor_rollout_ref.actor.loss_agg_mode=mean", "choose one of token-mean"),
    ("trainer.cuda_allocator=expandable", "choose one of auto, expandable_segments, default"),
    ("trainer=1", "trainer is a config section"),
    ("data.train_batch_size=${data.nope}", "interpolation failed"),
])
def test_wrong_types_are_one_line(override, message):
    with pytest.raises(ValueError) as info:
        load_config([override])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_widening_and_hydra_syntax():
    cfg = load_config(["critic.optim.lr=1", "trainer.experiment_name=2024", "trainer.logger=tensorboard",
                       "+trainer.seed=7", "++data.val_files=null", "data.train_files=[a.parquet,b.jsonl]",
                       "actor_rollout_ref.actor.optim.warmup_style=cosine",
                       "actor_rollout_ref.actor.optim.clip_grad=0.5",
                       "trainer.total_training_steps=${data.train_batch_size}"])
    assert cfg.critic.optim.lr == 1.0 and isinstance(cfg.critic.optim.lr, float)
    assert cfg.trainer.experiment_name == "2024" and cfg.trainer.logger == ["tensorboard"]
    assert cfg.trainer.seed == 7 and cfg.data.val_files is None
    assert list(cfg.data.train_files) == ["a.parquet", "b.jsonl"]
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"      # verl alias
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5                          # Megatron alias
    assert cfg.trainer.total_training_steps == 1024
    with pytest.raises(Exception):
        cfg.trainer.not_a_key                                                    # struct mode


def test_bad_arguments():
    with pytest.raises(ValueError, match="not a key=value"):
        load_config(["trainer.logger"])
    with pytest.raises(ValueError, match="unknown argument '--foo'"):
        load_config(["--foo"])
    with pytest.raises(ValueError, match="deleting keys"):
        load_config(["~trainer.logger"])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(["--config", "nope.yaml"])


def test_config_files_merge_in_order_then_overrides(tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("data:\n  train_batch_size: 32\ntrainer:\n  project_name: p1\n")
    second.write_text("trainer:\n  project_name: p2\n  experiment_name: e2\n")
    # overrides win even when written before the files
    cfg = load_config(["trainer.experiment_name=cli", "--config", str(first), f"--config={second}"])
    assert cfg.data.train_batch_size == 32
    assert cfg.data.max_prompt_length == 512                       # untouched default
    assert cfg.trainer.project_name == "p2" and cfg.trainer.experiment_name == "cli"
    assert cfg.trainer.default_local_dir == "checkpoints/p2/cli"
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_rollout_ref:\n  actor:\n    ppo_epoch: 2\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown config key 'actor_rollout_ref.actor.ppo_epoch'"):
        load_config(["--config", str(bad)])
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [unclosed\n")
    with pytest.raises(ValueError, match="broken.yaml: invalid YAML"):
        load_config(["--config", str(broken)])


def test_algorithm_presets_layer_over_the_recipe():
    grpo = load_config(RECIPE + ["--config", "configs/grpo.yaml"])
    layout = validate_config(grpo, world_size=1)
    assert grpo.algorithm.adv_estimator == "grpo" and grpo.actor_rollout_ref.rollout.n == 8
    assert layout.critic is None and layout.ref is not None
    dapo = load_config(RECIPE + ["--config", "configs/dapo.yaml"])
    layout = validate_config(dapo, world_size=1)
    actor = dapo.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert dapo.algorithm.filter_groups.enable and dapo.reward_model.overlong_buffer.enable
    assert layout.critic is None and layout.ref is None


# the fast paths: the CUDA defaults (configs/cuda_defaults.yaml) and what follows from them
FAST = {"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.use_torch_compile": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 8192, "critic.use_dynamic_bsz": True,
        "critic.ppo_max_token_len_per_gpu": 8192, "critic.use_torch_compile": True,
        "actor_rollout_ref.rollout.enforce_eager": False, "actor_rollout_ref.rollout.compile": True,
        "actor_rollout_ref.rollout.compile_prefill": True,
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 16384,
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 16384,
        "critic.forward_max_token_len_per_gpu": 16384}


def test_cuda_defaults_are_the_benchmarked_fast_paths():
    """On CUDA the defaults are the settings tools/bench_ppo.py measures (bench/RESULTS.md)."""
    from tool_utils import load_tool
    overrides = load_tool("bench_ppo").overrides
    fast = load_config(RECIPE + ["trainer.device=cuda"])
    validate_config(fast, world_size=1)
    args = SimpleNamespace(algo="ppo", workload="seed", rollout_compile=True, train_compile=True,
                           max_tokens=8192, warmup=0, steps=1, profile=False, host_profile=False,
                           defaults=False,
                           val_every=0)
    bench = load_config(RECIPE + overrides(args, Path("m"), Path("d.jsonl"), Path("out")))
    for key in FAST:
        assert OmegaConf.select(fast, key) == OmegaConf.select(bench, key), key


def test_cuda_defaults_apply_under_the_run_own_keys(tmp_path, monkeypatch):
    """trainer.device=auto with a GPU (faked here) or cuda: the CUDA defaults under every key
    the run does not set (in a --config file or on the command line); cpu: none."""
    import torch

    def but_device(argv):
        cfg = OmegaConf.to_container(load_config(RECIPE + argv))
        del cfg["trainer"]["device"]
        return cfg
    cpu = but_device([])
    assert cpu == but_device(["trainer.device=cpu"])
    assert not cpu["actor_rollout_ref"]["rollout"]["compile"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fast = load_config(RECIPE)
    assert but_device([]) == but_device(["trainer.device=cuda"]) != cpu
    assert but_device(["trainer.device=cpu"]) == cpu
    assert {key: OmegaConf.select(fast, key) for key in FAST} == FAST
    mine = tmp_path / "mine.yaml"
    mine.write_text("actor_rollout_ref:\n  actor:\n    use_torch_compile: false\n")
    own = load_config(RECIPE + ["--config", str(mine), "actor_rollout_ref.rollout.enforce_eager=true",
                                "critic.ppo_max_token_len_per_gpu=4096"])
    rollout = own.actor_rollout_ref.rollout
    assert rollout.enforce_eager and rollout.compile and rollout.compile_prefill
    assert not own.actor_rollout_ref.actor.use_torch_compile and not own.critic.use_torch_compile
    # the forward-only budget is a CUDA default of its own, as the actor's log-prob one
    assert own.critic.ppo_max_token_len_per_gpu == 4096
    assert own.critic.forward_max_token_len_per_gpu == 16384
    assert own.actor_rollout_ref.actor.use_dynamic_bsz and own.critic.use_dynamic_bsz
    assert describe_layers(RECIPE) == ("defaults (configs/ppo_trainer.yaml) + CUDA defaults "
                                       "(configs/cuda_defaults.yaml) + configs/gsm8k_qwen2_5_0_5b.yaml")
    assert "CUDA" not in describe_layers(RECIPE + ["trainer.device=cpu"])
    assert "CUDA" not in describe_layers(["--config", "configs/tiny.yaml"])   # device: cpu


def _tp_pp(tp, pp):
    return [f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
            f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}"]


@pytest.mark.parametrize("overrides, world_size, message", [
    (["data.train_batch_size=100"], 1, "data.train_batch_size=100 must be a multiple of "
                                       "actor_rollout_ref.actor.ppo_mini_batch_size=64"),
    (["trainer.n_gpus_per_node=null", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
      "data.train_batch_size=4"], 4, "ppo_mini_batch_size * rollout.n = 2*1 sequences do not split over "
                                     "data-parallel size 4"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"], 1, "ppo_micro_batch_size_per_gpu=5 must divide"),
    (["critic.ppo_micro_batch_size_per_gpu=null"], 1, "critic.ppo_micro_batch_size_per_gpu must be set"),
    (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null"], 1,
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu must be set"),
    (["trainer.n_gpus_per_node=6"] + _tp_pp(2, 2), 6, "2*2 must be positive and divide the world size 6"),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"] + _tp_pp(2, 1), 4,
     "rollout.tensor_model_parallel_size=4 must divide actor tp*pp = 2*1"),
    (["trainer.n_gpus_per_node=2"], 1, "trainer.nnodes * trainer.n_gpus_per_node = 1*2"),
    (["algorithm.adv_estimator=grpo"], 1, "set actor_rollout_ref.rollout.n >= 2"),
    (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=64"], 1,
     "needs reward_model.reward_manager=dapo"),
    (["reward_model.overlong_buffer.enable=true", "reward_model.reward_manager=dapo",
      "reward_model.overlong_buffer.len=999"], 1, "overlong_buffer.len=999 must be in (0, data.max_response_length=256]"),
    (["data.gen_batch_size=512"], 1, "only used with algorithm.filter_groups.enable=true"),
    (["reward_model.enable=true"], 1, "model-based rewards are not supported"),
    (["trainer.resume_mode=resume_path"], 1, "needs trainer.resume_from_path"),
    (["actor_rollout_ref.actor.clip_ratio_c=1.0"], 1, "clip_ratio_c=1.0 must be > 1"),
    (["actor_rollout_ref.rollout.top_p=0"], 1, "top_p=0.0 must be in (0, 1]"),
    (["actor_rollout_ref.model.path=null"], 1, "actor_rollout_ref.model.path must be set"),
])
def test_cross_field_errors(overrides, world_size, message):
    cfg = load_config(RECIPE + overrides)
    with pytest.raises(ValueError) as info:
        validate_config(cfg, world_size)
    assert any(message in line for line in str(info.value).splitlines())   # a line per error


def test_dynamic_bsz_needs_no_micro_batch_size():
    cfg = load_config(RECIPE + ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                                "critic.ppo_micro_batch_size_per_gpu=null",
                                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null"])
    validate_config(cfg, world_size=1)


def test_layout_derivation():
    cfg = load_config(RECIPE + ["--config", "configs/grpo.yaml", "trainer.n_gpus_per_node=8",
                                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1"] + _tp_pp(2, 2))
    layout = validate_config(cfg, world_size=8)
    assert (layout.actor.tp, layout.actor.pp, layout.actor.dp, layout.actor.sequence_parallel) == (2, 2, 2, True)
    assert (layout.ref.tp, layout.ref.pp, layout.ref.dp) == (2, 1, 4)     # tp inherited from the actor
    assert layout.critic is None
    assert (layout.rollout.tp, layout.rollout.dp, layout.rollout.micro_dp) == (2, 4, 2)
    # with tp = 1 sequence parallelism is off whatever the flag says
    assert not derive_layout(load_config(RECIPE), 1).actor.sequence_parallel


_ULYSSES, _CP = "actor_rollout_ref.actor.ulysses_sequence_parallel_size", \
    "actor_rollout_ref.actor.megatron.context_parallel_size"


@pytest.mark.parametrize("overrides, attention", [
    ([f"{_ULYSSES}=2"], "ulysses"), ([f"{_CP}=2"], "allgather"),
    ([f"{_CP}=2", "actor_rollout_ref.actor.megatron.cp_comm_type=p2p"], "ring")])
def test_context_parallel_layout(overrides, attention):
    """Either key gives every role CP 2 (ref and critic follow the actor); CP ranks are replicas
    for the generation layout."""
    cfg = load_config(RECIPE + overrides + ["trainer.n_gpus_per_node=8",
                                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                "actor_rollout_ref.actor.use_kl_loss=true"] + _tp_pp(2, 1))
    layout = validate_config(cfg, world_size=8)
    for role in (layout.actor, layout.ref, layout.critic):
        assert (role.tp, role.cp, role.dp, role.cp_attention) == (2, 2, 2, attention)
    assert (layout.rollout.dp, layout.rollout.micro_dp) == (4, 1)


@pytest.mark.parametrize("overrides, world_size, message", [
    ([f"{_ULYSSES}=2", f"{_CP}=2"], 4, f"{_ULYSSES}=2 and {_CP}=2: context parallelism is one"),
    ([f"{_CP}=3"], 4, f"pipeline_model_parallel_size * {_CP} = 1*1*3 must be positive and divide"),
    ([f"{_ULYSSES}=0"], 4, f"{_ULYSSES}=0 must be >= 1"),
    ([f"{_CP}=2", "actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.train_batch_size=3"], 4,
     "do not split over data-parallel size 2 (= world / (tp 1 * pp 1 * cp 2))"),
])
def test_context_parallel_errors(overrides, world_size, message):
    cfg = load_config(RECIPE + ["trainer.n_gpus_per_node=null"] + overrides)
    with pytest.raises(ValueError) as info:
        validate_config(cfg, world_size)
    assert any(message in line for line in str(info.value).splitlines()), str(info.value)


# --- the typed run config (config.run) -------------------------------------------------------

@pytest.mark.parametrize("config_file", sorted(p.name for p in (Path(__file__).resolve().parent.parent
                                                                / "configs").glob("*.yaml")))
def test_typed_config_mirrors_every_shipped_config_key_for_key(config_file):
    from hybridengine.config.run import RunConfig
    cfg = load_config(["--config", f"configs/{config_file}", "actor_rollout_ref.model.path=m"])
    meg = cfg.actor_rollout_ref.actor.megatron
    world = meg.tensor_model_parallel_size * meg.pipeline_model_parallel_size
    run = RunConfig.build(cfg, derive_layout(cfg, world))
    # every leaf of the tree is the typed config's value at the same path (lists as tuples)
    def leaves(node, prefix=""):
        for key, value in node.items():
            if OmegaConf.is_dict(value):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    for key, value in leaves(cfg):
        typed = run
        for part in key.split("."):
            typed = getattr(typed, part)
        expected = tuple(value) if OmegaConf.is_list(value) else value
        if key in ("data.train_files", "data.val_files") and isinstance(value, str):
            expected = (value,)
        assert typed == expected, key
    assert run.layout.actor.tp == meg.tensor_model_parallel_size


def test_typed_config_refuses_a_tree_the_schema_does_not_describe():
    from hybridengine.config.run import RunConfig
    cfg = load_config(RECIPE)
    OmegaConf.set_struct(cfg, False)
    cfg.trainer.hybrid_engine.new_knob = 3
    with pytest.raises(TypeError, match=r"trainer\.hybrid_engine.*only in the tree \['new_knob'\]"):
        RunConfig.build(cfg, derive_layout(load_config(RECIPE), 1))
