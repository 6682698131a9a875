import os

import pytest

# hybridengine is imported as installed (pip install -e .). tests/ itself is on sys.path through
# pytest's default "prepend" import mode (tests/ has no __init__.py), so the tests import its
# helpers by name: dist_utils, model_utils, tool_utils (which loads the scripts of tools/).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HYBRIDENGINE_NO_PROGRESS", "1")


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only contend on a shared 2-core machine (50x slower)."""
    import torch
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# --- jobs that several test modules check (session-scoped: each runs once per session) --------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_ENV = dict(os.environ, HYBRIDENGINE_NO_PROGRESS="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
JOB_ENV = {k: v for k, v in JOB_ENV.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                "MASTER_"))}


@pytest.fixture(scope="session")
def gsm8k_setup(tmp_path_factory):
    """A tiny random Qwen2 with the real Qwen2.5 tokenizer, and GSM8K parquet from 64 rows (the
    64 shortest questions, in file order: the 152k vocabulary costs per token on the CPU).
    Shared by tests/test_ppo_e2e.py and tests/test_verl_commands.py (each run writes its own
    folder under it)."""
    import subprocess
    import sys
    from pathlib import Path

    import torch
    root = Path(ROOT)
    tokenizer = root.parent / "shared" / "models" / "qwen2-tokenizer"
    if not tokenizer.is_dir():
        pytest.skip("../shared/models/qwen2-tokenizer is not there")
    from transformers import Qwen2Config, Qwen2ForCausalLM
    base = tmp_path_factory.mktemp("gsm8k")
    model_dir = base / "pretrained_models" / "Qwen2.5-0.5B-Instruct"
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True, max_position_embeddings=1024)
    Qwen2ForCausalLM(cfg).save_pretrained(str(model_dir))
    for f in tokenizer.iterdir():
        if f.suffix in (".json", ".txt"):
            (model_dir / f.name).write_bytes(f.read_bytes())
    raw = base / "raw"
    raw.mkdir()
    lines = (root / "tests" / "fixtures" / "gsm8k_sample.jsonl").read_text().splitlines()
    shared = root.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    if shared.is_file():
        lines = shared.read_text().splitlines()
    keep = sorted(sorted(range(len(lines)), key=lambda i: len(lines[i]))[:64])
    lines = [lines[i] for i in keep]
    (raw / "train.jsonl").write_text("\n".join(lines) + "\n")
    (raw / "test.jsonl").write_text("\n".join(lines[:16]) + "\n")
    subprocess.run([sys.executable, str(root / "tools" / "data" / "gsm8k.py"), "--input_dir",
                    str(raw), "--local_dir", str(base / "data" / "processed" / "gsm8k")],
                   check=True, env=JOB_ENV, capture_output=True)
    return base


# The default job (2 ranks), 4 steps with checkpoints at 2 and 4: the uninterrupted reference of
# the kill -9 test (tests/test_faults.py: torchrun's restart, resume_mode=auto), whose interrupted
# run takes these arguments too; tests/test_ppo_e2e.py loads its checkpoint in transformers.
RESUME_ARGS = ["trainer.total_training_steps=4", "trainer.save_freq=2",
               "trainer.val_before_train=False", "trainer.test_freq=-1",
               "data.max_response_length=16"]


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory):
    """(output folder, RESUME_ARGS) of the uninterrupted run."""
    import subprocess
    import sys

    from dist_utils import free_port
    out = tmp_path_factory.mktemp("uninterrupted") / "a"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
           str(free_port()), os.path.join(ROOT, "launch", "ppo.py"), *RESUME_ARGS,
           f"trainer.default_local_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=JOB_ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return out, list(RESUME_ARGS)


# The embedded default job (2 ranks: actor tp=2, generation tp=1), 6 steps, validation before
# training and at step 6: tests/test_ppo_e2e.py checks that it learns, tests/test_console.py
# reads its stdout (one run instead of a 6-step and a 2-step one).
DEFAULT_JOB_ARGS = ["trainer.total_training_steps=6", "trainer.test_freq=6"]


@pytest.fixture(scope="session")
def default_job_run(tmp_path_factory):
    """(output folder, stdout lines) of the default job with DEFAULT_JOB_ARGS."""
    import subprocess
    import sys

    from dist_utils import free_port
    out = tmp_path_factory.mktemp("default_job")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
           str(free_port()), os.path.join(ROOT, "launch", "ppo.py"),
           f"trainer.default_local_dir={out}", *DEFAULT_JOB_ARGS]
    env = {k: v for k, v in JOB_ENV.items() if k != "HYBRIDENGINE_CONSOLE"}   # the short lines
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return out, proc.stdout.splitlines()


# One tools/bench_ppo.py --tiny run (1 step, profiled, grads and optimizer offloaded):
# tests/test_profiling.py checks its per-phase profile and offload timing, tests/test_bench_ppo.py
# its memory plan beside the measured peak (which the profile and offload leave in the JSON).
BENCH_PPO_TINY = ["--tiny", "--steps", "1", "--warmup", "0", "--profile", "--offload",
                  "grads,optimizer", "--set", "data.max_response_length=8",
                  "--response-lengths", "lognormal:5:0.5",       # stops that EOS would not
                  "--set", "actor_rollout_ref.rollout.ignore_eos=true"]


@pytest.fixture(scope="session")
def bench_ppo_tiny():
    """(returncode, stderr, JSON output or None) of tools/bench_ppo.py BENCH_PPO_TINY."""
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_ppo.py"),
                           *BENCH_PPO_TINY], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HYBRIDENGINE_NO_PROGRESS="1"))
    return proc.returncode, proc.stderr, json.loads(proc.stdout) if proc.returncode == 0 else None


@pytest.fixture(scope="session")
def family_interpreter_checks():
    """The two model-family check scripts of Triton's interpreter (tests/test_model_families.py:
    qk norm and llama3 RoPE; tests/test_model_families_gemma.py: Gemma 3's windowed layers), run
    at once, one core each: {module name: subprocess.CompletedProcess}."""
    import test_model_families
    import test_model_families_gemma
    from test_rollout import interpreter_results
    return interpreter_results({"test_model_families": test_model_families.TRITON_FAMILY_CHECK,
                                "test_model_families_gemma":
                                    test_model_families_gemma.TRITON_MIXED_CHECK})
