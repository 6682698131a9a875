"""Prompt datasets in verl's row schema, tokenized once, and a resumable batch sampler.

A row (one prompt) is a dict in verl's schema::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

``load_rows`` reads such rows from .parquet or .jsonl files (raw GSM8K ``{question, answer}``
jsonl rows are converted on the way in) and validates them. ``PromptDataset`` renders each
prompt (chat template when the tokenizer has one, else the plain text after BOS), tokenizes it,
and applies verl's ``data.truncation`` / ``data.filter_overlong_prompts``. ``ResumableSampler``
yields the batches of index lists; its ``state_dict`` resumes mid-epoch on the same batches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from hybridengine.models.hf import check_model_dir
from hybridengine.rl.rewards import extract_gsm8k_answer

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TRUNCATION_MODES = ("error", "left", "right", "middle")
# verl's default data.reward_fn_key: the column whose string selects a row's rule reward
REWARD_FN_KEY = "data_source"


def to_verl_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One raw GSM8K example as a verl row; the ground truth is the number after ``####``."""
    ground_truth = extract_gsm8k_answer(answer, "strict")
    if ground_truth is None:
        raise ValueError(f"GSM8K {split} example {index}: answer has no '#### <number>'")
    return {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


# ----------------------------------------------------------------------------- loading

def convert_jsonl(src: Path, dst: Path, make_row, fields: tuple[str, ...], what: str,
                  limit: int | None = None) -> int:
    """Write the verl-row parquet ``dst`` from a raw jsonl ``src`` (the tools/data converters):
    ``make_row(*[example[f] for f in fields], index)`` per non-empty line, the first ``limit``.
    Returns the number of rows; a bad line is one error naming the file and line."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = []
    with Path(src).open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                example = json.loads(line)
                rows.append(make_row(*[example[k] for k in fields], len(rows)))
            except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
                raise ValueError(f"{src}:{line_no}: not a {what} {{{', '.join(fields)}}} line "
                                 f"({type(e).__name__}: {e})") from None
    pq.write_table(pa.Table.from_pylist(rows), dst)
    return len(rows)


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    rows = []
    with file.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{file}:{line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at "
                                 f"column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{line_no}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{file}:{line_no}: expected a JSON object, "
                                 f"got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_file(file: Path, prompt_key: str) -> list[dict[str, Any]]:
    if not file.is_file():
        raise FileNotFoundError(f"prompt file not found: {file}")
    if file.suffix == ".parquet":
        table = pq.read_table(file)
        if prompt_key not in table.column_names:
            raise ValueError(f"{file}: missing column {prompt_key!r} "
                             f"(columns: {table.column_names})")
        # to_pylist keeps nested lists/structs as Python lists/dicts (no numpy object arrays).
        return table.to_pylist()
    if file.suffix == ".jsonl":
        rows = _read_jsonl(file)
        for i, row in enumerate(rows):
            # Raw GSM8K lines ({question, answer}) become verl rows; the file stem names the split.
            if prompt_key not in row and {"question", "answer"} <= row.keys():
                try:
                    rows[i] = to_verl_row(row["question"], row["answer"], file.stem, i)
                except ValueError as e:
                    raise ValueError(f"{file} row {i}: {e}") from None
        return rows
    raise ValueError(f"{file}: unsupported prompt file type {file.suffix!r} (.parquet or .jsonl)")


def _validate_row(row: dict[str, Any], prompt_key: str, where: str,
                  reward_fn_key: str = REWARD_FN_KEY) -> None:
    if prompt_key not in row:
        raise ValueError(f"{where}: missing field {prompt_key!r}")
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: empty prompt")
    elif isinstance(prompt, list):
        if not prompt or not any(str(m.get("content") or "").strip() for m in prompt
                                 if isinstance(m, dict)):
            raise ValueError(f"{where}: empty prompt")
        for m in prompt:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: each prompt message needs string 'role' and "
                                 f"'content', got {m!r}")
    else:
        raise ValueError(f"{where}: {prompt_key!r} must be a list of messages or a string, "
                         f"got {type(prompt).__name__}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ValueError(f"{where}: missing reward_model.ground_truth")
    if not isinstance(row.get(reward_fn_key), str):
        key = "" if reward_fn_key == REWARD_FN_KEY else " (data.reward_fn_key)"
        raise ValueError(f"{where}: missing {reward_fn_key!r}{key}")


def load_rows(paths: str | Path | Sequence[str | Path], prompt_key: str = "prompt",
              reward_fn_key: str = REWARD_FN_KEY) -> list[dict[str, Any]]:
    """Rows of one or more .parquet / .jsonl files, concatenated in order and validated (each
    with a string in its reward_fn_key column: what selects its rule reward)."""
    files = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not files:
        raise ValueError("no prompt files given")
    all_rows: list[dict[str, Any]] = []
    for file in map(Path, files):
        rows = _read_file(file, prompt_key)
        if not rows:
            raise ValueError(f"{file} is empty: no rows")
        for i, row in enumerate(rows):
            _validate_row(row, prompt_key, f"{file} row {i}", reward_fn_key)
        all_rows.extend(rows)
    return all_rows


# ----------------------------------------------------------------------------- tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of an HF model directory. Code shipped with the model (auto_map) runs only
    with trust_remote_code=True; without it such a tokenizer is refused, not executed."""
    path = check_model_dir(model_dir)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"model directory {path} has no tokenizer "
                                f"(none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many types; one line for users
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load the tokenizer of {path}: {first}") from e


# ----------------------------------------------------------------------------- dataset

def _messages(prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _truncate(ids: list[int], max_len: int, mode: str) -> list[int]:
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    # middle: keep the head and the tail, drop the centre.
    num_head = max_len // 2
    return ids[:num_head] + ids[len(ids) - (max_len - num_head):]


class PromptDataset:
    """Tokenized prompts; item i is ``{"prompt_ids", "data_source", "metrics_source",
    "ground_truth", "extra_info", "index", "messages"}``, its data_source the row's reward_fn_key
    column (verl's data.reward_fn_key: what selects the rule reward; the data_source column by
    default), its metrics_source the row's data_source column ("unknown" without one), which
    groups the validation scores whatever reward_fn_key says, as verl's trainer groups them.

    apply_chat_template: None uses the tokenizer's template when it has one; without a template
    the message contents are joined by newlines and BOS (if any) is prepended.
    """

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Any, max_prompt_length: int,
                 truncation: str = "error", filter_overlong_prompts: bool = False,
                 prompt_key: str = "prompt", apply_chat_template: bool | None = None,
                 reward_fn_key: str = REWARD_FN_KEY):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, "
                             f"got {truncation!r}")
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if apply_chat_template and not has_template:
            raise ValueError("apply_chat_template=True but the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.prompt_key, self.reward_fn_key = prompt_key, reward_fn_key
        self.use_chat_template = (has_template if apply_chat_template is None
                                  else apply_chat_template)
        self.rows: list[dict[str, Any]] = []
        self.prompt_ids: list[list[int]] = []
        self.num_filtered = 0
        for position, row in enumerate(rows):
            ids = self.encode(_messages(row[prompt_key]))
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                ids = self._fit(ids, position)
            self.rows.append(row)
            self.prompt_ids.append(ids)
        if not self.rows:
            raise ValueError(f"no prompts left: all {self.num_filtered} are longer than "
                             f"max_prompt_length={max_prompt_length}")

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt, ready for generation (generation prompt / BOS included)."""
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
            # The rendered template already holds its special tokens.
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        text = "\n".join(m["content"] for m in messages)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return ids if bos is None else [bos] + ids

    def _fit(self, ids: list[int], position: int) -> list[int]:
        if self.truncation == "error":
            raise ValueError(f"prompt row {position} has {len(ids)} tokens > "
                             f"max_prompt_length={self.max_prompt_length} "
                             f"(set data.truncation or data.filter_overlong_prompts=True)")
        return _truncate(ids, self.max_prompt_length, self.truncation)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.rows[i]
        extra_info = row.get("extra_info") or {}
        return {
            "prompt_ids": self.prompt_ids[i],
            "data_source": row[self.reward_fn_key],
            "metrics_source": row.get(REWARD_FN_KEY, "unknown"),
            "ground_truth": row["reward_model"]["ground_truth"],
            "extra_info": extra_info,
            "index": extra_info.get("index", i),
            "messages": _messages(row[self.prompt_key]),
        }


# ----------------------------------------------------------------------------- sampler

class ResumableSampler:
    """Batches of dataset indices, shuffled per epoch with ``torch.Generator(seed + epoch)``.

    ``state_dict()`` counts the batches handed out, so a checkpoint taken after training on a
    batch resumes at the next one; a resumed sampler yields exactly the remaining batches.
    """

    def __init__(self, num_samples: int, batch_size: int, total_epochs: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True):
        if batch_size < 1 or total_epochs < 1:
            raise ValueError(f"batch_size and total_epochs must be >= 1, got {batch_size}, "
                             f"{total_epochs}")
        num_batches = num_samples // batch_size if drop_last else -(-num_samples // batch_size)
        if num_batches == 0:
            raise ValueError(f"{num_samples} prompts make no batch of data.gen_batch_size="
                             f"{batch_size} (data.train_batch_size unless set)")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.total_epochs = total_epochs
        self.seed = seed
        self.shuffle = shuffle
        self.num_batches_per_epoch = num_batches
        self.epoch = 0
        self.position = 0  # batches already handed out in self.epoch

    def __len__(self) -> int:
        """Batches over all epochs (verl's total_training_steps when not overridden)."""
        return self.num_batches_per_epoch * self.total_epochs

    def epoch_order(self, epoch: int) -> list[int]:
        """The sample order of one epoch: a function of (seed, epoch) only."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while self.epoch < self.total_epochs:
            order = self.epoch_order(self.epoch)
            while self.position < self.num_batches_per_epoch:
                start = self.position * self.batch_size
                self.position += 1  # count before yielding: a checkpoint now skips this batch
                yield order[start:start + self.batch_size]
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if not (0 <= epoch <= self.total_epochs and 0 <= position <= self.num_batches_per_epoch):
            raise ValueError(f"sampler state {state} is outside {self.total_epochs} epochs of "
                             f"{self.num_batches_per_epoch} batches")
        self.epoch, self.position = epoch, position
