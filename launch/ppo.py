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
    _warn_if_restarts_cannot_reconnect()
    from hybridengine.rl.guards import PeerFailure
    from hybridengine.rl.trainer import Trainer
    import torch.distributed as dist
    try:
        Trainer(cfg, env.world_size, env.rank).fit()
    except PeerFailure as e:
        # The group is broken: tearing it down could wait on the silent peer, and torch aborts
        # from its destructors. Say where, and leave now (torchrun stops the other ranks).
        if os.environ.get("HYBRIDENGINE_TRACEBACK"):
            import traceback
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _warn_if_restarts_cannot_reconnect() -> None:
    """torchrun --max-restarts while sharing its rendezvous store with the workers (static
    rendezvous, or c10d without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): a restarted group reads the
    dead group's addresses from the store and cannot connect (pytorch#135712)."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and os.environ.get("RANK") == "0" \
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print("warning: torchrun restarts need --rdzv-backend=c10d and "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see launch/slurm/ppo.sbatch); without them a "
              "restarted group cannot reconnect", file=sys.stderr, flush=True)


def _exit_with(error: Exception, code: int) -> None:
    # One clear line, no traceback (set HYBRIDENGINE_TRACEBACK=1 to see it).
    if os.environ.get("HYBRIDENGINE_TRACEBACK"):
        raise error
    print(f"error: {error}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    from hybridengine.rl.guards import RunError
    from hybridengine.rl.rewards import RewardError
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError, KeyError, RewardError) as e:
        _exit_with(e, 2)             # bad input: config, data, model files, reward function
    except RunError as e:
        _exit_with(e, 1)             # the run failed: non-finite update, checkpoint write
