"""hybrid.generator's gather of the replicas' generations (Generator._gather) and padded_rows: every
response comes back in prompt-major order with its token ids exact, its log-probs as the float32
values the engine produced, and its finish reason, on one process and over two generation
replicas (gloo, round-robin prompts as Generator.generate deals them)."""
import random
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_dist
from hybridengine.hybrid.generator import Generator, padded_rows
from hybridengine.rollout.engine import GenerationResult


def test_padded_rows_puts_each_row_left_and_zeros_after():
    rows = [[3, 1, 4], [], [1, 5, 9, 2, 6], [5]]
    got = padded_rows(rows, 6, np.int64)
    want = np.zeros((4, 6), np.int64)
    for i, r in enumerate(rows):
        want[i, :len(r)] = r
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert padded_rows([], 3).shape == (0, 3)
    lp = [[-0.1, -2.5], [-1e-8]]
    assert np.array_equal(padded_rows(lp, 2, np.float32),
                          np.array([[-0.1, -2.5], [-1e-8, 0.0]], np.float32))


def _results(prompts: list[int], n: int, seed: int) -> list[GenerationResult]:
    """Fake engine output for the prompts (global indices): lengths 0..9, ids up to Qwen's
    vocabulary, log-probs of float32 values, both finish reasons."""
    rng = random.Random(seed)
    out = []
    for k, p in enumerate(prompts):
        for j in range(n):
            length = rng.randint(0, 9)
            lps = [float(np.float32(-rng.random() * 5)) for _ in range(length)]
            out.append(GenerationResult(k, j, [rng.randint(0, 151_935) for _ in range(length)],
                                        [float(np.float32(x - 1)) for x in lps], lps,
                                        "stop" if rng.random() < 0.5 else "length"))
    return out


def _generator(world_group, gen_dp: int) -> Generator:
    g = Generator.__new__(Generator)
    g.gen_mesh = types.SimpleNamespace(world_group=world_group, gen_dp=gen_dp)
    g.actor = types.SimpleNamespace(device=torch.device("cpu"))
    g._replica = lambda rank: (rank, 0)          # every rank its own replica, TP 1
    return g


def _check(out, expected: dict, sampled: bool) -> None:
    assert out.num_generated_tokens == sum(len(r.token_ids) for r in expected.values())
    for i, r in sorted(expected.items()):
        assert out.response_ids[i] == r.token_ids
        assert out.logprobs[i] == (r.sampled_logprobs if sampled else r.logprobs)
        assert out.finish_reasons[i] == r.finish_reason


@pytest.mark.parametrize("sampled", [True, False])
def test_one_replica_gets_back_what_it_generated(sampled):
    n, prompts = 3, list(range(5))
    results = _results(prompts, n, seed=1)
    out = _generator(None, 1)._gather(results, len(prompts), n, sampled)
    _check(out, {p * n + r.sample_index: r for p, r in
                 ((r.prompt_index, r) for r in results)}, sampled)


def _two_replicas(rank, world_size):
    n, num_prompts = 2, 5                       # replica 0: prompts 0, 2, 4; replica 1: 1, 3
    mine = list(range(rank, num_prompts, world_size))
    out = _generator(dist.group.WORLD, world_size)._gather(_results(mine, n, seed=rank),
                                                           num_prompts, n, True)
    expected = {}
    for r in range(world_size):
        theirs = list(range(r, num_prompts, world_size))
        for res in _results(theirs, n, seed=r):
            expected[theirs[res.prompt_index] * n + res.sample_index] = res
    assert len(expected) == num_prompts * n
    _check(out, expected, True)


def test_two_replicas_gather_every_response_in_prompt_order():
    run_dist(_two_replicas, 2)
