"""A run owns its directory: a second run on it is refused and changes nothing, a fresh start
over an earlier run is refused (or replaces it with trainer.overwrite=true), a crashed run's lock
is taken over, and a resume goes through."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridengine.config import load_config
from hybridengine.rl.run_dir import LOCK_FILE, RunDirError, RunDirLock, claim_run_dir

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "data" / "stories_keywords" / "train.jsonl"
STORIES = ROOT / "models" / "stories260k"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def _earlier_run(root: Path) -> None:
    """What a finished run leaves: metrics and a checkpoint pointer with its directory."""
    (root / "global_step_2" / "actor").mkdir(parents=True)
    (root / "global_step_2" / "state").mkdir()
    (root / "global_step_2" / "actor" / "config.json").write_text("{}")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    (root / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')


def _overrides(root, *extra):
    return [f"data.train_files={TRAIN}", "data.val_files=null", f"actor_rollout_ref.model.path={STORIES}",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "data.max_response_length=8", "trainer.total_training_steps=1", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[]",
            f"trainer.default_local_dir={root}", *extra]


def _trainer(root, *extra):
    from hybridengine.rl.trainer import Trainer
    return Trainer(load_config(["--config", str(ROOT / "configs" / "tiny.yaml"),
                                *_overrides(root, *extra)]))


def test_a_second_run_on_a_locked_directory_is_refused_and_changes_nothing(tmp_path):
    _earlier_run(tmp_path)
    first = RunDirLock(tmp_path).acquire()          # the first run, still going
    before = _snapshot(tmp_path)
    env = dict(os.environ, HYBRIDENGINE_NO_PROGRESS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "ppo.py"),
                           "--config", str(ROOT / "configs" / "tiny.yaml"), *_overrides(tmp_path, "trainer.resume_mode=auto")],
                          env=env, capture_output=True, text=True, timeout=300)
    first.release()
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is in use by another run" in errors[0] and \
        f"pid {os.getpid()}" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert _snapshot(tmp_path) == before


def test_a_fresh_start_over_an_earlier_run_is_refused(tmp_path):
    _earlier_run(tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(RunDirError, match=r"holds an earlier run .*trainer\.resume_mode=disable.*"
                                          r"trainer\.overwrite=true"):
        _trainer(tmp_path, "trainer.resume_mode=disable")
    assert _snapshot(tmp_path) == before
    # metrics without any checkpoint: `auto` has nothing to resume, so it too would start fresh
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    before = _snapshot(tmp_path)
    with pytest.raises(RunDirError, match="no checkpoint to resume"):
        _trainer(tmp_path)
    assert _snapshot(tmp_path) == before


def test_overwrite_replaces_the_earlier_run(tmp_path, capsys):
    _earlier_run(tmp_path)
    trainer = _trainer(tmp_path, "trainer.resume_mode=disable", "trainer.overwrite=true")
    assert "removed the earlier run" in capsys.readouterr().out
    assert not (tmp_path / "global_step_2").exists()
    trainer.fit()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]
    assert (tmp_path / LOCK_FILE).read_text() == ""          # released at the end


def test_a_crashed_runs_lock_is_taken_over(tmp_path, capsys):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "gone", "started": "x"}))
    lock = claim_run_dir(tmp_path, "auto", False, resumable=False)
    assert "took over the lock of an earlier run" in capsys.readouterr().out
    with pytest.raises(RunDirError, match="in use by another run"):
        claim_run_dir(tmp_path, "auto", False, resumable=False)
    lock.release()
    claim_run_dir(tmp_path, "auto", False, resumable=False).release()
    assert "took over" not in capsys.readouterr().out         # a clean release leaves no owner


def test_resume_is_not_a_fresh_start(tmp_path):
    _earlier_run(tmp_path)
    claim_run_dir(tmp_path, "auto", False, resumable=True).release()
    claim_run_dir(tmp_path, "resume_path", False, resumable=True).release()


def test_an_unusable_directory_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RunDirError, match=r"default_local_dir=.*file/run cannot be used"):
        claim_run_dir(blocker / "run", "auto", False, resumable=False)
