"""HF checkpoint I/O: save from any layout and load with transformers; clear errors."""
import shutil

import pytest
import torch

from dist_utils import run_dist
from hybridengine.models.attention import PackedInput
from hybridengine.models.hf import load_decoder, read_model_config, save_hf
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from model_utils import STORIES, rel_err, save_tiny

LENGTHS = [6, 9]


def _logits(model, tp=1):
    ids = torch.arange(15) % 90 + 3
    packed = PackedInput.from_lengths(ids, LENGTHS, multiple_of=tp)
    with torch.no_grad():
        return packed.strip(model.logits(model(packed)))


def _save_worker(rank, world, src, out, layout):
    mesh = build_mesh(layout)
    model = load_decoder(src, mesh, sequence_parallel=True)
    with torch.no_grad():   # move off the source weights so the test sees what was saved
        for p in model.parameters():
            p.mul_(1.5)
    save_hf(model, out, mesh, src_dir=src)
    logits = _logits(model, layout.tp)          # collective: every rank runs it
    if rank == 0:
        torch.save(logits, f"{out}.logits.0")


@pytest.mark.multiproc
@pytest.mark.parametrize("kind,tied,layout", [("qwen2", True, Layout(2, 1, 1)),
                                              ("llama", False, Layout(2, 1, 1))])
def test_save_from_tp2_loads_in_transformers(tmp_path, kind, tied, layout):
    from transformers import AutoModelForCausalLM
    src = save_tiny(tmp_path / "src", kind, tied)
    out = tmp_path / "saved"
    run_dist(_save_worker, layout.world_size, src, str(out), layout)
    ours = torch.load(f"{out}.logits.0")
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.arange(15) % 90 + 3
    with torch.no_grad():
        ref = torch.cat([hf(ids[:6][None]).logits[0], hf(ids[6:][None]).logits[0]])
    assert rel_err(ours, ref) < 1e-5
    assert not list(tmp_path.glob(".saved.tmp"))


def test_save_stories_single_process_roundtrip(tmp_path):
    model = load_decoder(STORIES)
    save_hf(model, tmp_path / "out", src_dir=STORIES)
    assert (tmp_path / "out" / "tokenizer.model").is_file()
    again = load_decoder(tmp_path / "out")
    assert torch.equal(_logits(model), _logits(again))
    save_hf(again, tmp_path / "out", src_dir=STORIES)          # overwrite in place works
    assert torch.equal(_logits(load_decoder(tmp_path / "out")), _logits(model))


def test_error_heads_not_divisible_by_tp():
    cfg = read_model_config(STORIES)          # 8 heads, 4 KV heads
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by tensor parallel size 3"):
        cfg.check_tp(3)
    with pytest.raises(ValueError, match="num_key_value_heads=4 is not divisible by tensor parallel size 8"):
        cfg.check_tp(8)


def test_error_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model directory {tmp_path} has no config.json"):
        load_decoder(tmp_path)


def test_error_missing_and_corrupt_weights(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(STORIES, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no \\*.safetensors files"):
        load_decoder(d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="corrupt safetensors file .*model.safetensors"):
        load_decoder(d)


def test_error_missing_tensor_and_wrong_shape(tmp_path):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "m"
    shutil.copytree(STORIES, d)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(KeyError, match="lacks tensor 'model.layers.3.mlp.up_proj.weight'"):
        load_decoder(d)
    tensors["model.layers.3.mlp.up_proj.weight"] = torch.zeros(171, 64)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.3.mlp.up_proj.weight.*has shape \\(171, 64\\)"):
        load_decoder(d)


def test_error_world_size_not_tp_pp_dp():
    with pytest.raises(ValueError, match="world size 3 != tp\\*pp\\*dp = 2\\*1\\*1 = 2"):
        Layout(2, 1, 1).check_world_size(3)


def test_error_unsupported_model_type(tmp_path):
    import json
    d = tmp_path / "m"
    shutil.copytree(STORIES, d)
    conf = json.loads((d / "config.json").read_text())
    conf["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="model_type='gpt2' .* is not supported"):
        read_model_config(d)


def test_stage_split_is_even():
    from hybridengine.models.decoder import stage_layers
    assert [stage_layers(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(24, 4, r) for r in range(4)] == [(0, 6), (6, 12), (12, 18), (18, 24)]
    with pytest.raises(ValueError, match="num_hidden_layers=2 < pipeline parallel size 4"):
        stage_layers(2, 4, 0)
