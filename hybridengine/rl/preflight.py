"""What a run checks before it writes or loads anything, so that a first day's mistakes come
out together, one line each (launch/ppo.py prints them, exit 2):

- the config's own rules (config.validate_config, a ConfigError listing them all);
- trainer.logger (a backend that is not there, wandb not installed) and trainer.device=cuda
  without CUDA;
- each model path: what it is when it is not an HF directory with a readable config.json (no
  such directory, a hub id, a file, broken JSON) before the tokenizer looks in it, and prompt +
  response within its context (verl's rollout refuses a longer max_model_len too; positions past
  max_position_embeddings were never trained);
- rollout.kv_layout=paged where the rollout cannot take it (rl.memory.paged_unsupported);
- the memory plan (rl.memory): the `auto` offload flags and rollout.kv_layout=auto are resolved
  from it (in the tree), then a run that cannot fit its device budget says so in one line, with
  the settings that would fit;
- a LoRA run's lora_adapter_path is a PEFT adapter directory.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hybridengine.config import ConfigError, uses_critic, validate_config
from hybridengine.config.run import RunConfig
from hybridengine.models.hf import read_model_config
from hybridengine.parallel.layout import RunLayout
from hybridengine.rl.memory import paged_unsupported, resolve_and_check
from hybridengine.rl.tracking import check_backends


def preflight(cfg, world_size: int) -> tuple[RunLayout | None, list[str]]:
    """(the layout, or None when the config's rules fail; every error, a line each): the
    checks of the module docstring, in that order."""
    layout, errors = None, []
    try:
        layout = validate_config(cfg, world_size)
    except ConfigError as e:
        errors += e.errors
    try:
        check_backends(cfg.trainer.logger)
    except ValueError as e:
        errors.append(str(e))
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        why = f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None \
            else "no GPU is visible"
        errors.append(f"trainer.device=cuda but CUDA is not available ({why}); use "
                      f"trainer.device=auto or cpu")
    d = cfg.data
    paths = [("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)]
    if uses_critic(cfg) and cfg.critic.model.path != paths[0][1]:
        paths.append(("critic.model.path", cfg.critic.model.path))
    models = {}
    for key, path in paths:
        if path is None:
            continue                             # validate_config said so
        try:
            models[key] = read_model_config(path)
        except (ValueError, FileNotFoundError) as e:
            errors.append(f"{key}: {e}")
            continue
        context = models[key].max_position_embeddings
        if d.max_prompt_length + d.max_response_length > context:
            errors.append(f"data.max_prompt_length + data.max_response_length = "
                          f"{d.max_prompt_length}+{d.max_response_length} exceeds the context "
                          f"of {key}={path} (max_position_embeddings={context})")
    adapter = cfg.actor_rollout_ref.model.lora_adapter_path
    if cfg.actor_rollout_ref.model.lora_rank > 0 and adapter is not None and not (
            Path(adapter) / "adapter_config.json").is_file():
        errors.append(f"actor_rollout_ref.model.lora_adapter_path={adapter}: not a PEFT adapter "
                      f"directory (no adapter_config.json)")
    if layout is not None:
        errors += _context_parallel_errors(layout, models)
    actor = models.get("actor_rollout_ref.model.path")
    if actor is not None and cfg.actor_rollout_ref.rollout.kv_layout == "paged":
        why = paged_unsupported(cfg, actor)
        if why:
            errors.append(f"actor_rollout_ref.rollout.kv_layout=paged: {why}; use static or auto")
    if not errors:                  # the memory plan needs a sound config and the model shapes
        actor = models["actor_rollout_ref.model.path"]
        critic, device = models.get("critic.model.path", actor), run_device(cfg)
        errors += resolve_and_check(cfg, layout, actor, critic, device)[1]
    return layout, errors


def _context_parallel_errors(layout: RunLayout, models: dict) -> list[str]:
    """Context parallelism against each role's model heads, expert parallelism against its
    experts (models.decoder.check_cp, check_ep)."""
    errors = []
    actor = models.get("actor_rollout_ref.model.path")
    for role, lay in layout.roles().items():
        model = models.get("critic.model.path", actor) if role == "critic" else actor
        section = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref",
                   "critic": "critic"}[role]
        for check in (lambda: model.check_cp(lay.tp, lay.cp, lay.cp_attention),
                      lambda: model.check_ep(lay.ep)):
            try:
                if model is not None:
                    check()
            except ValueError as e:
                errors.append(f"{section}.{e}")
    return list(dict.fromkeys(errors))


# trainer.device: run_device's
DEVICES = ("auto", "cuda", "cpu")


def run_device(cfg) -> torch.device:
    """trainer.device: auto is this rank's GPU where there is one, else the CPU."""
    want = cfg.trainer.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want, torch.cuda.current_device()) if want == "cuda" \
        else torch.device(want)


def checked_layout(cfg, world_size: int) -> RunLayout:
    """The run's layout once every preflight check passed; else one ConfigError with them all."""
    layout, errors = preflight(cfg, world_size)
    if errors:
        raise ConfigError(errors)
    return layout


def checked_run_config(tree, world_size: int) -> RunConfig:
    """The typed run config (config.run) of a loaded tree once every preflight check
    passed; else one ConfigError with them all."""
    return RunConfig.build(tree, checked_layout(tree, world_size))
