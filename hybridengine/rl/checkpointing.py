"""A run's checkpoints: what the trainer saves every trainer.save_freq steps and resumes from.

global_step_N/ holds the actor's (and critic's) HF model directory, loadable by
AutoModelForCausalLM.from_pretrained, and each rank's exact-resume state (train.checkpoint):
optimizer shards, the data sampler's position, the KL controller and the RNG streams. Saving is
collective over the run's world group; a write error keeps the previous checkpoint the latest.
"""
from __future__ import annotations

from pathlib import Path

from hybridengine.train import checkpoint as ckpt
from hybridengine.rl.guards import SaveError

# trainer.resume_mode (verl's): Checkpointing.resume
RESUME_MODES = ("auto", "disable", "resume_path")


class RunCheckpoints:
    """Save and resume the state of `roles` ({"actor": Actor, "critic": Critic or None}), the
    `sampler` and the `kl_ctrl` under `root`; `residency` brings offloaded parts back first."""

    def __init__(self, root: Path, group, rank: int, roles: dict, sampler, kl_ctrl, residency):
        self.root, self.group, self.rank = Path(root), group, rank
        self.roles = {name: role for name, role in roles.items() if role is not None}
        self.sampler, self.kl_ctrl, self.residency = sampler, kl_ctrl, residency

    def save(self, step: int) -> Path:
        """Checkpoint `step`; on a write error (disk full) the previous checkpoint stays the
        latest, intact, and SaveError says so in one line."""
        self.residency.enter("save")
        try:
            return self._save(step)
        except OSError as e:
            last = ckpt.find_latest(self.root)
            kept = f"global_step_{last} is the latest, intact" if last else "no earlier one"
            raise SaveError(f"saving checkpoint global_step_{step} under {self.root} failed: "
                            f"{e.strerror or e}; {kept}") from e

    def _save(self, step: int) -> Path:
        tmp = ckpt.begin_checkpoint(self.root, step, self.group)
        for name, role in self.roles.items():
            role.engine.save_hf(tmp / name)
        tensors, meta = {}, {"step": step, "sampler": self.sampler.state_dict(),
                             "kl_ctrl": self.kl_ctrl.state_dict()}
        for name, role in self.roles.items():
            t, m = role.engine.optimizer.state_dict()
            tensors.update({f"{name}/{k}": v for k, v in t.items()})
            meta[f"{name}_optimizer"] = m
        ckpt.write_rank_state(tmp, tensors, meta, group=self.group)
        return ckpt.commit_checkpoint(self.root, step, group=self.group)

    def resume(self, mode: str, resume_from_path: str | None) -> int:
        """Load the latest checkpoint (trainer.resume_mode `mode`); returns the step it ends at
        (0: nothing to resume)."""
        if mode == "disable":
            return 0
        path = resume_from_path if mode == "resume_path" else None
        if path is None:
            if ckpt.find_latest(self.root) is None:
                return 0
            path = self.root
        try:
            tensors, meta = ckpt.load_checkpoint(path, self.rank, group=self.group)
        except ckpt.CorruptCheckpoint as e:
            raise ValueError(f"{e}; {earlier_checkpoint_hint(e.file)}") from None
        self.residency.enter("resume")
        for name, role in self.roles.items():
            pre = f"{name}/"
            try:
                role.engine.optimizer.load_state_dict(
                    {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)},
                    meta[f"{name}_optimizer"])
            except ValueError as e:     # another model or layout wrote it
                raise ValueError(f"cannot resume {name} from {path}: {e}") from None
        self.sampler.load_state_dict(meta["sampler"])
        self.kl_ctrl.load_state_dict(meta["kl_ctrl"])
        return int(meta["step"])


def earlier_checkpoint_hint(file: Path) -> str:
    """What to resume from instead of the checkpoint that holds the unreadable `file`."""
    ckpt_dir = file.parent.parent                       # global_step_N/state/<file>
    step = int(ckpt_dir.name.rpartition("_")[2].partition(".")[0])
    earlier = ckpt.earlier_checkpoint(ckpt_dir.parent, step)
    if earlier is None:
        return ("no earlier checkpoint: start fresh with trainer.resume_mode=disable "
                "trainer.overwrite=true")
    return (f"resume from the previous one with trainer.resume_mode=resume_path "
            f"trainer.resume_from_path={ckpt_dir.parent / f'global_step_{earlier}'}")
