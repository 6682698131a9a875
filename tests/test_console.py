"""The console a person reads: the start-up header, one short line per step with progress and
ETA, resume / already-complete lines, and the default job's stdout as a whole."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridengine.rl import console
from hybridengine.rl.console import (MAX_LINE, RunFacts, StepClock, duration, header_lines,
                                     start_text, step_line)
from hybridengine.rl.tracking import read_metrics

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
ENV.pop(console.FULL_LINE_ENV, None)

STEP = {"critic/score/mean": 0.2708, "response_length/mean": 47.5,
        "response_length/clip_ratio": 0.875, "actor/kl_loss": 0.0812, "actor/pg_loss": 0.01,
        "perf/throughput": 1563.8, "timing_s/step": 2.586, "val/reward/mean": 0.797,
        "val/test_score/keyword": 0.797}


def test_step_line_shows_the_watched_numbers():
    assert step_line(STEP, 7, 20, eta_s=33.4) == (
        "step  7/20  score  0.271  len  47.5 clip  88%  kl 0.0812    1564 tok/s/dev   2.59 s"
        "  eta 0:33  val 0.797")
    # fields whose metric is missing are left out; in-reward KL when there is no KL loss
    assert step_line({"actor/reward_kl_penalty": 0.5}, 3) == "step 3  kl 0.500"
    # validation before training
    assert step_line({"val/reward/mean": 0.0339, "val/response_length/mean": 48.0}, 0, 20) == \
        "step  0/20  val 0.034 (len 48.0)"


def test_step_line_stays_short_for_any_values():
    huge = {key: -1.234567e15 for key in STEP} | {"response_length/clip_ratio": 1.0}
    for metrics in (STEP, huge, {k: float("nan") for k in STEP}):
        line = step_line(metrics, 123456, 1234567, eta_s=3600 * 999)
        assert len(line) < MAX_LINE, line


def test_duration_and_eta(monkeypatch):
    assert [duration(s) for s in (0, 59.6, 61, 3725)] == ["0:00", "1:00", "1:01", "1:02:05"]
    now = [100.0]
    monkeypatch.setattr(console.time, "perf_counter", lambda: now[0])
    clock = StepClock(total_steps=10, step=0)
    assert clock.eta_s(0) is None                       # no step done yet
    now[0] += 30.0                                      # validation before training
    clock.start(0)
    now[0] += 4.0
    assert clock.eta_s(2) == pytest.approx(2.0 * 8)     # 2 s per step, 8 to go
    assert clock.eta_s(10) == 0.0
    assert StepClock(None).eta_s(3) is None


def test_start_and_header():
    assert start_text(0, 20) == "fresh"
    assert start_text(10, 20) == "resumed from global_step_10 (10 steps to go)"
    assert start_text(20, 20) == "already complete (global_step_20 of 20)"
    assert start_text(5, 20, "/runs/a") == "resumed from global_step_5 in /runs/a (15 steps to go)"
    facts = RunFacts(name="p/e", model="m", layout="l", algorithm="a", data="d", steps="s",
                     output="o", start="fresh")
    lines = header_lines(facts)
    assert lines[0] == "run        p/e" and lines[-1] == "start      fresh"
    assert len(lines) == 8
    fused = header_lines(RunFacts(**{**facts.__dict__, "fusion": "f"}))
    assert fused[3] == "fusion     f" and len(fused) == 9
    from types import SimpleNamespace
    from hybridengine.rl.console import _fused
    assert _fused(SimpleNamespace(wgrad_fused=20)) == "(20 linear layers)"
    assert "frozen" in _fused(SimpleNamespace(wgrad_fused=0))      # a LoRA role: nothing fused


def _launch(args, nproc=1):
    cmd = [sys.executable, str(ROOT / "launch" / "ppo.py"), *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         "--master_port", str(29700 + os.getpid() % 1000), str(ROOT / "launch" / "ppo.py"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout.splitlines()


def _step_lines(lines):
    return [line for line in lines if line.startswith("step ")]


@pytest.mark.multiproc
def test_default_job_console(default_job_run):
    """The embedded default job (2 ranks), 6 steps (conftest.default_job_run, the run
    tests/test_ppo_e2e.py checks learns): the header once, then one short line per step with its
    progress and ETA, then the summary; every metric is in metrics.jsonl."""
    tmp_path, lines = default_job_run
    header = lines[:lines.index("start      fresh") + 1]
    rows = {line.split()[0]: line[11:] for line in header}
    assert rows["run"] == "hybridengine/tiny_stories_keywords"
    assert rows["model"].endswith("models/stories260k: llama, 260K params (5 layers x 64), "
                                  "1016 KiB in float32 on cpu")
    assert rows["layout"] == ("2 ranks: actor tp=2+sp pp=1 dp=1, rollout tp=1 dp=2 (builtin), "
                              "ref tp=2+sp pp=1 dp=1")
    assert rows["algorithm"].startswith("grpo, 16 prompts x 8 responses per step, KL loss")
    assert rows["data"].startswith("96 train prompts, 32 val prompts")
    assert rows["steps"].startswith("6 (6 per epoch)") and rows["output"] == str(tmp_path)
    assert sum(line.startswith("run ") for line in lines) == 1      # rank 0 only
    steps = _step_lines(lines)
    assert [line.split()[1] for line in steps] == [f"{i}/6" for i in range(7)]
    for line in steps[1:]:
        assert len(line) < MAX_LINE, line
        for field in ("score", "len", "clip", "kl", "tok/s/dev", " s  eta "):
            assert field in line, (field, line)
    assert steps[6].endswith(tuple(f"val {v / 1000:.3f}" for v in range(1001)))
    assert not any(line.startswith("step:") for line in lines)     # verl's long line is off
    record = read_metrics(tmp_path / "metrics.jsonl")[1]            # ... all in metrics.jsonl
    assert record["step"] == 1 and len(record) > 40 and "actor/pg_loss" in record
    assert lines[-3].startswith("done: steps 1-6 in ")
    assert lines[-2:] == [f"metrics: {tmp_path / 'metrics.jsonl'}", f"checkpoints: {tmp_path}"]


def test_resumed_and_already_complete_lines(tmp_path):
    base = [f"trainer.default_local_dir={tmp_path}", "trainer.val_before_train=false",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "data.max_response_length=16", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4"]      # the lines, not the batch
    _launch(base + ["trainer.total_training_steps=1"])
    lines = _launch(base + ["trainer.total_training_steps=2"])
    assert "start      resumed from global_step_1 (1 step to go)" in lines
    assert [line.split()[1] for line in _step_lines(lines)] == ["2/2"]
    lines = _launch(base + ["trainer.total_training_steps=2"])
    assert "start      already complete (global_step_2 of 2)" in lines
    assert not _step_lines(lines) and not any(line.startswith("done:") for line in lines)
