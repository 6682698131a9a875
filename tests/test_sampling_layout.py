"""Sampling does not depend on the generation layout: a replica that generates a share of one
global batch (its prompts' global indices, the batch's one seed) samples exactly the tokens that
one engine generating the whole batch samples for those prompts (Engine.generate's
prompt_indices; hybrid/generator.py hands each replica its indices). This is what lets a run at
another number of generation replicas, e.g. context parallel ranks, reproduce a run."""
import torch

from hybridengine.models.hf import load_decoder
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
from model_utils import STORIES


def test_a_share_of_the_batch_samples_what_the_whole_batch_samples(one_thread):
    model = load_decoder(STORIES, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 4, 6)]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1234)

    def run(indices):
        engine = Engine(model, RolloutConfig(max_num_seqs=8, max_model_len=32,
                                             max_prefill_tokens=64))
        out = engine.generate([prompts[i] for i in indices], params, prompt_indices=indices)
        return {(indices[r.prompt_index], r.sample_index): r.token_ids for r in out}

    whole = run(list(range(6)))
    # two replicas, round robin as hybrid/generator.py deals prompts; then three
    shares = [run([0, 2, 4]), run([1, 3, 5])]
    thirds = [run([0, 3]), run([1, 4]), run([2, 5])]
    assert {k: v for s in shares for k, v in s.items()} == whole
    assert {k: v for s in thirds for k, v in s.items()} == whole
    # the draws are the prompts' own: samples of one prompt differ, and so do the streams
    assert len({tuple(whole[(0, j)]) for j in range(3)}) > 1
    # without indices a share is keyed 0, 1, ...: another stream than the whole batch's
    engine = Engine(model, RolloutConfig(max_num_seqs=8, max_model_len=32, max_prefill_tokens=64))
    plain = engine.generate([prompts[i] for i in (1, 3, 5)], params)
    assert [r.token_ids for r in plain if r.prompt_index == 0] != \
        [whole[(1, j)] for j in range(3)]
