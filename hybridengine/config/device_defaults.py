"""Device defaults: on CUDA the fast paths are the defaults wherever they are exact.

configs/cuda_defaults.yaml (CUDA graphs, compiled decode step and prefill, compiled training
layers, token-budget micro-batches) is a layer between the defaults (configs/ppo_trainer.yaml)
and the run's own layers (--config files, then key=value overrides), merged when trainer.device
resolves to CUDA: `cuda`, or `auto` with a GPU. So every key the run sets keeps the run's value
(`actor_rollout_ref.actor.use_dynamic_bsz=false` keeps a verl command line's fixed micro-batch
sizes, which token budgets otherwise replace), and on the CPU nothing changes.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

CUDA_DEFAULTS_FILE = Path(__file__).resolve().parents[2] / "configs" / "cuda_defaults.yaml"


def resolves_to_cuda(device) -> bool:
    """Whether trainer.device means CUDA here (as the trainer resolves it)."""
    if device == "cuda":
        return True
    if device != "auto":
        return False
    import torch                    # only for `auto`: the config itself does not need torch
    return torch.cuda.is_available()


def device_layers(device) -> list[dict]:
    """The layers to merge between the defaults and the run's own: [the CUDA defaults] when
    `device` (trainer.device as the run leaves it) resolves to CUDA, else []."""
    if not resolves_to_cuda(device):
        return []
    return [OmegaConf.to_container(OmegaConf.load(CUDA_DEFAULTS_FILE))]
