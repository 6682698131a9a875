"""FLOPs accounting against an independent count: torch's FlopCounterMode on a Hugging Face
Llama, and parameter counts read off the model's nn.Linear modules."""
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from hybridengine.rl.flops import (causal_attention_flops, decoder_flops, decoder_flops_from_hf,
                                   dense_flops_6n, matmul_params, mfu, peak_flops, throughput)

FIXTURE = Path(__file__).parent.parent / "models" / "stories260k"

# GQA (6 query heads over 2 KV groups), head_dim * num_heads != hidden, untied head: every term
# of the formula has a distinct size, so a swapped term cannot cancel out.
SHAPES = dict(num_layers=2, hidden_size=48, intermediate_size=80, num_heads=6, num_kv_heads=2,
              head_dim=8, vocab_size=96)


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         head_dim=8, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def count_hf_flops(model: LlamaForCausalLM, seqlens: list[int], backward: bool) -> tuple[int, int]:
    """(aten.mm, aten.bmm) FLOPs of running each sequence alone, as packing would (no token
    attends across sequences). mm is every nn.Linear; bmm is QK^T and PV of eager attention."""
    mm = bmm = 0
    for s in seqlens:
        ids = torch.randint(0, 96, (1, s))
        with FlopCounterMode(display=False) as counter:
            logits = model(input_ids=ids).logits
            if backward:
                logits.float().sum().backward()
        by_module = {module: {str(op): n for op, n in ops.items()}
                     for module, ops in counter.get_flop_counts().items()}
        assert set(by_module["Global"]) <= {"aten.mm", "aten.bmm"}, by_module["Global"]
        mm += by_module["Global"].get("aten.mm", 0)
        bmm += by_module["Global"].get("aten.bmm", 0)
        # Some transformers versions build RoPE's angle table as a [hd/2, 1] x [1, s] bmm:
        # not attention, and constant (no backward), so it is taken out.
        bmm -= sum(ops.get("aten.bmm", 0) for module, ops in by_module.items()
                   if module.endswith("rotary_emb"))
    return mm, bmm


@pytest.mark.parametrize("backward", [False, True])
def test_decoder_flops_matches_flop_counter(backward):
    model = tiny_llama()
    seqlens = [13, 1, 7]
    mm, bmm = count_hf_flops(model, seqlens, backward)
    factor = 3 if backward else 1
    num_params = matmul_params(**SHAPES)
    assert mm == factor * 2 * num_params * sum(seqlens)
    # Eager attention forms the full s x s score matrix and then masks it, so it does twice the
    # causal work our term counts (flash attention skips the masked half, as we do).
    attention = causal_attention_flops(SHAPES["num_layers"], SHAPES["num_heads"],
                                       SHAPES["head_dim"], seqlens)
    assert bmm == factor * 2 * attention
    assert decoder_flops(**SHAPES, seqlens=seqlens, backward=backward) == mm + bmm // 2


def test_attention_term_by_hand():
    # 2 * 2 * L * heads * head_dim * s^2 / 2 summed over sequences: 2 * 3 * 4 * 5 * (9 + 16)
    assert causal_attention_flops(3, 4, 5, [3, 4]) == 2 * 3 * 4 * 5 * 25 == 3000
    # Packing is a sum of squares, not the square of the sum.
    assert causal_attention_flops(3, 4, 5, [3, 4]) < causal_attention_flops(3, 4, 5, [7])


def test_matmul_params_equals_linear_weights_of_hf_model():
    model = tiny_llama()
    num_linear = sum(m.weight.numel() for m in model.modules()
                     if isinstance(m, torch.nn.Linear))
    assert matmul_params(**SHAPES) == num_linear


def test_from_hf_config_on_fixture_with_tied_head():
    config = LlamaConfig.from_pretrained(FIXTURE)
    model = LlamaForCausalLM(config)
    seqlens = [5, 9]
    # Tied head: the lm_head Linear shares the embedding weight but is still a matmul.
    num_linear = sum(m.weight.numel() for m in model.modules()
                     if isinstance(m, torch.nn.Linear))
    expected = 2 * num_linear * 14 + causal_attention_flops(5, 8, 8, seqlens)
    assert decoder_flops_from_hf(config, seqlens) == expected
    assert decoder_flops_from_hf(config, seqlens, backward=True) == 3 * expected


def test_6n_relation():
    seqlens = [100, 28, 256]
    num_params = matmul_params(**SHAPES)
    attention = causal_attention_flops(SHAPES["num_layers"], SHAPES["num_heads"],
                                       SHAPES["head_dim"], seqlens)
    train = decoder_flops(**SHAPES, seqlens=seqlens, backward=True)
    assert train - 3 * attention == dense_flops_6n(num_params, sum(seqlens))
    assert dense_flops_6n(num_params, 0) == 0


def test_throughput_and_mfu_by_hand():
    # 4096 tokens in 2 s on 4 devices = 512 tokens/s/device
    assert throughput(4096, 2.0, 4) == 512.0
    # 8e14 FLOPs in 2 s on 4 devices of 1e14 FLOP/s peak: 4e14 / 4e14 = 1.0; on 8 devices 0.5
    assert mfu(8e14, 2.0, 1e14, num_devices=4) == pytest.approx(1.0)
    assert mfu(8e14, 2.0, 1e14, num_devices=8) == pytest.approx(0.5)


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        matmul_params(2, 48, 80, num_heads=6, num_kv_heads=4, head_dim=8, vocab_size=96)
    with pytest.raises(ValueError, match="seqlens"):
        decoder_flops(**SHAPES, seqlens=[3, -1])
    with pytest.raises(ValueError, match="step_seconds"):
        throughput(10, 0.0, 1)
    with pytest.raises(ValueError, match="peak_flops_per_s"):
        mfu(1.0, 1.0, None)


def test_peak_flops_without_cuda_is_none():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert peak_flops() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_flops_on_gpu_is_plausible():
    peak = peak_flops()
    # Any bf16 tensor-core GPU this targets sustains 1e13..3e15 FLOP/s on an 8192^3 GEMM.
    assert 1e13 < peak < 3e15
    assert peak_flops() == peak  # measured once, cached


def test_a_lora_actors_update_counts_no_weight_gradients():
    """step_flops: a full-parameter update is 3 forwards (forward, input and weight gradients),
    a LoRA actor's 2 (its frozen weights get no gradient)."""
    from types import SimpleNamespace
    from hybridengine.models.decoder import ModelConfig
    from hybridengine.rl.metrics import step_flops
    model = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16)

    def cfg(rank):
        return SimpleNamespace(actor_rollout_ref=SimpleNamespace(
            model=SimpleNamespace(lora_rank=rank), actor=SimpleNamespace(ppo_epochs=1)))
    full = step_flops(model, [10, 20], cfg(0), has_ref=True, has_critic=False)
    lora = step_flops(model, [10, 20], cfg(8), has_ref=True, has_critic=False)
    assert full["update_actor"] == 3 * full["old_log_prob"]
    assert lora["update_actor"] == 2 * lora["old_log_prob"] and lora["ref"] == full["ref"]
