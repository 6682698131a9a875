"""The typed run configuration: verl's key tree as frozen dataclasses, built once per run.

The verl tree (configs/ppo_trainer.yaml, `--config` files, `key=value` overrides) stays the
user's interface; config.loading turns it into a checked DictConfig and config.checks runs the
cross-field rules. `RunConfig.build(tree, layout)` then makes this typed copy, which is what the
trainer and everything under it read: attribute access with a known type, no `.get(key,
default)` (the defaults live in configs/ppo_trainer.yaml alone: no field here has a default),
and the run's layout (parallel.layout.RunLayout) beside the sections.

The dataclasses mirror the tree key for key, so `RunConfig.build` refuses a tree with a key the
schema lacks or the other way round (tests/test_config.py keeps them equal).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from hybridengine.parallel.layout import RunLayout

_frozen = dataclass(frozen=True)


@_frozen
class DataConfig:
    train_files: tuple[str, ...]
    val_files: tuple[str, ...] | None
    prompt_key: str
    reward_fn_key: str
    max_prompt_length: int
    max_response_length: int
    train_batch_size: int
    gen_batch_size: int
    val_batch_size: int | None
    truncation: str
    filter_overlong_prompts: bool
    shuffle: bool
    seed: int
    return_raw_chat: bool


@_frozen
class ModelSection:
    path: str | None
    trust_remote_code: bool
    enable_gradient_checkpointing: bool
    lora_rank: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    lora_adapter_path: str | None
    lora_save_merged: bool


@_frozen
class PolicyLossSection:
    loss_mode: str
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    ppo_kl_coef: float


@_frozen
class OptimSection:
    lr: float
    lr_warmup_steps: int
    lr_warmup_steps_ratio: float
    lr_scheduler_type: str
    min_lr_ratio: float | None
    weight_decay: float
    betas: tuple[float, ...]
    total_training_steps: int


@_frozen
class RefMegatronSection:
    """A role's parallel sizes, precision and weight offload (the reference: no optimizer)."""
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    cp_comm_type: str
    expert_model_parallel_size: int
    sequence_parallel: bool
    param_dtype: str
    param_offload: bool | str             # false | true | "auto" (rl.memory resolves it)


@_frozen
class MegatronSection(RefMegatronSection):
    """A trained role's: the reference's, and its optimizer's sharding and offload."""
    use_distributed_optimizer: bool
    gradient_accumulation_fusion: bool
    grad_offload: bool | str              # false | true | "auto"
    optimizer_offload: bool | str         # false | true | "host_step" | "auto"


@_frozen
class ActorConfig:
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_gpu: int | None
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int
    ppo_epochs: int
    shuffle: bool
    use_torch_compile: bool
    use_cuda_graph: bool
    clip_ratio: float
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    loss_scale_factor: float | None
    policy_loss: PolicyLossSection
    entropy_coeff: float
    router_aux_loss_coef: float
    router_z_loss_coef: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    grad_clip: float
    optim: OptimSection
    ulysses_sequence_parallel_size: int
    megatron: MegatronSection


@_frozen
class ValKwargs:
    temperature: float
    top_p: float
    top_k: int
    do_sample: bool
    n: int


@_frozen
class RolloutSection:
    name: str
    n: int
    temperature: float
    top_p: float
    top_k: int
    do_sample: bool
    ignore_eos: bool
    compile: bool
    compile_prefill: bool
    attn_backend: str
    prefill_attention: str
    kv_layout: str
    block_size: int
    prompt_length: int
    response_length: int
    dtype: str
    tensor_model_parallel_size: int
    gpu_memory_utilization: float
    max_num_seqs: int
    enforce_eager: bool
    free_cache_engine: bool
    log_prob_micro_batch_size_per_gpu: int | None
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    val_kwargs: ValKwargs


@_frozen
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    ulysses_sequence_parallel_size: int
    megatron: RefMegatronSection


@_frozen
class ActorRolloutRefConfig:
    model: ModelSection
    actor: ActorConfig
    rollout: RolloutSection
    ref: RefConfig


@_frozen
class CriticConfig:
    model: ModelSection
    optim: OptimSection
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_gpu: int | None
    forward_micro_batch_size_per_gpu: int | None
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int
    forward_max_token_len_per_gpu: int
    ppo_epochs: int
    shuffle: bool
    grad_clip: float
    cliprange_value: float
    use_torch_compile: bool
    use_cuda_graph: bool
    ulysses_sequence_parallel_size: int
    megatron: MegatronSection


@_frozen
class OverlongBuffer:
    enable: bool
    len: int
    penalty_factor: float


@_frozen
class RewardModelConfig:
    enable: bool
    reward_manager: str
    overlong_buffer: OverlongBuffer


@_frozen
class CustomRewardFunction:
    path: str | None
    name: str
    weights: dict[str, float] | None


@_frozen
class KLControl:
    type: str
    kl_coef: float
    horizon: int
    target_kl: float


@_frozen
class FilterGroups:
    enable: bool
    metric: str
    max_num_gen_batches: int


@_frozen
class RolloutCorrection:
    rollout_is: str | None
    rollout_is_threshold: float
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: str | None
    bypass_mode: bool
    loss_type: str


@_frozen
class AlgorithmConfig:
    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: KLControl
    filter_groups: FilterGroups
    rollout_correction: RolloutCorrection


@_frozen
class HybridEngineSection:
    reshard_mode: str
    reshard_bucket_mb: float
    reshard_direct_min_mb: float | None


@_frozen
class TrainerConfig:
    total_epochs: int
    total_training_steps: int | None
    project_name: str
    experiment_name: str
    logger: tuple[str, ...]
    save_freq: int
    test_freq: int
    val_before_train: bool
    default_local_dir: str
    resume_mode: str
    resume_from_path: str | None
    overwrite: bool
    nnodes: int
    n_gpus_per_node: int | None
    seed: int
    device: str
    collective_timeout_s: float
    device_memory_gb: float | None
    host_memory_gb: float | None
    nan_policy: str
    critic_warmup: int
    interleave_updates: bool
    gc_freeze_freq: int
    cuda_allocator: str
    hybrid_engine: HybridEngineSection


@_frozen
class RunConfig:
    """Everything a run reads: the sections of verl's tree, typed, and the run's layout."""
    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    critic: CriticConfig
    reward_model: RewardModelConfig
    custom_reward_function: CustomRewardFunction
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    layout: RunLayout

    @classmethod
    def build(cls, tree: DictConfig, layout: RunLayout) -> RunConfig:
        """The typed copy of a loaded, checked tree (config.load_config, config.validate_config)."""
        plain = OmegaConf.to_container(tree, resolve=True)
        plain["layout"] = layout
        return _build(cls, plain, "")


def _build(cls, node, where: str):
    """A `cls` instance from the plain dict `node`, recursively, converting lists to tuples and
    a single path to a 1-tuple where the field holds several; one error per mismatch of keys."""
    if not isinstance(node, dict):
        raise TypeError(f"config {where or 'tree'}: expected a section, got {node!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(set(node) - set(fields))
    missing = sorted(n for n, f in fields.items() if n not in node
                     and f.default is dataclasses.MISSING)
    if extra or missing:
        raise TypeError(f"config {where or 'tree'}: the schema (config.run.{cls.__name__}) "
                        f"and the tree differ: keys only in the tree {extra}, only in the "
                        f"schema {missing}")
    return cls(**{name: _value(hints[name], node[name], f"{where}{name}")
                  for name in fields if name in node})


def _value(hint, value, where: str):
    if value is None:
        return None
    if dataclasses.is_dataclass(hint) and not isinstance(value, hint):
        return _build(hint, value, where + ".")
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if typing.get_origin(option) is tuple:
            return tuple(value) if isinstance(value, (list, tuple)) else (value,)
        if typing.get_origin(option) is dict:
            return dict(value)
        if dataclasses.is_dataclass(option):
            return value if isinstance(value, option) else _build(option, value, where + ".")
        if option is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
    return value
