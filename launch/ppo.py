"""PPO / GRPO / DAPO training entry point.

    torchrun --nproc_per_node=N launch/ppo.py [--config FILE ...] [key=value ...]
    srun --ntasks-per-node=N python launch/ppo.py ...        (reads SLURM_* variables)

With no --config and no model path it runs the embedded default job (configs/tiny.yaml, other
overrides still apply): the real pretrained stories260K model learning, with GRPO on CPU, to
tell stories that use given words. Relative paths that do not exist from the working directory
are looked up from the repository root, so the default job runs from anywhere. Rank 0 first says
which config layers are in force.

Failures end the run with `error: <message>` once for the whole job (not once per rank) and an
exit code: 2 bad input (config, data, model files, reward function), 1 a failure of the run, 130
interrupted (Ctrl-C: the latest checkpoint is named). torchrun itself exits 1 when a worker
fails; its summary shows the worker's message and code. HYBRIDENGINE_TRACEBACK=1 adds the
traceback.
"""
import os
import signal
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
    import torch.distributed as dist
    from hybridengine.config import describe_layers, load_config
    from hybridengine.parallel.mesh import init_distributed, read_dist_env
    rank, cfg = read_dist_env().rank, None
    default_job = not any(a.startswith("--config") or "model.path=" in a for a in argv)
    if default_job:
        argv = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), *argv]
    try:
        cfg = load_config(argv)
        if rank == 0:
            print(f"config: {describe_layers(argv)}{_layers_note(argv, default_job)}", flush=True)
        _resolve_paths(cfg)
        env = init_distributed(timeout_s=cfg.trainer.collective_timeout_s)
        _warn_if_restarts_cannot_reconnect()
        from hybridengine.parallel.mesh import build_meshes
        from hybridengine.rl.preflight import checked_run_config
        from hybridengine.rl.trainer import Trainer
        # every config / data / model error at once, before a group is built or a file written
        run = checked_run_config(cfg, env.world_size)       # typed: config.run.RunConfig
        meshes = build_meshes(run.layout, run.trainer.collective_timeout_s)   # every group
        Trainer(run, meshes).fit()
    except BaseException as e:  # noqa: BLE001 - _fail words ours and exits; the rest re-raise
        _fail(e, rank, cfg)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _layers_note(argv: list[str], default_job: bool) -> str:
    if default_job:
        return " (the embedded default job)"
    if not any(a.startswith("--config") for a in argv):      # a model path alone
        return (" (not the default job: configs/tiny.yaml applies only without --config and "
                "model path)")
    return ""


def _fail(error: BaseException, rank: int, cfg) -> None:
    """One line for the whole job and the exit code (module docstring); returns for errors
    that are not ours to word (Python's traceback then shows them)."""
    import traceback
    from hybridengine.rl.guards import (PeerFailure, RunError, defer_exit_under_torchrun,
                                        report_failure, traceback_wanted)
    from hybridengine.rl.rewards import RewardError
    if isinstance(error, KeyboardInterrupt):
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # a second Ctrl-C while we say so
        if rank == 0:
            print(_interrupted(cfg), file=sys.stderr, flush=True)
        sys.exit(130)
    if isinstance(error, RunError):
        code = 1                     # the run failed: non-finite update, checkpoint write, peer
    elif isinstance(error, (ValueError, FileNotFoundError, KeyError, RewardError)):
        code = 2                     # bad input: config, data, model files, reward function
    else:
        return
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    report_failure(message, code, rank, traceback.format_exc() if traceback_wanted() else None,
                   own=isinstance(error, PeerFailure))
    if isinstance(error, PeerFailure):
        # The group is broken: tearing it down could wait on the silent peer, and torch aborts
        # from its destructors. Leave now (torchrun stops the other ranks); after a peer that
        # exited, only once torchrun has seen that exit, so its summary names the dead rank
        # (e.g. `exitcode: -9`), not this one.
        if error.kind == "lost":
            defer_exit_under_torchrun()
        os._exit(1)
    sys.exit(code)


def _interrupted(cfg) -> str:
    if cfg is None:
        return "interrupted"
    from hybridengine.train import checkpoint as ckpt
    root = cfg.trainer.default_local_dir
    try:
        step = ckpt.find_latest(root)
    except (OSError, ValueError):
        step = None
    if step is None:
        return "interrupted; no checkpoint yet"
    return f"interrupted; latest checkpoint global_step_{step} in {root} " \
           f"(trainer.resume_mode=auto resumes from it)"


def _warn_if_restarts_cannot_reconnect() -> None:
    """torchrun --max-restarts while sharing its rendezvous store with the workers (static
    rendezvous, or c10d without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): a restarted group reads the
    dead group's addresses from the store and cannot connect (pytorch#135712)."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and os.environ.get("RANK") == "0" \
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print("warning: torchrun restarts need --rdzv-backend=c10d and "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see launch/slurm/ppo.sbatch); without them a "
              "restarted group cannot reconnect", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
