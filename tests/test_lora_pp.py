"""A LoRA actor split over pipeline stages (issue 24, acceptance 1 at pp 2): each stage takes
its layers' adapters from a PEFT directory, and the two stages' logits equal PEFT's LoRA model
(fp32), with targets on attention and MLP layers of both stages."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_dist
from hybridengine.models.attention import PackedInput
from hybridengine.models.hf import load_decoder
from hybridengine.models.lora import LoRAConfig, add_lora, load_peft_adapter, save_peft_adapter
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from model_utils import save_tiny
from test_lora import ALPHA, RANK, _nonzero_b

TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
LENGTHS = [7, 5, 9]


def _batch() -> PackedInput:
    ids = torch.randint(0, 97, (sum(LENGTHS),), generator=torch.Generator().manual_seed(5))
    return PackedInput.from_lengths(ids, LENGTHS)


def _worker(rank, world, model_dir, adapter_dir, want):
    mesh = build_mesh(Layout(tp=1, pp=2, dp=1))
    model = load_decoder(model_dir, mesh, dtype=torch.float32)
    add_lora(model, RANK, ALPHA, TARGETS, seed=3)         # other adapters, then PEFT's
    load_peft_adapter(model, adapter_dir, LoRAConfig(RANK, ALPHA, TARGETS))
    packed = _batch()
    with torch.no_grad():
        if rank == 0:
            dist.send(model(packed).contiguous(), 1)
        else:
            hidden = torch.empty(packed.num_tokens, model.cfg.hidden_size)
            dist.recv(hidden, 0)
            logits = model.logits(model(packed, hidden=hidden))
            assert (logits - want).abs().max() / want.abs().max() < 1e-5


@pytest.mark.multiproc
def test_pp2_lora_logits_equal_peft(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    d = save_tiny(tmp_path / "m", "qwen2", tied=False, layers=4)
    one = load_decoder(d, dtype=torch.float32)
    add_lora(one, RANK, ALPHA, TARGETS)
    _nonzero_b(one)
    save_peft_adapter(one, tmp_path / "adapter", LoRAConfig(RANK, ALPHA, TARGETS), d)
    theirs = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), tmp_path / "adapter").eval()
    packed = _batch()
    with torch.no_grad():           # PEFT's model on the sequences one by one
        want = torch.cat([theirs(ids[None]).logits[0] for ids in
                          packed.input_ids.split(LENGTHS)])
    run_dist(_worker, 2, d, str(tmp_path / "adapter"), want)
