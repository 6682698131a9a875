"""Prompt rows (verl schema), PromptDataset tokenization/truncation, ResumableSampler, and the
tools/data/gsm8k.py converter.

References: hand-written verl rows; the Qwen2 chat template written out by hand; raw
sentencepiece for the stories260k tokenizer; torch.randperm for the sampler order.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
from transformers import AutoTokenizer

from hybridengine.rl.data import (
    GSM8K_INSTRUCTION, PromptDataset, ResumableSampler, load_rows, to_verl_row)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
GSM8K_SAMPLE = FIXTURES / "gsm8k_sample.jsonl"
STORIES = FIXTURES.parent.parent / "models" / "stories260k"
QWEN = Path("/work/shared/models/qwen2-tokenizer")
RAW = [json.loads(line) for line in GSM8K_SAMPLE.open()]


@pytest.fixture(scope="module")
def stories_tok():
    return AutoTokenizer.from_pretrained(STORIES)


@pytest.fixture(scope="module")
def qwen_tok():
    if not QWEN.exists():
        pytest.skip("qwen2 tokenizer not present")
    return AutoTokenizer.from_pretrained(QWEN)


def _row(content, truth="1", source="keyword", index=0):
    return {"data_source": source, "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": index}}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- rows

def test_to_verl_row_matches_verl_schema():
    q, a = RAW[10]["question"], RAW[10]["answer"]  # "#### 1,080"
    assert to_verl_row(q, a, "train", 10) == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": q + " Let's think step by step and output the "
                                                   "final answer after \"####\"."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1080"},
        "extra_info": {"split": "train", "index": 10, "answer": a, "question": q},
    }
    with pytest.raises(ValueError, match="example 3.*####"):
        to_verl_row("q", "no final line", "test", 3)


def test_load_rows_raw_gsm8k_jsonl_and_file_lists(tmp_path):
    rows = load_rows(GSM8K_SAMPLE)
    assert [r["reward_model"]["ground_truth"] for r in rows][-7:] == \
        ["1080", "850000", "2250", "10000", "-7", "-47", "-12"]
    assert rows[3] == to_verl_row(RAW[3]["question"], RAW[3]["answer"], "gsm8k_sample", 3)
    verl_file = _write_jsonl(tmp_path / "mine.jsonl", [_row("say cat", ["cat"])])
    parquet_file = tmp_path / "mine.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:2]), parquet_file)
    both = load_rows([verl_file, str(parquet_file)])
    assert both == [_row("say cat", ["cat"])] + rows[:2]  # order kept, nested types round-trip


def test_load_rows_errors(tmp_path):
    no_prompt = tmp_path / "no_prompt.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "keyword", "text": "hi"}]), no_prompt)
    with pytest.raises(ValueError, match=r"no_prompt.parquet: missing column 'prompt'"):
        load_rows(no_prompt)
    no_truth = _row("hi")
    del no_truth["reward_model"]["ground_truth"]
    with pytest.raises(ValueError, match=r"bad.jsonl row 1: missing reward_model.ground_truth"):
        load_rows(_write_jsonl(tmp_path / "bad.jsonl", [_row("ok"), no_truth]))
    with pytest.raises(ValueError, match=r"empty.jsonl row 2: empty prompt"):
        load_rows(_write_jsonl(tmp_path / "empty.jsonl", [_row("a"), _row("b"), _row("  ")]))
    with pytest.raises(ValueError, match=r"row 0: missing field 'prompt'"):
        load_rows(_write_jsonl(tmp_path / "other.jsonl", [{"text": "hi"}]))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: invalid JSON"):
        load_rows(tmp_path / "broken.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        load_rows(tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match=r"unsupported prompt file type '.csv'"):
        (tmp_path / "x.csv").write_text("a\n")
        load_rows(tmp_path / "x.csv")


def test_reward_fn_key_names_the_column_that_selects_the_reward(tmp_path, stories_tok):
    """data.reward_fn_key (verl's): the column whose string selects a row's rule reward (the
    items' data_source, which the scoring reads); data_source by default. The validation
    metrics group by the data_source column whatever the key (metrics_source, as verl's
    trainer). A row without that column: one line naming the key."""
    rows = [{**_row("say cat", ["cat"]), "ability": "keyword"} for _ in range(2)]
    for row in rows:
        row["data_source"] = "openai/gsm8k"
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    by_ability = PromptDataset(load_rows(path, reward_fn_key="ability"), stories_tok,
                               max_prompt_length=64, reward_fn_key="ability")
    assert [by_ability[i]["data_source"] for i in range(2)] == ["keyword", "keyword"]
    assert [by_ability[i]["metrics_source"] for i in range(2)] == ["openai/gsm8k"] * 2
    default = PromptDataset(load_rows(path), stories_tok, max_prompt_length=64)
    assert default[0]["data_source"] == default[0]["metrics_source"] == "openai/gsm8k"
    no_source = [{k: v for k, v in row.items() if k != "data_source"} for row in rows]
    assert PromptDataset(no_source, stories_tok, max_prompt_length=64,
                         reward_fn_key="ability")[0]["metrics_source"] == "unknown"
    with pytest.raises(ValueError, match=r"rows.jsonl row 0: missing 'task' \(data.reward_fn_key\)"):
        load_rows(path, reward_fn_key="task")


# ----------------------------------------------------------------------------- dataset

def test_chat_template_prompt(qwen_tok):
    rows = load_rows(GSM8K_SAMPLE)[:3]
    ds = PromptDataset(rows, qwen_tok, max_prompt_length=512)
    question = RAW[0]["question"] + " " + GSM8K_INSTRUCTION
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    item = ds[0]
    assert qwen_tok.decode(item["prompt_ids"]) == expected
    assert item["prompt_ids"][:3] == [151644, 8948, 198]  # <|im_start|> system \n
    assert (item["data_source"], item["ground_truth"], item["index"]) == ("openai/gsm8k", "72", 0)
    assert item["extra_info"]["answer"] == RAW[0]["answer"]


def test_plain_lm_prompt_has_bos_and_joined_text(stories_tok):
    sp = spm.SentencePieceProcessor(model_file=str(STORIES / "tokenizer.model"))
    row = _row("Once upon a time")
    row["prompt"].insert(0, {"role": "system", "content": "Be brief."})
    ds = PromptDataset([row, _row("The end", index=7)], stories_tok, max_prompt_length=64)
    assert ds[0]["prompt_ids"] == [sp.bos_id()] + sp.encode("Be brief.\nOnce upon a time")
    assert ds[1]["prompt_ids"] == [1, 291, 344, 264]  # <s> ▁The ▁e nd
    assert ds[1]["index"] == 7
    with pytest.raises(ValueError, match="no chat template"):
        PromptDataset([row], stories_tok, 64, apply_chat_template=True)


@pytest.mark.parametrize("mode, expected", [
    ("left", [378, 426, 291, 344, 264]),     # keep the tail
    ("right", [1, 403, 407, 261, 378]),      # keep the head
    ("middle", [1, 403, 291, 344, 264]),     # head 2 + tail 3
])
def test_truncation(stories_tok, mode, expected):
    # "<s>Once upon a time. The end" = [1, 403, 407, 261, 378, 426, 291, 344, 264]: 9 tokens
    ds = PromptDataset([_row("Once upon a time. The end")], stories_tok, 5, truncation=mode)
    assert ds[0]["prompt_ids"] == expected


def test_overlong_error_and_filter(stories_tok):
    rows = [_row("The end"), _row("Once upon a time. The end"), _row("Once")]
    with pytest.raises(ValueError, match=r"prompt row 1 has 9 tokens > max_prompt_length=5"):
        PromptDataset(rows, stories_tok, 5, truncation="error")
    ds = PromptDataset(rows, stories_tok, 5, filter_overlong_prompts=True)
    assert (len(ds), ds.num_filtered) == (2, 1)
    assert [len(ds[i]["prompt_ids"]) for i in range(2)] == [4, 2]
    with pytest.raises(ValueError, match="no prompts left"):
        PromptDataset(rows, stories_tok, 1, filter_overlong_prompts=True)
    with pytest.raises(ValueError, match="data.truncation must be one of"):
        PromptDataset(rows, stories_tok, 5, truncation="cut")


# ----------------------------------------------------------------------------- sampler

def test_sampler_order_is_seeded_permutation():
    import torch
    sampler = ResumableSampler(10, batch_size=3, total_epochs=2, seed=5)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 6  # drop_last: 3 batches per epoch
    for epoch in range(2):
        order = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        assert batches[3 * epoch:3 * epoch + 3] == [order[0:3], order[3:6], order[6:9]]
    assert batches[:3] != batches[3:]
    assert sampler.state_dict() == {"epoch": 2, "position": 0}
    assert list(sampler) == []  # exhausted


@pytest.mark.parametrize("num_taken", [0, 1, 3, 4, 7, 9])
def test_sampler_resume_matches_uninterrupted(num_taken):
    reference = list(ResumableSampler(11, batch_size=4, total_epochs=3, seed=1, drop_last=False))
    first = ResumableSampler(11, batch_size=4, total_epochs=3, seed=1, drop_last=False)
    taken = [batch for _, batch in zip(range(num_taken), first)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = ResumableSampler(11, batch_size=4, total_epochs=3, seed=1, drop_last=False)
    resumed.load_state_dict(state)
    assert taken + list(resumed) == reference
    assert [len(b) for b in reference[:3]] == [4, 4, 3]  # drop_last=False keeps the remainder


def test_sampler_errors():
    with pytest.raises(ValueError, match="make no batch of data.gen_batch_size=8"):
        ResumableSampler(5, batch_size=8)
    sampler = ResumableSampler(8, batch_size=4, total_epochs=2)
    with pytest.raises(ValueError, match="outside 2 epochs of 2 batches"):
        sampler.load_state_dict({"epoch": 0, "position": 3})


# ----------------------------------------------------------------------------- tool

def test_gsm8k_tool_writes_verl_parquet(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    lines = GSM8K_SAMPLE.read_text().splitlines(keepends=True)
    (src / "train.jsonl").write_text("".join(lines[:6]))
    (src / "test.jsonl").write_text("".join(lines[10:12]))
    out = tmp_path / "out"
    # cwd outside the repo: the script must find hybridengine on its own.
    result = subprocess.run(
        [sys.executable, str(REPO / "tools/data/gsm8k.py"), "--input_dir", str(src),
         "--local_dir", str(out), "--limit", "4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out / 'train.parquet'} (4 rows" in result.stdout
    assert f"wrote {out / 'test.parquet'} (2 rows" in result.stdout
    train = pq.read_table(out / "train.parquet")
    assert train.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert train.schema.field("prompt").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert train.to_pylist() == [to_verl_row(r["question"], r["answer"], "train", i)
                                 for i, r in enumerate(RAW[:4])]
    test_rows = load_rows(out / "test.parquet")
    assert [r["reward_model"]["ground_truth"] for r in test_rows] == ["1080", "850000"]
    assert [r["extra_info"]["split"] for r in test_rows] == ["test", "test"]



def test_gsm8k_tool_errors(tmp_path):
    spec = importlib.util.spec_from_file_location("gsm8k_tool", REPO / "tools/data/gsm8k.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "a\\n#### 3"}\n')
    with pytest.raises(SystemExit, match=r"error: GSM8K file not found: .*test.jsonl$"):
        tool.main(["--input_dir", str(tmp_path), "--local_dir", str(tmp_path / "out")])
    (tmp_path / "test.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(SystemExit, match=r"test.jsonl:1: not a GSM8K .*KeyError"):
        tool.main(["--input_dir", str(tmp_path), "--local_dir", str(tmp_path / "out")])


def test_dapo_rounds_take_gen_batch_size_prompts():
    """data.gen_batch_size is the prompts a generation round takes (verl's train dataloader's
    batch size), train_batch_size the groups a step trains on: DAPO's dynamic sampling
    over-samples with gen_batch_size > train_batch_size. The sampler, the steps an epoch gives,
    the memory plan's sequences per replica and the start header follow it."""
    from types import SimpleNamespace
    from hybridengine.config import load_config, validate_config
    from hybridengine.rl.data import load_tokenizer
    from hybridengine.rl.memory import replica_sequences
    from hybridengine.rl.trainer import Trainer
    root = Path(__file__).resolve().parent.parent
    cfg = load_config(["--config", str(root / "configs" / "tiny.yaml"), "--config",
                       str(root / "configs" / "dapo.yaml"), "data.gen_batch_size=32",
                       "reward_model.overlong_buffer.len=16",
                       f"actor_rollout_ref.model.path={root / 'models' / 'stories260k'}",
                       f"data.train_files={root / 'data' / 'stories_keywords' / 'train.jsonl'}",
                       f"data.val_files={root / 'data' / 'stories_keywords' / 'val.jsonl'}"])
    layout = validate_config(cfg, 2)
    trainer = SimpleNamespace(cfg=cfg, tokenizer=load_tokenizer(cfg.actor_rollout_ref.model.path))
    Trainer._build_data(trainer)
    assert cfg.data.train_batch_size == 16 and trainer.sampler.batch_size == 32
    assert len(next(iter(trainer.sampler))) == 32
    assert trainer.sampler.num_batches_per_epoch == len(trainer.train_ds) // 32
    assert replica_sequences(cfg, layout) == 32 * 8 // 2       # 2 generation replicas
    cfg.data.reward_fn_key = "task"     # the trainer reads the reward's column by that key
    with pytest.raises(ValueError, match=r"row 0: missing 'task' \(data.reward_fn_key\)"):
        Trainer._build_data(trainer)
