"""Cross-field checks that need the world size, and the parallel layout they derive.

`derive_layout(cfg, world_size)` turns the config into the run's layouts (parallel.layout.RunLayout:
per-role (tp, pp, dp) and the generation layout); `validate_config(cfg, world_size)` runs every check (single-field ranges, batch
divisibility per verl's semantics, parallel sizes, algorithm combinations) and returns that
layout. Each failure is one line naming the key and value; every failure of a config is reported
at once (one ConfigError, a line each). The checks are generators of those lines.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hybridengine.config.errors import ConfigError
from hybridengine.config.loading import ACTOR as _A, REF as _F, ROLLOUT as _R
from hybridengine.parallel.layout import CP_COMM_TYPES, GenLayout, Layout, RunLayout

_M = "actor_rollout_ref.model."


# ----------------------------------------------------------------------------- layout


# estimators whose baseline is the other responses to the same prompt (rollout.n >= 2)
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg")


def uses_critic(cfg: DictConfig) -> bool:
    return cfg.algorithm.adv_estimator == "gae"


def uses_reference(cfg: DictConfig) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def _role_layout(role: DictConfig, section: str, world_size: int) -> Layout:
    """A role's layout; its context parallelism from either of verl's keys: Ulysses
    (ulysses_sequence_parallel_size) or megatron.context_parallel_size, K/V all-gathered or in
    a ring by megatron.cp_comm_type; its expert parallelism from
    megatron.expert_model_parallel_size (parallel.layout)."""
    megatron, ulysses = role.megatron, role.ulysses_sequence_parallel_size
    cp = megatron.context_parallel_size
    for key, size in (("ulysses_sequence_parallel_size", ulysses),
                      ("megatron.context_parallel_size", cp),
                      ("megatron.expert_model_parallel_size",
                       megatron.expert_model_parallel_size)):
        if size < 1:
            raise ValueError(f"{section}.{key}={size} must be >= 1")
    if ulysses > 1 and cp > 1:
        raise ValueError(f"{section}.ulysses_sequence_parallel_size={ulysses} and "
                         f"{section}.megatron.context_parallel_size={cp}: context parallelism "
                         f"is one or the other (set the unused one to 1)")
    size, attention, key = (ulysses, "ulysses", "ulysses_sequence_parallel_size") \
        if ulysses > 1 else (cp, CP_COMM_TYPES[megatron.cp_comm_type],
                             "megatron.context_parallel_size")
    return Layout.of_world(megatron.tensor_model_parallel_size,
                           megatron.pipeline_model_parallel_size, world_size,
                           bool(megatron.sequence_parallel), section + ".megatron", size,
                           attention, f"{section}.{key}", megatron.expert_model_parallel_size)


def derive_layout(cfg: DictConfig, world_size: int) -> RunLayout:
    """The run's layouts (parallel.layout, where their rules live) from the config and the world
    size: actor, reference and critic (when the algorithm uses them) and the generation layout."""
    if world_size < 1:
        raise ValueError(f"world size {world_size} must be >= 1")
    aro = cfg.actor_rollout_ref
    actor = _role_layout(aro.actor, _A.rstrip("."), world_size)
    ref = _role_layout(aro.ref, _F.rstrip("."), world_size) if uses_reference(cfg) else None
    critic = _role_layout(cfg.critic, "critic", world_size) if uses_critic(cfg) else None
    rollout = GenLayout(actor, aro.rollout.tensor_model_parallel_size)
    return RunLayout(actor, rollout, ref, critic)


# ----------------------------------------------------------------------------- validation

# Single-field ranges (null skips the check for nullable keys).
RANGES: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    ("must be > 0", lambda v: v > 0, (
        "data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
        "data.gen_batch_size", "data.val_batch_size", _A + "ppo_mini_batch_size",
        _A + "ppo_micro_batch_size_per_gpu", _A + "ppo_max_token_len_per_gpu", _A + "ppo_epochs",
        _A + "clip_ratio", _A + "clip_ratio_low", _A + "clip_ratio_high", _R + "n", _R + "max_num_seqs",
        _R + "block_size",
        _R + "val_kwargs.n", _R + "log_prob_micro_batch_size_per_gpu", _R + "log_prob_max_token_len_per_gpu",
        _F + "log_prob_micro_batch_size_per_gpu", _F + "log_prob_max_token_len_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu", "critic.forward_micro_batch_size_per_gpu",
        "critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu", "critic.cliprange_value",
        "algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.target_kl", "trainer.total_epochs",
        "trainer.total_training_steps", "trainer.nnodes", "trainer.n_gpus_per_node",
        "trainer.collective_timeout_s", "trainer.hybrid_engine.reshard_bucket_mb",
        "trainer.device_memory_gb", "trainer.host_memory_gb")),
    ("must be >= 0", lambda v: v >= 0, (
        "trainer.hybrid_engine.reshard_direct_min_mb", _A + "entropy_coeff", _A + "kl_loss_coef", _A + "grad_clip", _A + "optim.lr",
        _A + "optim.weight_decay", "critic.grad_clip", "critic.optim.lr", "critic.optim.weight_decay",
        _R + "temperature", _R + "val_kwargs.temperature", "algorithm.kl_ctrl.kl_coef",
        "algorithm.filter_groups.max_num_gen_batches", "reward_model.overlong_buffer.penalty_factor")),
    ("must be in [0, 1]", lambda v: 0 <= v <= 1, (
        "algorithm.gamma", "algorithm.lam", _A + "optim.lr_warmup_steps_ratio", _A + "optim.min_lr_ratio",
        "critic.optim.lr_warmup_steps_ratio", "critic.optim.min_lr_ratio")),
    ("must be in (0, 1]", lambda v: 0 < v <= 1, (
        _R + "top_p", _R + "val_kwargs.top_p", _R + "gpu_memory_utilization")),
    ("must be >= -1 (-1 or 0: off)", lambda v: v >= -1, (_R + "top_k", _R + "val_kwargs.top_k")),
    ("must be > 1 (dual-clip bound)", lambda v: v > 1, (_A + "clip_ratio_c",)),
    ("must be two numbers in [0, 1)", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
     (_A + "optim.betas", "critic.optim.betas")),
)


def _check_ranges(cfg: DictConfig) -> Iterator[str]:
    for message, ok, keys in RANGES:
        for key in keys:
            value = OmegaConf.select(cfg, key)
            if value is not None and not ok(value):
                yield f"{key}={value} {message}"


def _check_algorithm(cfg: DictConfig) -> Iterator[str]:
    algo, data, rollout = cfg.algorithm, cfg.data, cfg.actor_rollout_ref.rollout
    n = rollout.n
    if cfg.actor_rollout_ref.model.path is None:
        yield "actor_rollout_ref.model.path must be set (a Hugging Face model directory)"
    if uses_critic(cfg) and cfg.critic.model.path is None:
        yield "critic.model.path must be set when algorithm.adv_estimator=gae"
    if algo.adv_estimator in GROUP_ESTIMATORS and n < 2:
        yield (f"algorithm.adv_estimator={algo.adv_estimator} compares the responses of a "
               f"prompt: set {_R}n >= 2 (got {n})")
    if algo.adv_estimator in GROUP_ESTIMATORS and n > 1 and \
            (not rollout.do_sample or rollout.temperature == 0):
        greedy = f"{_R}do_sample=false" if not rollout.do_sample else f"{_R}temperature=0"
        yield (f"algorithm.adv_estimator={algo.adv_estimator} with greedy sampling ({greedy}) and "
               f"{_R}n={n}: the {n} responses of a prompt are identical, so every advantage is 0; "
               f"sample ({_R}do_sample=true, temperature > 0)")
    if algo.filter_groups.enable and n < 2:
        yield f"algorithm.filter_groups.enable=true filters groups of responses: set {_R}n >= 2"
    if not algo.filter_groups.enable and data.gen_batch_size != data.train_batch_size:
        yield (f"data.gen_batch_size={data.gen_batch_size} != data.train_batch_size="
               f"{data.train_batch_size}: it is only used with algorithm.filter_groups.enable=true")
    overlong = cfg.reward_model.overlong_buffer
    if overlong.enable and cfg.reward_model.reward_manager != "dapo":
        yield "reward_model.overlong_buffer.enable=true needs reward_model.reward_manager=dapo"
    if overlong.enable and not 0 < overlong.len <= data.max_response_length:
        yield (f"reward_model.overlong_buffer.len={overlong.len} must be in "
               f"(0, data.max_response_length={data.max_response_length}]")
    if cfg.reward_model.enable:
        yield ("reward_model.enable=true: model-based rewards are not supported; "
               "use the rule rewards or custom_reward_function.path")
    if cfg.trainer.resume_mode == "resume_path" and cfg.trainer.resume_from_path is None:
        yield "trainer.resume_mode=resume_path needs trainer.resume_from_path"
    yield from _check_lora(cfg.actor_rollout_ref.model, _M)
    if uses_critic(cfg):
        yield from _check_lora(cfg.critic.model, "critic.model.")


def _check_lora(m, prefix: str) -> Iterator[str]:
    """A role's LoRA keys (its model section, named by `prefix`)."""
    if m.lora_rank < 0:
        yield f"{prefix}lora_rank={m.lora_rank} must be >= 0 (0: full-parameter training)"
    if m.lora_rank > 0:
        from hybridengine.models.lora import resolve_targets   # the model family's names
        try:
            resolve_targets(list(m.target_modules))
        except ValueError as e:
            yield f"{prefix}{e}"


def _check_train_batches(cfg: DictConfig, section: str, role: Layout) -> Iterator[str]:
    """verl's rule: ppo_mini_batch_size counts prompts, so a mini-batch is mini * n sequences,
    split evenly over the role's DP ranks, then into ppo_micro_batch_size_per_gpu micro-batches.
    (Runs on positive sizes: _check_ranges first.)"""
    node, prompts = OmegaConf.select(cfg, section), cfg.data.train_batch_size
    n = cfg.actor_rollout_ref.rollout.n
    mini = node.ppo_mini_batch_size
    if prompts % mini:
        yield (f"data.train_batch_size={prompts} must be a multiple of "
               f"{section}.ppo_mini_batch_size={mini}")
    sequences = mini * n
    if sequences % role.dp:
        yield (f"{section}.ppo_mini_batch_size * rollout.n = {mini}*{n} sequences do not split "
               f"over data-parallel size {role.dp} (= world / (tp {role.tp} * pp {role.pp}"
               f"{f' * cp {role.cp}' if role.cp > 1 else ''}))")
    micro = node.ppo_micro_batch_size_per_gpu
    if node.use_dynamic_bsz:
        return
    if micro is None:
        yield (f"{section}.ppo_micro_batch_size_per_gpu must be set when "
               f"{section}.use_dynamic_bsz=false")
    elif not sequences % role.dp and (sequences // role.dp) % micro:
        yield (f"{section}.ppo_micro_batch_size_per_gpu={micro} must divide the per-rank "
               f"mini-batch of {mini}*{n}/{role.dp} = {sequences // role.dp} sequences")


def _check_forward_batches(cfg: DictConfig, layout: RunLayout) -> Iterator[str]:
    rollout, ref, critic = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref, cfg.critic
    needed = [(_R + "log_prob", rollout.log_prob_use_dynamic_bsz, rollout.log_prob_micro_batch_size_per_gpu)]
    if layout.ref is not None:
        needed.append((_F + "log_prob", ref.log_prob_use_dynamic_bsz, ref.log_prob_micro_batch_size_per_gpu))
    if layout.critic is not None and critic.ppo_micro_batch_size_per_gpu is not None:
        # (its default follows critic.ppo_micro_batch_size_per_gpu, whose absence is said already)
        needed.append(("critic.forward", critic.use_dynamic_bsz, critic.forward_micro_batch_size_per_gpu))
    for stem, dynamic, micro in needed:
        if not dynamic and micro is None:
            dynamic_key = "critic.use_dynamic_bsz" if stem.startswith("critic") else f"{stem}_use_dynamic_bsz"
            yield f"{stem}_micro_batch_size_per_gpu must be set when {dynamic_key}=false"


# actor.policy_loss.loss_mode: the names of rl.losses' registry (tests/test_losses_verl.py keeps
# them equal; config does not import torch). The bypass loss types and the rollout IS levels are
# read from here by rl.bypass and rl.rollout_correction.
POLICY_LOSS_MODES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
ROLLOUT_IS_LEVELS = ("token", "sequence")
_RC = "algorithm.rollout_correction."


def _check_policy_loss(cfg: DictConfig) -> Iterator[str]:
    """actor.policy_loss, actor.loss_scale_factor and algorithm.rollout_correction (verl's keys;
    rejection sampling is accepted only at its neutral value)."""
    actor, rc = cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
    pl = actor.policy_loss
    if pl.loss_mode not in POLICY_LOSS_MODES:
        yield (f"{_A}policy_loss.loss_mode={pl.loss_mode!r}: choose one of "
               f"{', '.join(POLICY_LOSS_MODES)}")
    if rc.rollout_is is not None and rc.rollout_is not in ROLLOUT_IS_LEVELS:
        yield (f"{_RC}rollout_is={rc.rollout_is!r}: choose one of "
               f"{', '.join(ROLLOUT_IS_LEVELS)} or null")
    for key, value in ((_A + "loss_scale_factor", actor.loss_scale_factor),
                       (_A + "policy_loss.clip_cov_ratio", pl.clip_cov_ratio),
                       (_A + "policy_loss.kl_cov_ratio", pl.kl_cov_ratio),
                       (_RC + "rollout_is_threshold", rc.rollout_is_threshold)):
        if value is not None and not value > 0:
            yield f"{key}={value} must be > 0"
    if pl.ppo_kl_coef < 0:
        yield f"{_A}policy_loss.ppo_kl_coef={pl.ppo_kl_coef} must be >= 0"
    if not pl.clip_cov_lb < pl.clip_cov_ub:
        yield (f"{_A}policy_loss.clip_cov_lb={pl.clip_cov_lb} must be < "
               f"clip_cov_ub={pl.clip_cov_ub}")
    if rc.rollout_rs is not None:
        yield (f"{_RC}rollout_rs={rc.rollout_rs!r}: rejection sampling is not supported "
               f"(null only)")
    if rc.loss_type not in BYPASS_LOSS_TYPES:
        yield f"{_RC}loss_type={rc.loss_type!r}: choose one of {', '.join(BYPASS_LOSS_TYPES)}"
    elif rc.loss_type != "ppo_clip" and not rc.bypass_mode:
        yield f"{_RC}loss_type={rc.loss_type!r} needs bypass_mode=true (verl's bypass-mode loss)"
    if rc.bypass_mode and rc.rollout_is_batch_normalize:
        yield (f"{_RC}rollout_is_batch_normalize=true is not supported with bypass_mode=true "
               f"(verl normalises each micro-batch's weights over every rank)")
    if rc.bypass_mode and pl.loss_mode != "vanilla":
        yield (f"{_A}policy_loss.loss_mode={pl.loss_mode!r}: bypass mode has its own policy loss "
               f"({_RC}loss_type); set loss_mode=vanilla")


def validate_config(cfg: DictConfig, world_size: int) -> RunLayout:
    """Ranges and cross-field checks; returns the layout. Raises one ConfigError (a ValueError)
    listing every failure, a line each naming the fields."""
    range_errors = list(_check_ranges(cfg))
    errors = [*range_errors, *_check_algorithm(cfg), *_check_policy_loss(cfg)]
    trainer = cfg.trainer
    if trainer.n_gpus_per_node is not None and trainer.nnodes * trainer.n_gpus_per_node != world_size:
        errors.append(f"trainer.nnodes * trainer.n_gpus_per_node = {trainer.nnodes}*"
                      f"{trainer.n_gpus_per_node} but the launcher started {world_size} processes")
    try:
        layout = derive_layout(cfg, world_size)
    except ValueError as e:
        errors.append(str(e))
        layout = None
    if layout is not None and not range_errors:     # the batch rules divide by the sizes
        errors += _check_train_batches(cfg, "actor_rollout_ref.actor", layout.actor)
        if layout.critic is not None:
            errors += _check_train_batches(cfg, "critic", layout.critic)
        errors += _check_forward_batches(cfg, layout)
    if errors:
        raise ConfigError(errors)
    return layout
