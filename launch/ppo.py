"""PPO / GRPO / DAPO training entry point.

    torchrun --nproc_per_node=N launch/ppo.py [--config FILE ...] [key=value ...]
    srun --ntasks-per-node=N python launch/ppo.py ...        (reads SLURM_* variables)

With no --config and no model path it runs the embedded default job (configs/tiny.yaml, other
overrides still apply): the real pretrained stories260K model learning, with GRPO on CPU, to
tell stories that use given words. Relative paths that do not exist from the working directory
are looked up from the repository root, so the default job runs from anywhere.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


PATH_KEYS = ("actor_rollout_ref.model.path", "critic.model.path", "data.train_files",
             "data.val_files", "custom_reward_function.path")


def _resolve_paths(cfg) -> None:
    from omegaconf import OmegaConf
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key)
        values = [value] if isinstance(value, str) else value
        if not values:
            continue
        fixed = [v if os.path.isabs(v) or os.path.exists(v) or not os.path.exists(
            os.path.join(ROOT, v)) else os.path.join(ROOT, v) for v in values]
        OmegaConf.update(cfg, key, fixed[0] if isinstance(value, str) else fixed)


def main(argv: list[str]) -> None:
    from hybridengine.config import load_config
    from hybridengine.parallel.mesh import init_distributed
    if not any(a.startswith("--config") or "model.path=" in a for a in argv):
        argv = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), *argv]
    cfg = load_config(argv)
    _resolve_paths(cfg)
    env = init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
    from hybridengine.rl.trainer import Trainer
    import torch.distributed as dist
    try:
        Trainer(cfg, env.world_size, env.rank).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError, KeyError) as e:
        # Bad input: one clear line, no traceback (set HYBRIDENGINE_TRACEBACK=1 to see it).
        if os.environ.get("HYBRIDENGINE_TRACEBACK"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
