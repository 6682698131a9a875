"""Multi-node launch on one machine: the SLURM batch script (syntax, dry run, and a real run of
two torchrun "nodes" through a stand-in srun), launch/ppo.py started directly by srun (SLURM_*
variables), and the result of 2 nodes x 2 ranks equal to 1 node x 4 ranks, metric for metric.
"""
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import free_port
from hybridengine.parallel.mesh import DistEnv, read_dist_env
from hybridengine.rl.tracking import read_metrics

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "launch" / "slurm" / "ppo.sbatch"
LAUNCHER_VARS = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC")
ENV = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
ENV.update(HYBRIDENGINE_NO_PROGRESS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
# The default job (configs/tiny.yaml, actor tp=2), two steps of 8 prompts (two mini-batches of
# one micro-batch per rank each, as the default job's 16 prompts). On 4 ranks: dp=2 for
# training, 4 generation replicas (rollout tp 1).
SHORT = ["trainer.total_training_steps=2", "trainer.val_before_train=False",
         "trainer.test_freq=2", "trainer.save_freq=2", "data.max_response_length=16",
         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"]

# srun stand-in: runs the command once per "node" of SLURM_NNODES on this machine, with the
# node's SLURM_NODEID / SLURM_PROCID and its --output file (%n: the node index).
FAKE_SRUN = r"""#!/bin/bash
out=/dev/stdout
while [[ $1 == -* ]]; do
    case $1 in --output=*) out=${1#--output=} ;; esac
    shift
done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" > "${out//%n/$node}" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


def _strip(rows):
    """Training metrics only (as tests/test_ppo_e2e.py): times and memory differ between runs."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("timing_s/", "perf/")) and "memory" not in k} for r in rows]


def _dry_run(env_extra: dict, *args):
    env = dict(ENV, DRY_RUN="1", **env_extra)
    return subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True,
                          timeout=30)


def test_sbatch_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_sbatch_dry_run_prints_the_commands_for_2_nodes_of_8():
    proc = _dry_run(dict(SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8", SLURM_JOB_ID="1234",
                         SLURM_JOB_NODELIST="gpu[03-04]", SLURM_SUBMIT_DIR="/shared/he"),
                    "--config", "configs/gsm8k_qwen2_5_0_5b.yaml", "trainer.total_epochs=1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "mkdir -p /shared/he/logs/1234",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 srun --nodes=2 --ntasks-per-node=1 "
        "--kill-on-bad-exit=1 --output=/shared/he/logs/1234/node%n.log torchrun --nnodes=2 "
        "--nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=gpu03:29500 --rdzv-id=1234 "
        "--max-restarts=0 /shared/he/launch/ppo.py trainer.nnodes=2 trainer.n_gpus_per_node=8 "
        "--config configs/gsm8k_qwen2_5_0_5b.yaml trainer.total_epochs=1"]


def test_sbatch_dry_run_knobs_and_quoting():
    proc = _dry_run(dict(SLURM_NNODES="3", SLURM_GPUS_ON_NODE="4", SLURM_JOB_ID="7",
                         SLURM_JOB_NODELIST="a100-node7,a100-node9", SLURM_SUBMIT_DIR="/r",
                         RDZV_PORT="31000", MAX_RESTARTS="2", LOG_DIR="/logs/my run",
                         TORCHRUN="python -m torch.distributed.run"),
                    "trainer.logger=['console']")
    assert proc.returncode == 0, proc.stderr
    mkdir, run = proc.stdout.splitlines()
    assert mkdir == r"mkdir -p /logs/my\ run"
    assert r"--output=/logs/my\ run/node%n.log python -m torch.distributed.run --nnodes=3 " \
           r"--nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=a100-node7:31000 " \
           r"--rdzv-id=7 --max-restarts=2 " in run
    assert run.endswith(r"trainer.nnodes=3 trainer.n_gpus_per_node=4 "
                        r"trainer.logger=\[\'console\'\]")


def test_sbatch_outside_slurm_says_so():
    proc = _dry_run({})
    assert proc.returncode != 0
    assert "SLURM_NNODES: not inside a SLURM allocation (sbatch / salloc)" in proc.stderr


def test_read_dist_env_under_srun():
    """srun --ntasks-per-node=4 python launch/ppo.py: ranks from SLURM_*, master on the first
    node of the list, port 20000 + job id mod 10000 (MASTER_* win when set)."""
    slurm = dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_JOB_ID="123456",
                 SLURM_JOB_NODELIST="gpu[07-08,11],cpu1")
    assert read_dist_env(slurm) == DistEnv(5, 8, 1, "gpu07", 23456)
    assert read_dist_env(dict(slurm, MASTER_ADDR="10.0.0.1", MASTER_PORT="29999")) == \
        DistEnv(5, 8, 1, "10.0.0.1", 29999)
    # torchrun's variables win over SLURM's (torchrun inside an allocation)
    assert read_dist_env(dict(slurm, RANK="2", WORLD_SIZE="4", LOCAL_RANK="0")).rank == 2


def _fake_slurm_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _two_nodes_via_sbatch(tmp_path: Path, out: Path) -> None:
    env = dict(ENV, SLURM_NNODES="2", SLURM_GPUS_ON_NODE="2", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="127.0.0.1", SLURM_SUBMIT_DIR=str(ROOT),
               RDZV_PORT=str(free_port()), LOG_DIR=str(tmp_path / "logs"),
               TORCHRUN=f"{sys.executable} -m torch.distributed.run",
               PATH=f"{_fake_slurm_bin(tmp_path)}:{ENV['PATH']}")
    proc = subprocess.run(["bash", str(SBATCH), *SHORT, f"trainer.default_local_dir={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    logs = [(tmp_path / "logs" / f"node{n}.log") for n in range(2)]
    text = [log.read_text() if log.is_file() else "" for log in logs]
    assert proc.returncode == 0, proc.stdout + proc.stderr + text[0][-3000:] + text[1][-3000:]
    # one log per node; global rank 0 (on whichever node the rendezvous made first) reports
    assert sum(f"metrics: {out / 'metrics.jsonl'}" in t for t in text) == 1


def _free_port_in(lo: int, hi: int) -> int:
    start = lo + os.getpid() * 7919 % (hi - lo)
    for port in (lo + (start - lo + i) % (hi - lo) for i in range(hi - lo)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{lo}, {hi})")


def _one_node_via_srun(out: Path, world: int = 4) -> None:
    """What `srun --ntasks-per-node=4 python launch/ppo.py` starts: one process per task."""
    port = _free_port_in(20000, 30000)           # the range read_dist_env derives from
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "ppo.py"), *SHORT,
         f"trainer.default_local_dir={out}"],
        cwd=ROOT, env=dict(ENV, SLURM_PROCID=str(r), SLURM_NTASKS=str(world), SLURM_LOCALID=str(r),
                           SLURM_JOB_ID=str(port - 20000), SLURM_JOB_NODELIST="127.0.0.1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)


@pytest.mark.multiproc
def test_two_nodes_of_two_equal_one_node_of_four(tmp_path):
    two, one = tmp_path / "two_nodes", tmp_path / "one_node"
    _two_nodes_via_sbatch(tmp_path, two)
    _one_node_via_srun(one)
    a, b = read_metrics(two / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert [r["step"] for r in a] == [1, 2]
    assert a[0]["reshard/bytes_per_rank"] > 0          # tp 2 -> generation tp 1 moved weights
    assert _strip(a) == _strip(b)
    from safetensors.torch import load_file
    name = "model-00001-of-00001.safetensors"
    wa = load_file(str(two / "global_step_2" / "actor" / name))
    wb = load_file(str(one / "global_step_2" / "actor" / name))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
