"""The config keys that take one of a list, and their lists: each list belongs to the subsystem
that acts on the value and is imported from it here, when a config is checked (so that importing
the config layer stays free of torch): one copy of every list.
"""
from __future__ import annotations

import functools

_A, _F, _R = "actor_rollout_ref.actor.", "actor_rollout_ref.ref.", "actor_rollout_ref.rollout."


@functools.cache
def choices() -> dict[str, tuple[str, ...]]:
    """{key: its allowed values} for the keys that take one of a list (module doc)."""
    from hybridengine.device_memory import CUDA_ALLOCATORS
    from hybridengine.hybrid.generator import BACKENDS as ROLLOUT_BACKENDS
    from hybridengine.hybrid.plan import MODES as RESHARD_MODES
    from hybridengine.parallel.layout import CP_COMM_TYPES
    from hybridengine.rl.advantages import FILTER_METRICS, adv_estimator_names
    from hybridengine.rl.checkpointing import RESUME_MODES
    from hybridengine.rl.data import TRUNCATION_MODES
    from hybridengine.rl.guards import NAN_POLICIES
    from hybridengine.rl.kl import KL_CONTROLLERS, KL_KINDS
    from hybridengine.rl.losses import LOSS_AGG_MODES
    from hybridengine.rl.memory import PARAM_DTYPES
    from hybridengine.rl.preflight import DEVICES
    from hybridengine.rl.rewards import REWARD_MANAGERS
    from hybridengine.rollout.rollout_config import BACKENDS as ATTN_BACKENDS, \
        PREFILL_ATTENTION, RUN_KV_LAYOUTS
    from hybridengine.train.lr_schedule import WARMUP_STYLES
    return {
        "data.truncation": TRUNCATION_MODES,
        _A + "loss_agg_mode": LOSS_AGG_MODES,
        _A + "kl_loss_type": KL_KINDS,
        "algorithm.kl_penalty": KL_KINDS,
        **dict.fromkeys((_A + "optim.lr_scheduler_type", "critic.optim.lr_scheduler_type"),
                        WARMUP_STYLES),
        **dict.fromkeys((_A + "megatron.param_dtype", _F + "megatron.param_dtype",
                         "critic.megatron.param_dtype", _R + "dtype"), PARAM_DTYPES),
        **dict.fromkeys((_A + "megatron.cp_comm_type", _F + "megatron.cp_comm_type",
                         "critic.megatron.cp_comm_type"), tuple(CP_COMM_TYPES)),
        _R + "name": ROLLOUT_BACKENDS,
        _R + "attn_backend": ATTN_BACKENDS,
        _R + "prefill_attention": PREFILL_ATTENTION,
        _R + "kv_layout": RUN_KV_LAYOUTS,
        "reward_model.reward_manager": REWARD_MANAGERS,
        "algorithm.adv_estimator": adv_estimator_names(),
        "algorithm.kl_ctrl.type": KL_CONTROLLERS,
        "algorithm.filter_groups.metric": FILTER_METRICS,
        "trainer.resume_mode": RESUME_MODES,
        "trainer.device": DEVICES,
        "trainer.nan_policy": NAN_POLICIES,
        "trainer.cuda_allocator": CUDA_ALLOCATORS,
        "trainer.hybrid_engine.reshard_mode": RESHARD_MODES,
    }
