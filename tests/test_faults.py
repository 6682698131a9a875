"""Bad days: kill -9 of a rank under torchrun --max-restarts (the group restarts and resumes from
its checkpoint, ending exactly as an uninterrupted run), a hung rank (the job ends with one line
naming rank, phase and wait instead of hanging), and the pieces behind them."""
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import free_port
from hybridengine.parallel.mesh import group_timeout
from hybridengine.rl.guards import Phases, PeerFailure, peer_failure_kind
from hybridengine.rl.rewards import RewardError
from hybridengine.rl.tracking import read_metrics

ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
ENV.update(HYBRIDENGINE_NO_PROGRESS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
SHORT = ["trainer.val_before_train=False", "trainer.test_freq=-1", "data.max_response_length=16"]
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "10000ms for recv operation to complete")
GLOO_LOST = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:44962")


def _torchrun(args, env_extra=None, restarts=0, timeout=300):
    """torchrun --nproc_per_node=2 launch/ppo.py with a c10d rendezvous of its own port, and a
    rendezvous store per round (torchrun restarts need both: see launch/slurm/ppo.sbatch)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--max-restarts={restarts}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(ROOT / "launch" / "ppo.py"), *args]
    env = dict(ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(env_extra or {}))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _strip(rows):
    return [{k: v for k, v in r.items()
             if not k.startswith(("timing_s/", "perf/")) and "memory" not in k} for r in rows]


def _hung_job(out):
    """(result, seconds) of a 1-step job whose rank 1 stops answering at step 1."""
    start = time.monotonic()
    proc = _torchrun(["trainer.total_training_steps=1", "trainer.collective_timeout_s=10",
                      *SHORT, f"trainer.default_local_dir={out}"],
                     {"HYBRIDENGINE_HANG_AT_STEP": "1"}, timeout=180)
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory):
    """The job of test_hung_rank_ends_the_job_with_one_line_naming_rank_and_phase, started
    (in a thread) before the kill -9 test: most of its time its ranks wait idle (rank 1 asleep,
    rank 0 in a receive until the 10 s timeout), so the kill -9 job runs meanwhile."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(1)
    job = pool.submit(_hung_job, tmp_path_factory.mktemp("hung"))
    yield job
    pool.shutdown(wait=True)


@pytest.mark.multiproc
def test_kill9_under_torchrun_restarts_resumes_and_matches_uninterrupted(tmp_path,
                                                                         uninterrupted_run,
                                                                         hung_run):
    # the uninterrupted run (conftest.uninterrupted_run: 4 steps, checkpoints at 2 and 4, SHORT);
    # tests/test_ppo_e2e.py loads its checkpoint in transformers. The restarted group runs the
    # same command with resume_mode=auto (the default): kill -9 then resume_mode=auto.
    a_dir, args = uninterrupted_run
    assert all(arg in args for arg in SHORT)
    killed = _torchrun(args + [f"trainer.default_local_dir={tmp_path / 'b'}"],
                       {"HYBRIDENGINE_KILL_AT_STEP": "3"}, restarts=1)
    assert killed.returncode == 0, killed.stderr[-5000:]
    # rank 0 really died at step 3: torchrun's summary names the first rank it saw end, rank 0
    # (-9) or rank 1 (-15: torchrun stopped it after rank 0's death), whichever came first
    assert re.search(r"exitcode\s*: -(9|15)\b", killed.stderr), killed.stderr[-3000:]
    # the kill left global_step_2 the latest checkpoint, and the restart resumed from it
    assert "start      resumed from global_step_2 (2 steps to go)" in killed.stdout.splitlines()
    a = read_metrics(a_dir / "metrics.jsonl")
    b = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]              # each step logged once
    assert _strip(a) == _strip(b)
    from safetensors.torch import load_file
    for f in ("actor/model-00001-of-00001.safetensors", "state/rank_00000.safetensors",
              "state/rank_00001.safetensors"):
        ta = load_file(str(a_dir / "global_step_4" / f))
        tb = load_file(str(tmp_path / "b" / "global_step_4" / f))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), f


@pytest.mark.multiproc
def test_hung_rank_ends_the_job_with_one_line_naming_rank_and_phase(hung_run):
    proc, elapsed = hung_run.result()      # started with the kill -9 test (hung_run says why)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    # Rank 1 stops answering at step 1; rank 0 waits for it in the reshard of the rollout.
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.fullmatch(r"error: rank 0 timed out in phase rollout \(step 1\) after 1\d\.\d s "
                        r"waiting for a peer rank \(trainer\.collective_timeout_s=10\)", lines[0])
    assert elapsed < 150


def test_phases_name_rank_phase_and_step_of_collective_failures():
    phases = Phases(rank=3, timeout_s=10)
    phases.step = 7
    with pytest.raises(PeerFailure) as info:
        with phases.enter("update_actor"):
            raise RuntimeError(GLOO_TIMEOUT)
    assert re.fullmatch(r"rank 3 timed out in phase update_actor \(step 7\) after 0\.0 s waiting "
                        r"for a peer rank \(trainer\.collective_timeout_s=10\)", str(info.value))
    with pytest.raises(PeerFailure, match=r"^rank 3 lost a peer in phase ref \(step 7\) after "
                                          r"0\.0 s: another rank exited; its log says why$"):
        with phases.enter("rollout"), phases.enter("ref"):   # the innermost phase names it
            raise RuntimeError(GLOO_LOST)
    assert phases.name == "setup"                            # restored on the way out


def test_phases_leave_other_errors_alone_and_time_the_block():
    phases, timings = Phases(0, 5), {}
    with pytest.raises(RewardError):     # a reward function's own timeout is the user's error
        with phases.enter("rollout"):
            raise RewardError("reward function failed on sample 0: TimeoutError: timed out")
    with pytest.raises(ValueError, match="Timed out waiting"):
        with phases.enter("rollout"):
            raise ValueError("Timed out waiting")
    with phases.enter("adv", timings):
        time.sleep(0.01)
    assert timings["adv"] >= 0.01
    assert peer_failure_kind(RuntimeError("CUDA out of memory")) is None


def _inject(step, rank, restart_count):
    env = dict(ENV, HYBRIDENGINE_KILL_AT_STEP="3")
    if restart_count is not None:
        env["TORCHELASTIC_RESTART_COUNT"] = str(restart_count)
    code = f"from hybridengine.rl.guards import inject_faults; inject_faults({step}, {rank}, 2)"
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode


def test_kill_injection_fires_once_per_restart_series():
    assert _inject(3, 0, None) == -9          # plain run: rank 0 dies at step 3
    assert _inject(3, 0, 0) == -9             # torchrun's first attempt
    assert _inject(3, 0, 1) == 0              # the restarted group runs through
    assert _inject(3, 1, 0) == 0              # only rank 0
    assert _inject(2, 0, 0) == 0              # only at that step


def test_new_groups_inherit_the_collective_timeout(tmp_path):
    assert group_timeout(3) == datetime.timedelta(seconds=3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=7))
    try:
        assert group_timeout(None) == datetime.timedelta(seconds=7)
        assert group_timeout(3) == datetime.timedelta(seconds=3)
    finally:
        dist.destroy_process_group()


def test_warns_when_torchrun_restarts_cannot_reconnect(monkeypatch, capsys):
    """Static rendezvous (or c10d sharing its store): a restart would not reconnect."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ppo_entry", ROOT / "launch" / "ppo.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")   # c10d, store not shared
    entry._warn_if_restarts_cannot_reconnect()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    entry._warn_if_restarts_cannot_reconnect()
    assert capsys.readouterr().err.startswith("warning: torchrun restarts need "
                                              "--rdzv-backend=c10d and "
                                              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
