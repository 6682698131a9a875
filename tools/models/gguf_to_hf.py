"""Convert a GGUF file (llama.cpp) into a Hugging Face model directory.

    python tools/models/gguf_to_hf.py FILE.gguf OUT_DIR [--dtype float32|bfloat16] [--verify]

writes OUT_DIR/{config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja}: a directory that ``AutoModelForCausalLM`` and this
repo's loader (``hybridengine.models.hf.load_decoder``) read. Weights go through transformers'
GGUF loader (``load_gguf_checkpoint``: the ``gguf`` package reads the file, quantized tensors are
dequantized to float32, llama.cpp's q/k row permutation is undone); nothing is downloaded.
``--verify`` reloads OUT_DIR and compares its logits with ``from_pretrained(gguf_file=...)``
(needs ``accelerate``).

What transformers (5.16-5.19) gets wrong or refuses, and what this does about it:
- ``save_pretrained`` refuses a model loaded from a GGUF (its config carries a GGUF
  quantization_config): a plain model is built from the config and the dequantized state dict.
- The tokenizer of a byte-level ("gpt2") GGUF: 5.16/5.17 set ``eos`` to the BOS token and no pad,
  leave ``clean_up_tokenization_spaces`` on and give a sentencepiece-style decoder; no version
  splits digits one by one for a vocabulary trained that way (``tokenizer.ggml.pre`` "smollm").
  The tokenizer is rebuilt here from the file's own metadata: special tokens by the ids the file
  states (control tokens special), the pre-tokenizer its ``pre`` names, a byte-level decoder,
  the chat template. For SmolLM2 this is its original tokenizer.json's pipeline.
- generation_config.json is written with the file's bos / eos / pad ids (chat models stop on it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import struct
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
GGUF_PIP = "gguf>=0.17,<0.20"
CONTROL = 3                         # llama.cpp token type of special tokens
# tokenizer.ggml.pre of byte-level vocabularies trained on single digits (llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_{SMOLLM,STARCODER,REFACT}): digits are split before the GPT-2 regex.
DIGIT_PRE = ("smollm", "starcoder", "refact")
GPT2_PRE = ("gpt-2", "gpt2", "default")
DTYPES = ("float32", "bfloat16")
# special token -> its id's key under tokenizer.ggml.
_GGUF_ID = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id",
            "unk": "unknown_token_id"}


class ConversionError(RuntimeError):
    """Bad input (missing file, not a GGUF, missing package, unsupported model): one line."""


# ----------------------------------------------------------------------------- input checks

def check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise ConversionError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConversionError(f"{path} is not a GGUF file (starts with {magic!r}, "
                              f"not {GGUF_MAGIC!r})")


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConversionError(f"the gguf package is needed to read GGUF files: "
                              f"pip install '{GGUF_PIP}'") from None


# GGUF value types (gguf.GGUFValueType): struct formats of the scalars; 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path: Path) -> dict[str, Any]:
    """The file's key-value metadata (GGUF v2/v3, little-endian): arrays as lists, strings
    decoded. Read here with struct, not gguf.GGUFReader, which takes ~10 s over a 49k-token
    vocabulary (a numpy view per string); the tensors are transformers' business."""
    with path.open("rb") as f:
        head = f.read(24)
        version, _num_tensors, num_kv = struct.unpack("<IQQ", head[4:24])
        if version not in (2, 3):
            raise ConversionError(f"{path}: GGUF version {version} is not supported (2 or 3; "
                                  f"big-endian files are not supported)")
        meta: dict[str, Any] = {}
        try:
            for _ in range(num_kv):
                key = _read_string(f)
                (value_type,) = struct.unpack("<I", f.read(4))
                meta[key] = _read_value(f, value_type)
        except struct.error:
            raise ConversionError(f"{path}: truncated GGUF metadata ({len(meta)} of {num_kv} "
                                  f"keys read)") from None
    return meta


def _read_string(f) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _read_value(f, value_type: int) -> Any:
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALARS:
            fmt = "<" + _SCALARS[item_type] * count
            return list(struct.unpack(fmt, f.read(struct.calcsize(fmt))))
        return [_read_value(f, item_type) for _ in range(count)]
    if value_type not in _SCALARS:
        raise ConversionError(f"unknown GGUF value type {value_type}")
    fmt = "<" + _SCALARS[value_type]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


# ----------------------------------------------------------------------------- model

def load_model(path: Path, meta: dict[str, Any]):
    """A plain transformers model (float32) holding the file's dequantized weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    with _gguf_parsed_once():
        try:
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        except (ValueError, KeyError, NotImplementedError) as e:
            raise ConversionError(f"{path}: transformers cannot read this GGUF "
                                  f"({meta.get('general.architecture')!r}): "
                                  f"{_first_line(e)}") from e
        _plain_config(config, meta)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                       model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ConversionError(f"{path}: tensors do not match {type(model).__name__}: missing "
                              f"{sorted(set(result.missing_keys) - tied)[:4]}, unexpected "
                              f"{sorted(result.unexpected_keys)[:4]}")
    model.tie_weights()
    return model.eval()


def _plain_config(config, meta: dict[str, Any]) -> None:
    """No GGUF traces (a quantization_config makes save_pretrained refuse); the special token
    ids the file states."""
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config._name_or_path = ""
    for name, key in _GGUF_ID.items():
        if f"tokenizer.ggml.{key}" in meta:
            setattr(config, f"{name}_token_id", int(meta[f"tokenizer.ggml.{key}"]))


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers' GGUF loader parses the file once for the config and again for the tensors,
    and rebuilds gguf's tensor-name table once per module (~400 times for SmolLM2): both are
    cached while this is open (the same objects; a few seconds less on SmolLM2)."""
    import gguf
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def cached_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = cached_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def generation_config(meta: dict[str, Any]):
    from transformers import GenerationConfig
    ids = {f"{name}_token_id": int(meta[f"tokenizer.ggml.{key}"])
           for name, key in _GGUF_ID.items()
           if name != "unk" and f"tokenizer.ggml.{key}" in meta}
    return GenerationConfig(**ids)


# ----------------------------------------------------------------------------- tokenizer

def _byte_level_backend(meta: dict[str, Any]):
    """Byte-level BPE straight from the file's vocabulary and merges, with the pipeline its
    ``pre`` type names; None for a ``pre`` only transformers' GGUF tables know (qwen2, llama3,
    ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    pre = meta.get("tokenizer.ggml.pre")
    if pre is not None and pre not in DIGIT_PRE + GPT2_PRE:
        return None
    vocab = {token: i for i, token in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=True)
    backend.pre_tokenizer = (pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre in DIGIT_PRE else byte_level)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _transformers_backend(path: Path, meta: dict[str, Any]):
    """transformers' own conversion of the file's tokenizer (model types and split regexes
    beyond the ones above); a byte-level one gets the plain byte-level decoder."""
    from tokenizers import decoders
    from transformers import AutoTokenizer
    backend = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer
    if meta.get("tokenizer.ggml.model") == "gpt2":
        backend.normalizer = None
        backend.decoder = decoders.ByteLevel()
    return backend


def build_tokenizer(path: Path, meta: dict[str, Any]):
    """The file's tokenizer, special tokens and chat template from its metadata."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    tokens = meta["tokenizer.ggml.tokens"]
    backend = None
    if meta.get("tokenizer.ggml.model") == "gpt2":
        backend = _byte_level_backend(meta)
    if backend is None:
        backend = _transformers_backend(path, meta)
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [tokens[i] for i, t in enumerate(types) if t == CONTROL]
    # Already in the vocabulary: this only marks them special (kept whole, skipped on decode).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    specials = {f"{name}_token": tokens[int(meta[f"tokenizer.ggml.{key}"])]
                for name, key in _GGUF_ID.items() if f"tokenizer.ggml.{key}" in meta}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=_context_length(meta), clean_up_tokenization_spaces=False, **specials)
    if len(tokenizer) != len(tokens):
        raise ConversionError(f"{path}: tokenizer has {len(tokenizer)} tokens, the file lists "
                              f"{len(tokens)}")
    return tokenizer


def _context_length(meta: dict[str, Any]) -> int:
    arch = meta.get("general.architecture", "")
    return int(meta.get(f"{arch}.context_length", 2048))


# ----------------------------------------------------------------------------- convert

def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
            dtype: str = "float32") -> Path:
    """Write the HF directory ``out_dir`` (replaced whole, atomically) from ``gguf_path``."""
    import torch
    path, out = Path(gguf_path).resolve(), Path(out_dir)
    check_gguf_file(path)
    require_gguf()
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    meta = read_metadata(path)
    model = load_model(path, meta)
    tokenizer = build_tokenizer(path, meta)
    model.generation_config = generation_config(meta)
    model.to(getattr(torch, dtype))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    for file in tmp.iterdir():      # transformers writes the weights 0600 (a temp file renamed)
        file.chmod(0o644)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def verify(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> float:
    """Max |logit difference| between OUT_DIR and transformers' GGUF-loaded model on one
    chat prompt (both float32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_accelerate_available
    if not is_accelerate_available():
        raise ConversionError("--verify needs accelerate (transformers loads a GGUF model only "
                              "with it): pip install accelerate")
    path = Path(gguf_path).resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    messages = [{"role": "user", "content": "What is 12 + 345? Answer with just the number."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return (ours(ids).logits - ref(ids).logits).abs().max().item()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out_dir", help="output HF model directory (replaced if it exists)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="weights dtype in the output (float32 keeps the dequantized values "
                             "exactly)")
    parser.add_argument("--verify", action="store_true",
                        help="compare the output's logits with transformers' GGUF-loaded model")
    args = parser.parse_args(argv)
    try:
        out = convert(args.gguf, args.out_dir, args.dtype)
        print(f"wrote {out}")
        if args.verify:
            diff = verify(args.gguf, out)
            print(f"max |logit diff| vs transformers' GGUF-loaded model: {diff:.3g}")
            if args.dtype == "float32" and diff > 1e-5:
                raise ConversionError(f"converted logits differ from the GGUF-loaded model's "
                                      f"by {diff:.3g}")
    except ConversionError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
