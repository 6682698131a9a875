"""Tracker backends, resume truncation, timers, metric reduction and tools/plot.py."""
import importlib.util
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridengine.rl.console import FULL_LINE_ENV
from hybridengine.rl.tracking import (METRICS_FILE, NO_PROGRESS_ENV, Tracker, format_console,
                                      progress_enabled, read_metrics, reduce_metrics, timer)

REPO = Path(__file__).resolve().parents[1]


def steps_in(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_console_line_matches_verl_format_when_asked(capsys, monkeypatch):
    monkeypatch.setenv(FULL_LINE_ENV, "verl")
    tracker = Tracker(["console"])
    tracker.log({"b/x": 1.23456, "a": 2, "c": 1234567.0}, step=3)
    tracker.close()
    assert capsys.readouterr().out == "step:3 - a:2 - b/x:1.235 - c:1.235e+06\n"


def test_console_prints_the_short_line_and_a_summary(capsys, monkeypatch):
    monkeypatch.delenv(FULL_LINE_ENV, raising=False)
    tracker = Tracker(["console"], total_steps=4)
    tracker.log({"val/reward/mean": 0.25, "val/response_length/mean": 40.0}, step=0)
    for step in (1, 2):
        tracker.log({"critic/score/mean": 0.5, "actor/pg_loss": 0.1, "timing_s/step": 1.5,
                     **({"val/reward/mean": 0.75} if step == 2 else {})}, step=step)
    summary = tracker.summary()
    tracker.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 0/4  val 0.250 (len 40.0)"
    assert lines[1].startswith("step 1/4  score  0.500   1.50 s  eta ") and "pg_loss" not in lines[1]
    assert lines[2].endswith("val 0.750")
    assert summary.startswith("done: steps 1-2 in 0:0") and summary.endswith("val 0.250 -> 0.750")
    assert Tracker([]).summary() is None        # console off


def test_jsonl_is_flushed_every_step_and_sorted(tmp_path):
    tracker = Tracker(["console"], log_dir=tmp_path)  # jsonl is on whenever log_dir is given
    tracker.log({"z": 0.5, "val/score": 1.0}, step=1)
    # Read while the tracker is still open: the line must already be on disk.
    assert (tmp_path / METRICS_FILE).read_text() == '{"step": 1, "val/score": 1.0, "z": 0.5}\n'
    tracker.log({"z": float("nan")}, step=2)
    tracker.close()
    assert read_metrics(tmp_path / METRICS_FILE)[1] == {"step": 2, "z": None}  # strict JSON


def test_only_rank_zero_writes(tmp_path, capsys):
    tracker = Tracker(["console", "tensorboard"], log_dir=tmp_path / "run", rank=1)
    tracker.log({"a": 1.0}, step=1)
    tracker.close()
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().out == ""


def test_resume_keeps_steps_up_to_checkpoint(tmp_path):
    with Tracker([], log_dir=tmp_path) as tracker:
        for step in range(0, 6):
            tracker.log({"loss": float(step)}, step=step)
    # The run was killed mid-write after step 5: a truncated line follows.
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 6, "lo')
    with Tracker([], log_dir=tmp_path, resume_step=3) as tracker:
        assert steps_in(tmp_path / METRICS_FILE) == [0, 1, 2, 3]
        tracker.log({"loss": 40.0}, step=4)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[-1]["loss"] == 40.0
    # A fresh run in the same directory starts over.
    Tracker([], log_dir=tmp_path).close()
    assert (tmp_path / METRICS_FILE).read_text() == ""


def test_read_metrics_rejects_corruption_before_the_last_line(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_metrics(tmp_path / "missing.jsonl")


def test_tensorboard_scalars_and_resume_purge(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(["tensorboard"], log_dir=tmp_path) as tracker:
        for step in range(1, 6):
            tracker.log({"actor/pg_loss": float(step)}, step=step)
        tracker.log({"val/score": 0.5}, step=5)
    time.sleep(1.1)  # event file names carry the time in seconds; keep the two runs ordered
    with Tracker(["tensorboard"], log_dir=tmp_path, resume_step=3) as tracker:
        for step in range(4, 7):
            tracker.log({"actor/pg_loss": 10.0 * step}, step=step)
        tracker.log({"val/score": 0.6}, step=6)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("actor/pg_loss")]
    assert scalars == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    # Steps never go backwards for this tag, so only the resume's purge event hides step 5.
    assert [(e.step, e.value) for e in events.Scalars("val/score")] == [(6, pytest.approx(0.6))]


def test_unknown_backend_names_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"'neptune'.*console, jsonl, tensorboard, wandb"):
        Tracker(["console", "neptune"])
    with pytest.raises(ValueError, match="default_local_dir"):
        Tracker("tensorboard")  # a bare string is accepted as one backend, but needs a dir
    with pytest.raises(ValueError, match="'loss' is not a number"):
        Tracker(["console"]).log({"loss": "high"}, step=1)


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_rank_zero_terminal(monkeypatch):
    monkeypatch.delenv(NO_PROGRESS_ENV, raising=False)
    assert progress_enabled(0, FakeTty())
    assert not progress_enabled(1, FakeTty())
    assert not progress_enabled(0, io.StringIO())  # piped to a file: no bar
    monkeypatch.setenv(NO_PROGRESS_ENV, "1")
    assert not progress_enabled(0, FakeTty())


def test_timer_accumulates():
    timings = {}
    for _ in range(2):
        with timer("gen", timings, sync_cuda=True):  # no CUDA here: sync is skipped
            time.sleep(0.02)
    assert 0.04 <= timings["gen"] < 1.0
    with pytest.raises(RuntimeError), timer("update", timings):
        raise RuntimeError("the block failed")
    assert "update" in timings  # time is recorded even when the block raises


def test_reduce_metrics_means_per_key():
    reduced = reduce_metrics([{"a": 1.0, "b": 4}, {"a": 3.0}, {"a": 5.0, "b": 6}])
    assert reduced == {"a": 3.0, "b": 5.0}
    assert reduce_metrics([]) == {}
    assert format_console(reduced, 7) == "step:7 - a:3 - b:5"


def write_run(path: Path, num_steps: int) -> None:
    with Tracker([], log_dir=path) as tracker:
        for step in range(1, num_steps + 1):
            tracker.log({"critic/score/mean": step / num_steps, "actor/ppo_kl": 1e-3 * step,
                         "actor/pg_loss": -0.1, "response_length/mean": 100.0 + 5 * step,
                         "perf/throughput": 1500.0 + 10 * (step % 3)}, step=step)
            if step % 5 == 0:  # validation in its own call at the same step
                tracker.log({"val/score/mean": 0.5 * step / num_steps,
                             "val/response_length/mean": 90.0 + step}, step=step)


def run_plot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "plot.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_plot_tool_writes_a_png(tmp_path):
    write_run(tmp_path, num_steps=20)
    out = tmp_path / "plot.png"
    result = run_plot(str(tmp_path / METRICS_FILE), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "reward, KL, response length, throughput" in result.stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # four panels of lines, not a blank canvas

    # Only one panel's keys present: the others are skipped, not drawn empty.
    (tmp_path / "sparse.jsonl").write_text('{"step": 1, "perf/throughput": 10.0}\n'
                                           '{"step": 2, "perf/throughput": 12.0}\n')
    result = run_plot(str(tmp_path / "sparse.jsonl"))
    assert result.returncode == 0, result.stderr
    assert "(throughput)" in result.stdout
    assert (tmp_path / "sparse.png").stat().st_size > 5_000

    (tmp_path / "empty.jsonl").write_text('{"step": 1, "other": 1.0}\n')
    result = run_plot(str(tmp_path / "empty.jsonl"))
    assert result.returncode == 1
    assert "no plottable keys" in result.stderr and "Traceback" not in result.stderr


def load_plot_tool():
    spec = importlib.util.spec_from_file_location("plot_tool", REPO / "tools" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_plot_marks_the_length_limit_and_keeps_identical_series(tmp_path):
    plot_tool = load_plot_tool()
    with Tracker([], log_dir=tmp_path) as tracker:
        for step in range(1, 5):
            clipped = 0.25 * (step - 1)
            tracker.log({"response_length/mean": 30.0 + step, "response_length/max": 40.0 if
                         clipped else 35.0, "response_length/clip_ratio": clipped,
                         "perf/throughput": 100.0}, step=step)
        for step in (0, 4):   # two validation keys with the same values: one would hide the other
            tracker.log({"val/reward/mean": 0.1 * step, "val/test_score/src": 0.1 * step},
                        step=step)
    by_step = plot_tool.merge_by_step(read_metrics(tmp_path / METRICS_FILE))
    assert plot_tool.infer_max_response_length(by_step) == 40   # from a step that clipped
    fig, titles = plot_tool.figure(by_step)
    legends = {ax.get_title() or ax.get_ylabel(): [t.get_text() for t in ax.get_legend().texts]
               for ax in fig.axes if ax.get_legend()}
    assert legends["reward"] == ["val/reward/mean", "val/test_score/src (= val/reward/mean)"]
    length = next(labels for labels in legends.values() if "response_length/mean" in labels)
    assert "max_response_length = 40" in length
    assert "clipped % (response_length/clip_ratio)" in length
    assert any(ax.get_ylabel() == "tokens/s per device" for ax in fig.axes)
    fig, _ = plot_tool.figure(by_step, max_response_length=64)   # --max-response-length
    assert any("max_response_length = 64" in t.get_text() for ax in fig.axes if ax.get_legend()
               for t in ax.get_legend().texts)


def test_plot_compares_runs_by_step_and_by_training_minutes(tmp_path):
    """Several metrics files: one comparison figure (validation score against step and against
    the summed timing_s/step, training score's running mean); bad --labels: one error line."""
    plot_tool = load_plot_tool()
    for name, seconds in (("a", 1.0), ("b", 3.0)):
        with Tracker([], log_dir=tmp_path / name) as tracker:
            for step in range(1, 7):
                tracker.log({"critic/score/mean": 0.1 * step, "timing_s/step": seconds},
                            step=step)
            for step in (0, 3, 6):
                tracker.log({"val/reward/mean": 0.05 * step}, step=step)
    by_step = plot_tool.merge_by_step(read_metrics(tmp_path / "b" / METRICS_FILE))
    assert plot_tool.training_minutes(by_step)[6] == pytest.approx(6 * 3.0 / 60)
    assert plot_tool.running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    fig = plot_tool.compare_figure({"a": plot_tool.merge_by_step(
        read_metrics(tmp_path / "a" / METRICS_FILE)), "b": by_step})
    by_time = fig.axes[1]
    assert [t.get_text() for t in by_time.get_legend().texts] == ["a", "b"]
    assert list(by_time.lines[1].get_xdata()) == pytest.approx([0.0, 0.15, 0.3])
    out = tmp_path / "cmp.png"
    files = [str(tmp_path / n / METRICS_FILE) for n in "ab"]
    result = run_plot(*files, "--labels", "GRPO,PPO", "--out", str(out))
    assert result.returncode == 0 and "comparison of GRPO, PPO" in result.stdout, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = run_plot(*files, "--labels", "GRPO", "--out", str(out))
    assert result.returncode == 1 and "--labels names 1 runs for 2" in result.stderr
