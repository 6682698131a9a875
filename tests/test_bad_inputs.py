"""The bad-input catalogue: each case is a wrong file, key, layout or value, and the exact
one-line error it gets (README: "When things go wrong"). Then what the trainer does on bad
numbers and bad luck (non-finite losses, empty responses, a full disk, a checkpoint of another
model), and the command line's own contract: "error: ..." on stderr, exit code 2.

Fast on purpose: checks run in process, on the function that owns them; one-process Trainers
on the stories260k model; launch/ppo.py only where the CLI itself is under test.
"""
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridengine.config import load_config, validate_config
from hybridengine.models.hf import load_decoder, read_model_config
from hybridengine.train import checkpoint as ckpt
from hybridengine.rl.data import PromptDataset, load_rows, load_tokenizer
from hybridengine.rl.guards import NonFiniteUpdate, SaveError
from hybridengine.rl.rewards import RewardError, load_custom_reward, score_batch
from hybridengine.rl.run_dir import RunDirError, claim_run_dir
from hybridengine.rl.tracking import read_metrics

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT / "models" / "stories260k"
TINY = ROOT / "configs" / "tiny.yaml"
TRAIN = ROOT / "data" / "stories_keywords" / "train.jsonl"


def _row(content="Once upon a time", truth=("dog",), index=0):
    return {"data_source": "keyword", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": list(truth)},
            "extra_info": {"index": index}}


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tiny(*overrides):
    return load_config(["--config", str(TINY), *overrides])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(STORIES)


# ----------------------------------------------------------------------------- the catalogue
# Each case: tmp_path -> (call, exception type, its exact message).

def parquet_missing_column(tmp):
    f = tmp / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "2+2?", "data_source": "openai/gsm8k"}]), f)
    return lambda: load_rows(f), ValueError, \
        f"{f}: missing column 'prompt' (columns: ['question', 'data_source'])"


def empty_prompt(tmp):
    f = _jsonl(tmp / "train.jsonl", [_row(), _row("   ", index=1)])
    return lambda: load_rows(f), ValueError, f"{f} row 1: empty prompt"


def ground_truth_missing(tmp):
    row = _row()
    del row["reward_model"]["ground_truth"]
    f = _jsonl(tmp / "train.jsonl", [row])
    return lambda: load_rows(f), ValueError, f"{f} row 0: missing reward_model.ground_truth"


def prompt_file_missing(tmp):
    return lambda: load_rows(tmp / "nope.parquet"), FileNotFoundError, \
        f"prompt file not found: {tmp / 'nope.parquet'}"


def jsonl_line_not_json(tmp):
    f = tmp / "train.jsonl"
    f.write_text(json.dumps(_row()) + "\n{oops\n")
    return lambda: load_rows(f), ValueError, f"{f}:2: invalid JSON (Expecting property name " \
        "enclosed in double quotes)"


def prompt_too_long_truncation_error(tmp):
    tok = load_tokenizer(STORIES)
    n = len(tok.encode("Once upon a time there was a dog", add_special_tokens=False)) + 1  # BOS
    return lambda: PromptDataset([_row("Once upon a time there was a dog")], tok, 4), ValueError, \
        f"prompt row 0 has {n} tokens > max_prompt_length=4 (set data.truncation or " \
        f"data.filter_overlong_prompts=True)"


def every_prompt_filtered(tmp):
    tok = load_tokenizer(STORIES)
    return lambda: PromptDataset([_row("Once upon a time there was a dog")], tok, 4,
                                 filter_overlong_prompts=True), ValueError, \
        "no prompts left: all 1 are longer than max_prompt_length=4"


def unknown_config_key(tmp):
    return lambda: _tiny("trainer.total_trainig_steps=2"), ValueError, \
        "unknown config key 'trainer.total_trainig_steps' (nearest known key: " \
        "'trainer.total_training_steps')"


def wrong_type_for_key(tmp):
    return lambda: _tiny("trainer.total_training_steps=ten"), ValueError, \
        "trainer.total_training_steps='ten': expected an integer or null, got str"


def unknown_choice(tmp):
    return lambda: _tiny("trainer.nan_policy=ignore"), ValueError, \
        "trainer.nan_policy='ignore': choose one of abort, skip"


def tp_does_not_divide_heads(tmp):
    return lambda: read_model_config(STORIES).check_tp(3), ValueError, \
        "num_attention_heads=8 is not divisible by tensor parallel size 3"


def tp_does_not_divide_kv_heads(tmp):
    return lambda: read_model_config(STORIES).check_tp(8), ValueError, \
        "num_key_value_heads=4 is not divisible by tensor parallel size 8"


def tp_pp_does_not_divide_world(tmp):
    return lambda: validate_config(_tiny(), 3), ValueError, \
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size * " \
        "pipeline_model_parallel_size = 2*1 must be positive and divide the world size 3"


def rollout_tp_does_not_divide_actor_tp_pp(tmp):
    cfg = _tiny("actor_rollout_ref.rollout.tensor_model_parallel_size=4")
    return lambda: validate_config(cfg, 4), ValueError, \
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4 must divide actor tp*pp = 2*1: " \
        "the generation layout has d_g = tp*pp/t_g replicas per training replica"


def rollout_tp_over_actor_tp_with_pp(tmp):
    cfg = _tiny("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    return lambda: validate_config(cfg, 2), ValueError, \
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2 must divide actor " \
        "tensor_model_parallel_size=1 (a generation TP shard is made of whole training TP " \
        "shards; pipeline stages are not split across it)"


def batch_not_multiple_of_mini_batch(tmp):
    cfg = _tiny("actor_rollout_ref.actor.ppo_mini_batch_size=6",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8")
    return lambda: validate_config(cfg, 2), ValueError, \
        "data.train_batch_size=16 must be a multiple of " \
        "actor_rollout_ref.actor.ppo_mini_batch_size=6"


def mini_batch_does_not_split_over_dp(tmp):
    cfg = _tiny("actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2")
    return lambda: validate_config(cfg, 8), ValueError, \
        "actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n = 2*3 sequences do not split " \
        "over data-parallel size 4 (= world / (tp 2 * pp 1))"


def model_dir_without_config(tmp):
    return lambda: load_decoder(tmp), FileNotFoundError, f"model directory {tmp} has no config.json"


def corrupt_safetensors(tmp):
    d = tmp / "m"
    shutil.copytree(STORIES, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    return lambda: load_decoder(d), ValueError, \
        f"corrupt safetensors file {d / 'model.safetensors'}: Error while deserializing " \
        f"header: invalid header length"


def unsupported_model_type(tmp):
    d = tmp / "m"
    shutil.copytree(STORIES, d)
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(conf, model_type="gpt2")))
    return lambda: read_model_config(d), ValueError, \
        f"model_type='gpt2' in {d} is not supported (supported: llama, qwen2, qwen3, mistral, " \
        f"gemma2, gemma3_text, qwen3_moe, mixtral)"


def tokenizer_missing(tmp):
    d = tmp / "m"
    shutil.copytree(STORIES, d, ignore=shutil.ignore_patterns("tokenizer*"))
    return lambda: load_tokenizer(d), FileNotFoundError, \
        f"model directory {d} has no tokenizer (none of tokenizer.json, tokenizer.model, " \
        f"vocab.json, tokenizer_config.json)"


def reward_function_raises(tmp):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 / len(solution_str)
    call = lambda: score_batch(["a dog", ""], ["keyword"] * 2, [["dog"]] * 2,   # noqa: E731
                               [{"index": 11}, {"index": 12}], fn=compute_score)
    return call, RewardError, "reward function failed on sample 1 (data_source='keyword', " \
        "extra_info.index=12): ZeroDivisionError: float division by zero"


def reward_not_finite(tmp):
    call = lambda: score_batch(["x"], ["keyword"], [["dog"]],      # noqa: E731
                               fn=lambda **kw: float("nan"))
    return call, RewardError, "reward for sample 0 (data_source='keyword') is nan"


def reward_file_missing(tmp):
    return lambda: load_custom_reward(tmp / "my_reward.py"), FileNotFoundError, \
        f"custom reward file not found: {tmp / 'my_reward.py'}"


def reward_function_name_missing(tmp):
    f = tmp / "my_reward.py"
    f.write_text("def compute_score(**kw):\n    return 0.0\n")
    from hybridengine.rl.rewards import build_reward, registered_rewards
    return lambda: build_reward(f, "score"), ValueError, \
        f"custom_reward_function.name='score': not a function in {f} nor a registered reward; " \
        f"known: {', '.join(registered_rewards())}"


def resume_path_missing(tmp):
    cfg = _tiny("trainer.resume_mode=resume_path")
    return lambda: validate_config(cfg, 2), ValueError, \
        "trainer.resume_mode=resume_path needs trainer.resume_from_path"


def world_differs_from_nnodes_times_gpus(tmp):
    cfg = _tiny("trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16")
    return lambda: validate_config(cfg, 8), ValueError, \
        "trainer.nnodes * trainer.n_gpus_per_node = 2*8 but the launcher started 8 processes"


def _setup(*overrides):
    """A config whose Trainer stops in its first checks (rl.preflight), before it loads or
    writes anything."""
    from hybridengine.rl.trainer import Trainer
    cfg = _tiny(f"actor_rollout_ref.model.path={STORIES}",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", *overrides)
    return lambda: Trainer(cfg)


def model_path_missing(tmp):
    return lambda: load_tokenizer(tmp / "nope"), FileNotFoundError, \
        f"model directory {tmp / 'nope'} does not exist"


def model_path_is_a_hub_id(tmp):
    hub = "Qwen/Qwen2.5-0.5B-Instruct"
    return _setup(f"actor_rollout_ref.model.path={hub}"), ValueError, \
        f"actor_rollout_ref.model.path: model directory {hub} does not exist (relative to " \
        f"{Path.cwd()}); if {hub} is a Hugging Face hub id: models are not downloaded here, " \
        f"download it first (huggingface-cli download {hub} --local-dir DIR) and give its local DIR"


def model_path_is_a_file(tmp):
    f = tmp / "model.safetensors"
    f.write_bytes(b"weights")
    return lambda: load_tokenizer(f), ValueError, f"model path {f} is a file, not a directory: " \
        f"give the directory that holds config.json and the *.safetensors files"


def broken_config_json(tmp):
    """A directory whose tokenizer is fine: the config is checked first, and named."""
    d = tmp / "m"
    shutil.copytree(STORIES, d)
    (d / "config.json").write_text('{"model_type": "llama",')
    return _setup(f"actor_rollout_ref.model.path={d}"), ValueError, \
        f"actor_rollout_ref.model.path: {d / 'config.json'} is not valid JSON: Expecting " \
        f"property name enclosed in double quotes: line 1 column 24 (char 23)"


def prompt_and_response_beyond_the_context(tmp):
    return _setup("data.max_prompt_length=480"), ValueError, \
        f"data.max_prompt_length + data.max_response_length = 480+48 exceeds the context of " \
        f"actor_rollout_ref.model.path={STORIES} (max_position_embeddings=512)"


def device_cuda_without_cuda(tmp):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    return _setup("trainer.device=cuda"), ValueError, \
        f"trainer.device=cuda but CUDA is not available (torch {torch.__version__} is built " \
        f"without CUDA); use trainer.device=auto or cpu"


def logger_wandb_not_installed(tmp):
    import importlib.util
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    return _setup("trainer.logger=[console,wandb]"), ValueError, \
        "trainer.logger=wandb needs the wandb package: pip install wandb (it logs offline " \
        "unless WANDB_MODE says otherwise), or log to tensorboard " \
        "(trainer.logger=[console,tensorboard])"


def logger_mlflow(tmp):
    return _setup("trainer.logger=[console,mlflow]"), ValueError, \
        "trainer.logger backend 'mlflow' is verl's but not supported here; use wandb or " \
        "tensorboard (known backends: console, jsonl, tensorboard, wandb)"


def grpo_with_greedy_sampling(tmp):
    return lambda: validate_config(_tiny("actor_rollout_ref.rollout.do_sample=false"), 2), \
        ValueError, "algorithm.adv_estimator=grpo with greedy sampling " \
        "(actor_rollout_ref.rollout.do_sample=false) and actor_rollout_ref.rollout.n=8: the 8 " \
        "responses of a prompt are identical, so every advantage is 0; sample " \
        "(actor_rollout_ref.rollout.do_sample=true, temperature > 0)"


def lora_target_unknown(tmp):
    cfg = _tiny("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[qkv]")
    return lambda: validate_config(cfg, 2), ValueError, \
        "actor_rollout_ref.model.target_modules=['qkv']: each one of q_proj, k_proj, v_proj, " \
        "o_proj, gate_proj, up_proj, down_proj, or all-linear"


def data_file_empty(tmp):
    f = tmp / "train.jsonl"
    f.write_text("")
    return lambda: load_rows(f), ValueError, f"{f} is empty: no rows"


def jsonl_not_utf8(tmp):
    f = tmp / "train.jsonl"
    f.write_bytes(json.dumps(_row()).encode() + b'\n{"prompt": "caf\xe9"}\n')
    return lambda: load_rows(f), ValueError, f"{f}:2: not UTF-8 text (byte 0xe9 at column 16)"


def yaml_syntax_error(tmp):
    f = tmp / "mine.yaml"
    f.write_text("data:\n  train_batch_size: 4\n  train_files: [a.jsonl\ntrainer:\n  seed: 1\n")
    return lambda: load_config(["--config", str(f)]), ValueError, \
        f"{f}: invalid YAML: line 4, column 8: did not find expected ',' or ']' (while parsing " \
        f"a flow sequence from line 3, column 16)"


def reward_file_syntax_error(tmp):
    f = tmp / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                 "    return float(solution_str.strip() == ground_truth\n")
    return lambda: load_custom_reward(f), ValueError, \
        f"custom reward file {f}:2: syntax error: '(' was never closed"


def output_dir_under_a_file(tmp):
    (tmp / "runs").write_text("not a directory")
    out = tmp / "runs" / "exp1"
    return lambda: claim_run_dir(out, "auto", False, False), RunDirError, \
        f"trainer.default_local_dir={out} cannot be used: Not a directory"


CATALOGUE = [
    parquet_missing_column, empty_prompt, ground_truth_missing, prompt_file_missing,
    jsonl_line_not_json, prompt_too_long_truncation_error, every_prompt_filtered,
    unknown_config_key, wrong_type_for_key, unknown_choice, tp_does_not_divide_heads,
    tp_does_not_divide_kv_heads, tp_pp_does_not_divide_world,
    rollout_tp_does_not_divide_actor_tp_pp, rollout_tp_over_actor_tp_with_pp,
    batch_not_multiple_of_mini_batch,
    mini_batch_does_not_split_over_dp, model_dir_without_config, corrupt_safetensors,
    unsupported_model_type, tokenizer_missing, reward_function_raises, reward_not_finite,
    reward_file_missing, reward_function_name_missing, resume_path_missing,
    world_differs_from_nnodes_times_gpus, model_path_missing, model_path_is_a_hub_id,
    model_path_is_a_file, broken_config_json, prompt_and_response_beyond_the_context,
    device_cuda_without_cuda, logger_wandb_not_installed, logger_mlflow,
    grpo_with_greedy_sampling, lora_target_unknown, data_file_empty, jsonl_not_utf8, yaml_syntax_error,
    reward_file_syntax_error, output_dir_under_a_file,
]


@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.__name__)
def test_catalogue(case, tmp_path):
    call, kind, message = case(tmp_path)
    with pytest.raises(kind) as info:
        call()
    text = info.value.args[0] if info.value.args else str(info.value)   # KeyError quotes str()
    assert text == message
    assert "\n" not in text


# ----------------------------------------------------------------------------- data behaviours

@pytest.mark.parametrize("mode", ["left", "right"])
def test_prompt_too_long_is_truncated_as_verl(tokenizer, mode):
    text = "Once upon a time there was a dog"
    full = PromptDataset([_row(text)], tokenizer, 64).prompt_ids[0]
    cut = PromptDataset([_row(text)], tokenizer, 4, truncation=mode).prompt_ids[0]
    assert len(full) > 4
    assert cut == (full[-4:] if mode == "left" else full[:4])


# ----------------------------------------------------------------------------- security

def test_weights_only_through_safetensors(tmp_path, monkeypatch):
    """A pickled checkpoint (pytorch_model.bin) is refused, never unpickled."""
    d = tmp_path / "m"
    shutil.copytree(STORIES, d, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(FileNotFoundError) as info:
        load_decoder(d)
    assert str(info.value) == f"model directory {d} has no *.safetensors files"


def test_tokenizer_code_runs_only_when_trusted(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(STORIES, d)
    marker = tmp_path / "ran"
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer",
         "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                               "from transformers import PreTrainedTokenizerFast\n"
                               "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    with pytest.raises(ValueError) as info:
        load_tokenizer(d)
    assert str(info.value).startswith(f"cannot load the tokenizer of {d}: The repository {d} "
                                      f"contains custom code which must be executed")
    assert not marker.exists()


def test_custom_reward_comes_only_from_the_named_file(tmp_path, monkeypatch):
    """A same-named module on sys.path is not what runs, and the file does not become an
    importable module for later imports."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "my_reward.py").write_text("def compute_score(**kw):\n    return -1.0\n")
    monkeypatch.syspath_prepend(str(shadow))
    named = tmp_path / "named" / "my_reward.py"
    named.parent.mkdir()
    named.write_text("def compute_score(**kw):\n    return 0.5\n")
    fn = load_custom_reward(named)
    assert fn(data_source="x", solution_str="", ground_truth="", extra_info=None) == 0.5
    assert "my_reward" not in sys.modules


# ----------------------------------------------------------------------------- the trainer

def _trainer(tmp_path, *overrides):
    """A one-process GRPO trainer on stories260k: 4 prompts x 2 samples, 2 updates per step."""
    from hybridengine.rl.trainer import Trainer
    cfg = _tiny(f"data.train_files={TRAIN}", "data.val_files=null",
                f"actor_rollout_ref.model.path={STORIES}",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.rollout.n=2", "data.max_response_length=8",
                "actor_rollout_ref.actor.use_kl_loss=false", "trainer.val_before_train=False",
                "trainer.logger=[]", f"trainer.default_local_dir={tmp_path}", *overrides)
    return Trainer(cfg)


def _poison_first_advantage(trainer):
    """A NaN in the advantage of sequence 0: the first mini-batch's loss is NaN."""
    compute = trainer._advantages

    def poisoned(batch):
        metrics = compute(batch)
        batch.tensors["advantages"][0, 0] = float("nan")
        return metrics
    trainer._advantages = poisoned


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.actor.engine.model.state_dict().items()}


def test_nan_loss_aborts_by_default(tmp_path):
    trainer = _trainer(tmp_path, "trainer.total_training_steps=1")
    _poison_first_advantage(trainer)
    with pytest.raises(NonFiniteUpdate) as info:
        trainer.fit()
    assert str(info.value) == (
        "step 1: non-finite actor update (actor/grad_norm=nan, actor/pg_loss=nan; 1 of 2 "
        "updates dropped); trainer.nan_policy=abort stops here (skip: drop and count them)")


def test_nan_loss_skip_drops_and_counts_the_update(tmp_path, capsys):
    trainer = _trainer(tmp_path, "trainer.total_training_steps=1", "trainer.nan_policy=skip")
    _poison_first_advantage(trainer)
    trainer.fit()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert row["training/nan_skipped_updates"] == 1
    assert trainer.actor.engine.optimizer.num_steps == 1      # the clean mini-batch applied
    assert all(torch.isfinite(p).all() for p in trainer.actor.engine.model.parameters())
    assert "warning: step 1: dropped 1 non-finite update(s) (trainer.nan_policy=skip)" in \
        capsys.readouterr().out


def _responses(lengths_of):
    """A stand-in generator result: response i has lengths_of(i) tokens."""
    from types import SimpleNamespace

    def generate(prompts, params):
        ids = [[5] * lengths_of(i) for i in range(len(prompts) * params.n)]
        return SimpleNamespace(response_ids=ids, logprobs=[[-1.0] * len(r) for r in ids],
                               num_generated_tokens=sum(map(len, ids)), seconds=0.01,
                               slots=None)
    return generate


def test_all_responses_empty_skips_the_update_and_says_so(tmp_path, capsys):
    trainer = _trainer(tmp_path)
    trainer.generator.generate = _responses(lambda i: 0)
    before = _weights(trainer)
    metrics = trainer.train_step(1, [0, 1, 2, 3], lambda: None)
    assert metrics["response_length/mean"] == 0.0 and "actor/pg_loss" not in metrics
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "warning: step 1: all 8 responses are empty; nothing to train on, update skipped" in \
        capsys.readouterr().out


def test_some_responses_empty_train_on_the_rest(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.generator.generate = _responses(lambda i: 0 if i % 2 else 3)
    metrics = trainer.train_step(1, [0, 1, 2, 3], lambda: None)
    assert metrics["response_length/min"] == 0 and metrics["response_length/mean"] == 1.5
    assert trainer.actor.engine.optimizer.num_steps == 2
    assert all(v == v for v in metrics.values())                # no NaN anywhere


def test_a_rollout_in_waves_is_logged_and_said_once(tmp_path, capsys):
    """8 sequences a step (4 prompts x 2) on max_num_seqs=3 slots: 3 run at once and one
    warning line says why, not repeated by the next step that says the same; on tiny.yaml's
    128 slots all 8 run at once, no warning."""
    waves = _trainer(tmp_path / "waves", "actor_rollout_ref.rollout.max_num_seqs=3")
    m = waves.train_step(1, [0, 1, 2, 3], lambda: None)
    assert (m["rollout/num_slots"], m["rollout/max_concurrent"]) == (3, 3)
    out = capsys.readouterr().out
    assert out.count("warning:") == 1
    assert ("warning: step 1: the rollout ran in waves: a generation replica got 8 sequences but "
            "its KV cache holds 3 (rollout/num_slots): at most 3 ran at once, 5 waited for a free "
            "slot; actor_rollout_ref.rollout.max_num_seqs=3 caps the slots\n") in out
    m = waves.train_step(2, [4, 5, 6, 7], lambda: None)
    assert m["rollout/max_concurrent"] == 3 and "warning" not in capsys.readouterr().out
    fits = _trainer(tmp_path / "fits")
    m = fits.train_step(1, [0, 1, 2, 3], lambda: None)
    assert (m["rollout/num_slots"], m["rollout/max_concurrent"]) == (128, 8)
    assert "warning" not in capsys.readouterr().out


def test_disk_full_on_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=1")
    real_save = ckpt.save_file

    def disk_full_at_step_2(tensors, filename, metadata=None):
        if "global_step_2" in filename:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, filename, metadata=metadata)
    monkeypatch.setattr(ckpt, "save_file", disk_full_at_step_2)
    with pytest.raises(SaveError) as info:
        trainer.fit()
    assert str(info.value) == (f"saving checkpoint global_step_2 under {tmp_path} failed: No "
                               f"space left on device; global_step_1 is the latest, intact")
    assert ckpt.find_latest(tmp_path) == 1
    monkeypatch.undo()
    resumed = _trainer(tmp_path, "trainer.total_training_steps=2")
    assert resumed.resume() == 1
    load_decoder(tmp_path / "global_step_1" / "actor")         # a complete HF directory


def test_resume_from_a_checkpoint_of_another_model_shape(tmp_path):
    _trainer(tmp_path / "run").save(1)
    from transformers import LlamaConfig, LlamaForCausalLM
    other = tmp_path / "other"
    conf = LlamaConfig.from_pretrained(str(STORIES))
    conf.intermediate_size = 128
    LlamaForCausalLM(conf).save_pretrained(str(other))
    for f in STORIES.glob("tokenizer*"):
        shutil.copy(f, other / f.name)
    trainer = _trainer(tmp_path / "run", f"actor_rollout_ref.model.path={other}")
    with pytest.raises(ValueError) as info:
        trainer.resume()
    assert str(info.value) == (
        f"cannot resume actor from {tmp_path / 'run'}: optimizer checkpoint does not match the "
        f"model: layers.4.mlp.down_proj.weight [64, 172] (bucket 0, offset 64) in the "
        f"checkpoint, layers.4.mlp.down_proj.weight [64, 128] (bucket 0, offset 64) now")


@pytest.mark.parametrize("damage", ["safetensors", "json"])
def test_truncated_checkpoint_state_names_the_file_and_the_previous_checkpoint(tmp_path, damage):
    first = _trainer(tmp_path)
    first.save(1)
    first.save(2)
    first.run_lock.release()
    state = tmp_path / "global_step_2" / "state" / f"rank_00000.{damage}"
    state.write_bytes(state.read_bytes()[:100])                     # a save cut short
    with pytest.raises(ValueError) as info:
        _trainer(tmp_path).resume()
    text = str(info.value)
    assert text.startswith(f"corrupt checkpoint file {state}: ") and "\n" not in text
    assert text.endswith(f"; resume from the previous one with trainer.resume_mode=resume_path "
                         f"trainer.resume_from_path={tmp_path / 'global_step_1'}")


def test_an_output_directory_on_a_read_only_filesystem_is_one_line(tmp_path, monkeypatch):
    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(RunDirError) as info:
        claim_run_dir(tmp_path / "out", "auto", False, False)
    assert str(info.value) == (f"trainer.default_local_dir={tmp_path / 'out'} cannot be used: "
                               f"Read-only file system")


def test_more_steps_than_the_data_gives_says_so_when_it_stops(tmp_path, capsys):
    """8 prompts / batch 4 x 1 epoch = 2 steps of the 3 asked; and perf/mfu stays <= 1."""
    data = _jsonl(tmp_path / "train.jsonl", [_row(index=i) for i in range(8)])
    trainer = _trainer(tmp_path / "run", f"data.train_files={data}", "trainer.total_epochs=1",
                       "trainer.total_training_steps=3")
    trainer.fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert "warning: stopped after step 2 of trainer.total_training_steps=3: the data gives 2 " \
        "batches (8 prompts // data.gen_batch_size=4 = 2 per epoch x trainer.total_epochs=1)" \
        in capsys.readouterr().out
    mfu = [v for r in rows for k, v in r.items() if k.startswith("perf/mfu")]
    assert mfu and all(0 < v <= 1 for v in mfu)


# ----------------------------------------------------------------------------- the command line

def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "TORCHELASTIC",
                                "HYBRIDENGINE_TRACEBACK"))}
    env.update(HYBRIDENGINE_NO_PROGRESS="1", OMP_NUM_THREADS="1", **extra)
    return env


TRACEBACK_VALUES = [("0", False), ("1", True), ("YES", True)]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The launch/ppo.py runs of the command-line tests below (Ctrl-C's too), started at once, two
    at a time (proc_utils: each is one thread); cli.result(name) waits for one. The missing
    reward file (cli.missing_reward) and the Ctrl-C run's output (cli.ctrl_c_dir) sit in folders
    of their own."""
    from proc_utils import Launches
    missing = tmp_path_factory.mktemp("cli_missing_reward") / "reward.py"
    runs = {
        "bad_config": (["trainer.total_trainig_steps=2"], {}),
        "missing_reward": (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                            f"custom_reward_function.path={missing}"], {}),
        "every_error": (["trainer.total_trainig_steps=2", "data.train_batch_size=x", "nonsense",
                         f"actor_rollout_ref.model.path={STORIES}"], {}),
        **{f"traceback_{value}": (["trainer.total_trainig_steps=2"],
                                  {"HYBRIDENGINE_TRACEBACK": value})
           for value, _ in TRACEBACK_VALUES},
        "layers_model_path": ([f"actor_rollout_ref.model.path={STORIES}",
                               "data.train_batch_size=4"], {}),
        "layers_with_errors": (["--config", str(ROOT / "configs" / "grpo.yaml"),
                                "trainer.total_trainig_steps=1"], {}),
    }
    launches = Launches()
    # the longest first (balances the two at a time): test_ctrl_c_names_the_latest_checkpoint_
    # exit_130's run, then a run that gets as far as the data
    launches.ctrl_c_dir = tmp_path_factory.mktemp("cli_ctrl_c")
    launches.call("ctrl_c", _ctrl_c_run, launches.ctrl_c_dir)
    for name, (args, env) in sorted(runs.items(), key=lambda kv: kv[0] != "layers_model_path"):
        launches.start(name, [sys.executable, str(ROOT / "launch" / "ppo.py"), *args], cwd=ROOT,
                       env=_env(**env), timeout=120)
    launches.missing_reward = missing
    yield launches
    launches.close()


def test_cli_bad_config_is_one_line_exit_2(cli):
    proc = cli.result("bad_config")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: unknown config key 'trainer.total_trainig_steps' (nearest known key: "
        "'trainer.total_training_steps')"]


def test_cli_missing_reward_file_is_one_line_exit_2(cli):
    proc = cli.result("missing_reward")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == \
        f"error: custom reward file not found: {cli.missing_reward}"
    assert "Traceback" not in proc.stderr


def test_cli_says_every_config_error_at_once(cli):
    proc = cli.result("every_error")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: argument 'nonsense' is not a key=value override",
        "error: unknown config key 'trainer.total_trainig_steps' (nearest known key: "
        "'trainer.total_training_steps')",
        "error: data.train_batch_size='x': expected an integer, got str"]


@pytest.mark.parametrize("value, shown", TRACEBACK_VALUES)
def test_cli_traceback_only_when_asked(cli, value, shown):
    proc = cli.result(f"traceback_{value}")
    assert proc.returncode == 2
    assert ("Traceback (most recent call last)" in proc.stderr) == shown
    assert proc.stderr.splitlines()[-1].startswith("error: unknown config key")


def test_cli_says_which_config_layers_are_in_force(cli):
    """A model path alone leaves the default job: the first line says what is in force."""
    proc = cli.result("layers_model_path")
    assert proc.stdout.splitlines()[0] == (
        "config: defaults (configs/ppo_trainer.yaml) + 2 command-line overrides (not the default "
        "job: configs/tiny.yaml applies only without --config and model path)")
    proc = cli.result("layers_with_errors")
    assert proc.returncode == 2 and proc.stdout == ""   # an argv with errors says only those


def _ctrl_c_run(out_dir):
    """launch/ppo.py interrupted (SIGINT) once its first checkpoint is there: (its exit code,
    stderr)."""
    import signal
    import time
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "ppo.py"),
         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "trainer.save_freq=1",
         "trainer.val_before_train=False", "trainer.test_freq=-1", "data.max_response_length=8",
         f"trainer.default_local_dir={out_dir}"], cwd=ROOT, env=_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pointer = out_dir / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 120
    while not pointer.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_ctrl_c_names_the_latest_checkpoint_exit_130(cli):
    """The run: _ctrl_c_run, in the cli fixture's pool."""
    returncode, err = cli.result("ctrl_c")
    tmp_path = cli.ctrl_c_dir
    assert returncode == 130, err[-3000:]
    step = (tmp_path / "latest_checkpointed_iteration.txt").read_text()
    assert err.splitlines() == [f"interrupted; latest checkpoint global_step_{step} in {tmp_path} "
                                f"(trainer.resume_mode=auto resumes from it)"]


def test_the_error_line_is_recorded_for_torchruns_summary(tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from hybridengine.rl.guards import report_failure
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert report_failure("first problem\nsecond problem", 2, rank=0)
    assert capsys.readouterr().err == "error: first problem\nerror: second problem\n"
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2,
                             error_file=str(tmp_path / "error.json"))
    summary = str(ChildFailedError("launch/ppo.py", {0: failure}))
    assert "traceback : first problem\n  second problem" in summary and "exitcode  : 2" in summary


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["config", "reward"])
def test_torchrun_two_ranks_say_an_error_once(tmp_path, case):
    """At 2 ranks: the line once (a config error before the group exists, a reward file error
    after), torchrun's exit code 1 with the worker's 2 and message in its summary, and no
    traceback of ours (torchrun's own traceback of its ChildFailedError remains)."""
    from dist_utils import free_port
    args = ["trainer.total_trainig_steps=2"] if case == "config" else \
        [f"custom_reward_function.path={tmp_path / 'reward.py'}", "trainer.total_training_steps=1",
         f"trainer.default_local_dir={tmp_path / 'out'}"]
    message = "unknown config key 'trainer.total_trainig_steps' (nearest known key: " \
        "'trainer.total_training_steps')" if case == "config" else \
        f"custom reward file not found: {tmp_path / 'reward.py'}"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-backend=c10d",
         str(ROOT / "launch" / "ppo.py"), *args],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1                                   # torchrun's, for any failure
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")] == \
        [f"error: {message}"], proc.stderr[-3000:]
    assert re.search(r"exitcode\s*: 2 ", proc.stderr)                # the worker's own code
    assert f"traceback : {message}" in proc.stderr                  # in torchrun's summary
    frames = [ln for ln in proc.stderr.splitlines() if ln.lstrip().startswith('File "')]
    assert not [f for f in frames if "hybridengine" in f or "launch/ppo.py" in f], frames


def _say_every_case(rank, world, tmp, out):
    """Each catalogue case raised on both ranks and handed to launch/ppo.py's failure path."""
    import contextlib
    import importlib.util
    import io
    import torch.distributed as dist
    spec = importlib.util.spec_from_file_location("launch_ppo", ROOT / "launch" / "ppo.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    said = {}
    for case in CATALOGUE:
        base = Path(tmp) / case.__name__
        for turn in range(world):   # the same (deterministic) files, built by one rank at a time
            if turn == rank:
                shutil.rmtree(base, ignore_errors=True)
                base.mkdir()
                call, _, message = case(base)
            dist.barrier()
        buf, code = io.StringIO(), None
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the case's error, as launch sees it
            with contextlib.redirect_stderr(buf):
                try:
                    launch._fail(e, rank, None)
                except SystemExit as stop:
                    code = stop.code
        said[case.__name__] = (message, buf.getvalue(), code)
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(said))


@pytest.mark.multiproc
def test_every_catalogue_error_is_said_once_at_two_ranks_with_exit_2(tmp_path):
    from dist_utils import run_dist
    (tmp_path / "cases").mkdir()
    run_dist(_say_every_case, 2, str(tmp_path / "cases"), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ranks[0]:
        message = ranks[0][name][0]
        printed = [r[name][1] for r in ranks if r[name][1]]
        assert printed == [f"error: {message}\n"], (name, printed)     # once, one line
        assert [r[name][2] for r in ranks] == [2, 2], name              # bad input on every rank
