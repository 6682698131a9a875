"""LoRA adapters on the tensor-parallel decoder (parallel.lora, models.lora), float64 on the CPU:
the adapted model equals the base with merged weights W + (alpha/r)·B·A; with the adapters off it
is the base bit for bit; only adapters train; at tp = 2 (sequence parallelism on and off) the
log-probs and the adapter gradients equal tp = 1's, and every layout draws the same adapters."""
import pytest
import torch

from dist_utils import run_dist
from hybridengine.models.attention import PackedInput
from hybridengine.models.hf import load_decoder
from safetensors.torch import load_file

from hybridengine.models.lora import (LoRAConfig, add_lora, load_peft_adapter, lora_state_dict,
                                      resolve_targets, save_peft_adapter)
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.lora import adapters_disabled, lora_layers, merged_weight
from hybridengine.parallel.mesh import build_mesh
from hybridengine.parallel.tensor import all_gather_dim0, sync_sequence_parallel_grads
from model_utils import save_tiny

LENGTHS = [9, 6, 12]
RANK, ALPHA = 4, 8.0


def _batch(tp: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (sum(LENGTHS),), generator=g)
    packed = PackedInput.from_lengths(ids, LENGTHS, multiple_of=tp)
    return packed, torch.nn.functional.pad(torch.roll(ids, -1), (0, packed.num_pad))


def _nonzero_b(model) -> None:
    """PEFT starts B at zero (the adapted model is the base); tests want a delta."""
    with torch.no_grad():
        for name, p in sorted(lora_state_dict(model).items()):
            if ".lora_B." in name:
                g = torch.Generator().manual_seed(sum(map(ord, name)))
                full = torch.randn(p.shape[0] * _tp(model) if _sharded_b(name) else p.shape[0],
                                   p.shape[1], generator=g, dtype=p.dtype) * 0.05
                p.copy_(full.chunk(_tp(model))[_rank(model)] if _sharded_b(name) else full)


def _tp(model) -> int:
    from hybridengine.parallel.tensor import group_size
    return group_size(model.tp_group)


def _rank(model) -> int:
    from hybridengine.parallel.tensor import group_rank
    return group_rank(model.tp_group)


def _sharded_b(name: str) -> bool:
    return not any(k in name for k in ("o_proj", "down_proj"))     # column layers shard B


def _sharded_a(name: str) -> bool:
    return any(k in name for k in ("o_proj", "down_proj"))         # row layers shard A


def _logprob_and_grads(model, tp: int):
    packed, targets = _batch(tp)
    model.zero_grad()
    logp, ent = model.logprob_entropy(model(packed), targets)
    loss = -packed.strip(logp).sum() + 0.1 * packed.strip(ent).sum()
    if not loss.requires_grad:          # nothing trains (the adapters switched off)
        return packed.strip(logp).detach(), {}
    loss.backward()
    sync_sequence_parallel_grads(model, model.tp_group)
    grads = {}
    for name, p in lora_state_dict(model).items():
        g = p.grad
        if tp > 1 and _sharded_b(name) and ".lora_B." in name:
            g = all_gather_dim0(g.contiguous(), model.tp_group)
        if tp > 1 and _sharded_a(name) and ".lora_A." in name:
            g = all_gather_dim0(g.t().contiguous(), model.tp_group).t()
        grads[name] = g
    full_logp = packed.strip(logp).detach()
    return full_logp, grads


def test_adapted_model_is_the_base_with_merged_weights(tmp_path):
    d = save_tiny(tmp_path / "m", "qwen2", tied=True)
    model = load_decoder(d, dtype=torch.float64)
    base_logp, _ = _logprob_and_grads(load_decoder(d, dtype=torch.float64), 1)
    add_lora(model, RANK, ALPHA)
    # PEFT's start: B = 0, the adapted model is the base
    assert torch.equal(_logprob_and_grads(model, 1)[0], base_logp)
    _nonzero_b(model)
    logp, grads = _logprob_and_grads(model, 1)
    merged = load_decoder(d, dtype=torch.float64)
    with torch.no_grad():
        theirs = dict(merged.named_modules())
        for name, mine in model.named_modules():
            if getattr(mine, "lora", None) is not None:
                theirs[name].weight.copy_(merged_weight(mine))
    assert (logp - _logprob_and_grads(merged, 1)[0]).abs().max() < 1e-10
    assert (logp - base_logp).abs().max() > 1e-4           # the adapters do something
    with adapters_disabled(model):                          # the reference: the base, exactly
        assert torch.equal(_logprob_and_grads(model, 1)[0], base_logp)
    assert all(m.enabled for m in lora_layers(model))
    # only adapters train: 2 layers x 7 modules x (A, B), each with a gradient
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora." in n or ".A." in n or ".B." in n for n in trainable)
    assert len(grads) == 2 * 7 * 2 and all(g is not None and g.abs().sum() > 0
                                           for g in grads.values())
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_target_modules_choose_the_adapted_slices(tmp_path):
    assert resolve_targets("all-linear")[0] == "q_proj"
    with pytest.raises(ValueError, match=r"target_modules=\['qkv'\]"):
        resolve_targets(["qkv"])
    model = load_decoder(save_tiny(tmp_path / "m", "llama", tied=False), dtype=torch.float64)
    add_lora(model, RANK, ALPHA, ["q_proj", "v_proj"])
    names = sorted({n.split(".")[-3] for n in lora_state_dict(model)})
    assert names == ["q_proj", "v_proj"]
    _nonzero_b(model)
    qkv = model.layers[0].self_attn.qkv_proj
    q = model.layers[0].self_attn.num_heads * model.layers[0].self_attn.head_dim
    kv = model.layers[0].self_attn.num_kv_heads * model.layers[0].self_attn.head_dim
    delta = merged_weight(qkv) - qkv.weight
    assert delta[:q].abs().sum() > 0 and delta[q + kv:].abs().sum() > 0
    assert torch.equal(delta[q:q + kv], torch.zeros_like(delta[q:q + kv]))   # k untouched


def _worker(rank, world, model_dir, ref, out_dir):
    mesh = build_mesh(Layout(2, 1, 1))
    for sp in (True, False):
        model = load_decoder(model_dir, mesh, sequence_parallel=sp, dtype=torch.float64)
        add_lora(model, RANK, ALPHA)
        ref_logp, ref_grads, ref_a = ref
        for name, p in lora_state_dict(model).items():        # the same adapters drawn
            if ".lora_A." in name:
                want = ref_a[name].chunk(2, dim=1)[rank] if _sharded_a(name) else ref_a[name]
                assert torch.equal(p.detach(), want), name
        _nonzero_b(model)
        logp, grads = _logprob_and_grads(model, 2)
        assert (logp - ref_logp).abs().max() < 1e-10, sp
        assert grads.keys() == ref_grads.keys()
        for k, want in ref_grads.items():
            err = (grads[k] - want).abs().max() / want.abs().max()
            assert err < 1e-5, f"{k} sp={sp}: {err}"
        # the PEFT directory holds whole matrices, as one process writes them
        save_peft_adapter(model, f"{out_dir}/tp2", LoRAConfig(RANK, ALPHA), model_dir, mesh)
        if rank == 0:
            mine = load_file(f"{out_dir}/tp2/adapter_model.safetensors")
            want = load_file(f"{out_dir}/tp1/adapter_model.safetensors")
            assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k])
                                                      for k in want)
        # and back: each rank takes its part of the whole matrices
        fresh = load_decoder(model_dir, mesh, sequence_parallel=sp, dtype=torch.float64)
        add_lora(fresh, RANK, ALPHA, seed=1)
        load_peft_adapter(fresh, f"{out_dir}/tp1", LoRAConfig(RANK, ALPHA))
        theirs = lora_state_dict(fresh)
        assert all(torch.equal(p, theirs[n]) for n, p in lora_state_dict(model).items())


@pytest.mark.multiproc
def test_tp2_adapters_equal_tp1(tmp_path):
    d = save_tiny(tmp_path / "m", "qwen2", tied=True)
    model = load_decoder(d, dtype=torch.float64)
    add_lora(model, RANK, ALPHA)
    a = {n: p.detach().clone() for n, p in lora_state_dict(model).items() if ".lora_A." in n}
    _nonzero_b(model)
    logp, grads = _logprob_and_grads(model, 1)
    save_peft_adapter(model, tmp_path / "tp1", LoRAConfig(RANK, ALPHA), d)
    run_dist(_worker, 2, d, (logp, grads, a), str(tmp_path))


# --- in the trainer: the actor trains adapters, the reference is the base, exports are merged --

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _lora_trainer(tmp_path, *overrides):
    """A one-process GRPO trainer on stories260k with a KL loss (so the reference scores), LoRA
    rank 4 on every linear module: 4 prompts x 4 samples of 32 tokens (some score > 0), 2
    updates per step."""
    from hybridengine.config import load_config
    from hybridengine.rl.trainer import Trainer
    cfg = load_config(["--config", str(ROOT / "configs" / "tiny.yaml"),
                       f"data.train_files={ROOT / 'data' / 'stories_keywords' / 'train.jsonl'}",
                       "data.val_files=null", "actor_rollout_ref.model.lora_rank=4",
                       "actor_rollout_ref.model.lora_alpha=8",
                       "actor_rollout_ref.actor.optim.lr=1e-2",
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                       "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                       "actor_rollout_ref.rollout.n=4", "data.max_response_length=32",
                       "actor_rollout_ref.actor.use_kl_loss=true",
                       "trainer.val_before_train=False", "trainer.logger=[]",
                       f"trainer.default_local_dir={tmp_path}", *overrides])
    return Trainer(cfg)


def test_lora_actor_in_the_trainer(tmp_path):
    trainer = _lora_trainer(tmp_path / "run", "trainer.total_training_steps=3",
                            "trainer.save_freq=3")
    model = trainer.actor.engine.model
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora." not in n}
    assert trainer.ref.engine is trainer.actor.engine          # no second copy of the weights
    trainer.fit()                                               # 3 steps, 3 switches each way
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters()
               if ".lora." not in n)                            # the base, bit for bit
    b = [p for n, p in lora_state_dict(model).items() if ".lora_B." in n]
    assert any(p.abs().sum() > 0 for p in b)                    # the adapters trained
    # the reference is the base: its log-probs are those of a model without adapters
    from hybridengine.rl.batch import Batch
    batch = Batch([[1, 2, 3]] * 2, [[4, 5, 6], [7, 8]], [0, 0], ["keyword"] * 2, [["dog"]] * 2,
                  [{}] * 2, 8)
    plain = load_decoder(ROOT / "models" / "stories260k", dtype=torch.float32)
    packed = PackedInput.from_lengths(torch.tensor([1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8]), [6, 5])
    want, _ = plain.logprob_entropy(plain(packed), torch.roll(packed.input_ids, -1))
    got = trainer.ref.score(batch, "logprob")
    assert torch.allclose(got[0, :3], want[2:5], atol=1e-6)
    assert torch.allclose(got[1, :2], want[8:10], atol=1e-6)
    assert not torch.allclose(trainer.actor.score(batch, "logprob")[0, :3], want[2:5],
                              atol=1e-4)                        # the actor is not the base
    # the checkpoint: a PEFT adapter directory, and the merged model as an HF directory
    actor_dir = tmp_path / "run" / "global_step_3" / "actor"
    exported = load_decoder(actor_dir / "merged", dtype=torch.float32)
    qkv = model.layers[0].self_attn.qkv_proj
    assert torch.allclose(exported.layers[0].self_attn.qkv_proj.weight, merged_weight(qkv))
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    base_hf = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "stories260k",
                                                   dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base_hf, actor_dir).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        want = torch.log_softmax(theirs(ids).logits[0].float(), -1)
        want = want[torch.arange(5), ids[0, 1:]]
    packed = PackedInput.from_lengths(ids[0], [6])
    got, _ = model.logprob_entropy(model(packed), torch.roll(packed.input_ids, -1))
    assert (got[:5].detach() - want).abs().max() < 1e-5          # PEFT's LoRA model, exactly


def test_a_peft_adapter_loads_back_and_a_mismatch_is_one_line(tmp_path):
    d = save_tiny(tmp_path / "m", "llama", tied=False)
    targets = ("q_proj", "down_proj")
    model = load_decoder(d, dtype=torch.float32)
    add_lora(model, RANK, ALPHA, targets)
    _nonzero_b(model)
    save_peft_adapter(model, tmp_path / "adapter", LoRAConfig(RANK, ALPHA, targets), d)
    fresh = load_decoder(d, dtype=torch.float32)
    add_lora(fresh, RANK, ALPHA, targets, seed=7)
    load_peft_adapter(fresh, tmp_path / "adapter", LoRAConfig(RANK, ALPHA, targets[::-1]))
    theirs = lora_state_dict(fresh)
    assert all(torch.equal(p, theirs[n]) for n, p in lora_state_dict(model).items())
    with pytest.raises(ValueError, match=r"its r, lora_alpha, target_modules \(4, 8.0, "
                                         r"\['down_proj', 'q_proj'\]\) differ from the run's "
                                         r"\(8, 8.0"):
        load_peft_adapter(fresh, tmp_path / "adapter", LoRAConfig(8, ALPHA, targets))
    with pytest.raises(ValueError, match="not a PEFT LoRA directory"):
        load_peft_adapter(fresh, tmp_path, LoRAConfig(RANK, ALPHA))
