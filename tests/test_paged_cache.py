"""The paged KV cache (rollout/block_manager.py, rollout/paged_cache.py): block-manager
invariants under random admit / grow / finish / preempt, prefix sharing, attention through
block tables against dense fp64 and the static-slot cache (and the runner's padded
cached-prefix prefill), a toy generation with sharing and preemption against dense
generation, and the Triton paged decode kernel (plain and fused with RoPE and the cache write)
and the engine on it in the interpreter. ~20 s on CPU."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import deque

import pytest
import torch

from hybridengine.rollout.attention import DecodeContext
from hybridengine.rollout.kv_cache import KVCache
from hybridengine.rollout.paged_context import padded_prefix_attention
from hybridengine.rollout.block_manager import BlockAllocator, BlockTables
from hybridengine.rollout.paged_cache import (PagedKVCache, paged_decode_attention,
                                              paged_prefill_attention)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tables(num_blocks=16, block_size=4) -> BlockTables:
    return BlockTables(BlockAllocator(num_blocks, block_size))


def test_allocator_counts_references():
    a = BlockAllocator(3, 4)
    b = a.allocate()
    a.share(b)
    a.free(b)
    assert a.refs[b] == 1 and a.num_free == 2
    a.free(b)
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free(b)
    with pytest.raises(RuntimeError, match="holds no cached prefix"):
        a.share(b)                      # free and uncached: nothing to revive
    [a.allocate() for _ in range(3)]
    assert not a.can_allocate()
    with pytest.raises(RuntimeError, match="no free KV-cache block"):
        a.allocate()


def test_samples_share_full_prompt_blocks_and_own_their_tails():
    t = _tables()
    prompt = list(range(10))                   # two full blocks of 4, a tail of 2
    assert t.blocks_to_admit(prompt, 3) == 2 + 3
    assert t.admit(0, prompt, 3) == 0
    t.check()
    tabs = [t.tables[s] for s in range(3)]
    assert tabs[0][:2] == tabs[1][:2] == tabs[2][:2]
    assert len({tab[2] for tab in tabs}) == 3
    assert [t.allocator.refs[b] for b in tabs[0]] == [3, 3, 1]
    # the one prefill writes each full-block token once and each tail token per sample
    src, dst = (a.tolist() for a in t.prefill_slots(0, 3, 0))
    assert src == list(range(10)) + [8, 9, 8, 9]
    assert dst[:8] == [tabs[0][p // 4] * 4 + p % 4 for p in range(8)]
    assert dst[10:] == [tabs[1][2] * 4, tabs[1][2] * 4 + 1, tabs[2][2] * 4, tabs[2][2] * 4 + 1]
    # growth fills the private tail, then takes a new block at the boundary
    assert t.append_slot(1) == (tabs[1][2], 2)
    assert t.append_slot(1) == (tabs[1][2], 3)
    block, offset = t.append_slot(1)
    assert offset == 0 and block not in tabs[0] + tabs[2] and t.num_tokens[1] == 13
    t.check()
    # fixed-width tables padded with the scratch block; -1: a padding row
    bt = t.block_table([0, -1], width=4)
    assert bt.dtype == torch.int32 and bt.tolist() == [tabs[0] + [16], [16] * 4]
    with pytest.raises(ValueError, match="width 2"):
        t.block_table([0], width=2)


def test_equal_prompts_and_common_prefixes_share_full_blocks():
    t = _tables(num_blocks=32)
    a = [5, 6, 7, 8, 1, 2, 3, 4, 9, 9]
    assert t.admit(0, a, 2) == 0
    assert t.admit(2, a, 1) == 8 and t.tables[2][:2] == t.tables[0][:2]   # an equal prompt
    assert t.admit(3, a[:6] + [0, 0, 0], 1) == 4          # a common prefix: its full block
    assert t.tables[3][0] == t.tables[0][0] and t.tables[3][1] != t.tables[0][1]
    # a block equal to a[4:8] after another first block is a different chain: no hit
    assert t.admit(4, [0, 0, 0, 0] + a[4:8] + [1], 1) == 0 and t.tables[4][1] != t.tables[0][1]
    # a block-aligned prompt recomputes its last block (its last token gives the first
    # logits): the hit stops one block short, in a fresh block that the index does not take
    assert t.admit(5, a[:8], 1) == 4 and t.tables[5][1] != t.tables[0][1]
    assert t.admit(6, a[:8] + [7], 1) == 8 and t.tables[6][:2] == t.tables[0][:2]
    t.check()
    assert [t.allocator.refs[b] for b in t.tables[0]] == [6, 4, 1]   # 6 tables hold block 0


def test_cached_blocks_outlive_their_sequences_until_evicted_or_reset():
    t = _tables(num_blocks=6)
    prompt = list(range(9))
    t.admit(0, prompt, 1)
    kept = t.tables[0][:2]
    t.finish(0)
    assert t.allocator.num_free == 6                      # cached, yet free
    assert t.blocks_to_admit(prompt, 1) == 3              # two revived, one tail
    assert t.admit(1, prompt, 1) == 8 and t.tables[1][:2] == kept
    t.finish(1)
    t.allocator.reset_prefix_cache()
    assert t.admit(2, prompt, 1) == 0
    t.finish(2)
    # the free list gives the least recently freed blocks first: the prompt's blocks, freed
    # last (tail first), outlive three small prompts; two more evict the chain's tail block
    [t.admit(10 + s, [100 + s], 1) for s in range(3)]
    assert t.blocks_to_admit(prompt, 1) == 3
    [t.admit(10 + s, [100 + s], 1) for s in (3, 4)]
    t.finish(10), t.finish(11)
    assert t.admit(20, prompt, 1) == 4
    t.check()


def test_admission_counts_blocks_and_preemption_takes_the_youngest():
    t = _tables(num_blocks=8)
    t.admit(0, list(range(12)), 2)                        # 3 shared blocks, no tail
    assert t.allocator.num_free == 5
    t.admit(2, [1, 2, 3], 1), t.admit(3, [4, 5, 6, 7, 8], 1)
    assert t.allocator.num_free == 2
    assert not t.can_admit([9] * 9, 1) and t.can_admit([9] * 5, 1)
    assert not t.can_admit([9] * 5, 1, reserve=1)
    with pytest.raises(RuntimeError, match="not enough free"):
        t.admit(4, [9] * 9, 1)
    # both samples at a block boundary, seq 3 needs none: two blocks, two free
    assert t.blocks_to_append([0, 1, 2, 3]) == 2
    assert t.preempt_for_decode([0, 1, 2, 3]) == []
    [t.append_slot(s) for s in (0, 1, 3, 3, 3)]           # seq 3 fills its tail block
    assert t.blocks_to_append([0, 1, 2, 3]) == 1 and t.allocator.num_free == 0
    # the youngest (seq 3) goes first; that frees its two blocks
    assert t.preempt_for_decode([0, 1, 2, 3]) == [3]
    assert t.preempt_youngest(5) == [2, 1, 0] and t.num_preemptions == 4
    assert t.allocator.num_free == 8
    t.check()


def test_random_admit_grow_finish_preempt_leaks_nothing():
    """1,000 seeded operations over prompts with common prefixes; after every one the
    invariants hold and each sequence reads back, through its table, exactly the tokens it
    wrote or found cached (a shared block overwritten, or a wrong cache hit, shows here)."""
    rng, bs, num_blocks = random.Random(0), 4, 48
    t = _tables(num_blocks, bs)
    content, tokens = {}, {}        # flat slot -> token written there; seq id -> its tokens
    waiting: deque[tuple[int, list[int]]] = deque()      # preempted: recomputed later
    stems = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]
    next_id = hits = refused = peak = 0
    for _ in range(1000):
        op = rng.random()
        if op < 0.3:
            if waiting and rng.random() < 0.5:
                (seq_id, prompt), n = waiting[0], 1
            else:
                seq_id, n = next_id, rng.randint(1, 3)
                prompt = rng.choice(stems)[:rng.randint(1, 12)] + \
                    [rng.randrange(3) for _ in range(rng.randint(0, 6))]
            if not t.can_admit(prompt, n):
                refused += 1
                continue
            free, need = t.allocator.num_free, t.blocks_to_admit(prompt, n)
            cached = t.admit(seq_id, prompt, n)
            assert t.allocator.num_free == free - need and cached % bs == 0 < len(prompt) - cached
            hits += cached > 0
            for i, slot in zip(*t.prefill_slots(seq_id, n, cached)):
                content[slot] = prompt[cached + i]
            tokens.update({s: list(prompt) for s in range(seq_id, seq_id + n)})
            if seq_id == next_id:
                next_id += n
            else:
                waiting.popleft()
        elif op < 0.75 and tokens:
            rows = sorted(rng.sample(sorted(tokens), rng.randint(1, len(tokens))))
            for s in t.preempt_for_decode(rows):
                waiting.append((s, tokens.pop(s)))
            assert t.blocks_to_append(rows) <= t.allocator.num_free
            for s in rows:
                if s in tokens:
                    block, offset = t.append_slot(s)
                    tokens[s].append(rng.randrange(3))
                    content[block * bs + offset] = tokens[s][-1]
        elif op < 0.95 and tokens:
            t.finish(s := rng.choice(sorted(tokens)))
            del tokens[s]
        elif tokens:
            for s in t.preempt_youngest(rng.randint(1, num_blocks)):
                waiting.append((s, tokens.pop(s)))
        t.check()
        assert sorted(t.tables) == sorted(tokens)
        for s, toks in tokens.items():
            table = t.tables[s]
            assert [content[table[p // bs] * bs + p % bs] for p in range(len(toks))] == toks
        # blocks held only grow inside an operation: the peak is the largest seen after one
        peak = max(peak, num_blocks - t.allocator.num_free)
        assert t.peak_blocks == peak
        distinct = {t.tables[s][p // bs] * bs + p % bs
                    for s in tokens for p in range(len(tokens[s]))}
        assert t._sum_tokens - t.allocator.extra_refs * bs == len(distinct)
    assert t.num_preemptions > 0 and hits > 0 and refused > 0 and next_id > 100
    [t.finish(s) for s in list(t.tables)]
    t.check()
    assert t.allocator.num_free == num_blocks and not any(t.allocator.refs)


def test_peak_blocks_and_the_distinct_tokens_they_hold():
    """Two samples of a 10-token prompt at block size 4 share its two full blocks and own a
    tail each: 4 blocks hold 8 + 2 + 2 distinct tokens; the 13th token of one sample takes a
    fifth block (15 tokens then); finishing gives everything back without lowering the peak."""
    t = _tables(16, 4)
    t.admit(0, list(range(10)), n=2)
    assert (t.peak_blocks, t.tokens_at_peak, t.allocator.extra_refs) == (4, 12, 2)
    for _ in range(3):
        t.append_slot(0)
    assert (t.peak_blocks, t.tokens_at_peak) == (5, 15)
    t.finish(0)
    t.finish(1)
    t.check()
    assert (t.peak_blocks, t.tokens_at_peak, t.allocator.extra_refs) == (5, 15, 0)


def _dense_attention(q, k, v, scale):
    """q [n, h_q, d] at the last n of L positions, k/v [L, h_kv, d]: causal, fp64, GQA by
    repeating each K/V head."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    causal = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    p = s.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", p, v)


@pytest.mark.parametrize("hq,hkv,bs", [(14, 2, 16), (9, 3, 5)])
def test_paged_attention_matches_dense_fp64(hq, hkv, bs):
    g = torch.Generator().manual_seed(hq)
    d, num_blocks, W = 64, 24, 6
    cache = PagedKVCache(1, num_blocks, bs, hkv, d, torch.float64, torch.device("cpu"))
    for x in cache.k + cache.v:
        x.copy_(torch.randn(x.shape, generator=g, dtype=torch.float64))
    # one key, block boundaries on both sides, a whole table, something in between
    lens = [1, bs, bs + 1, 2 * bs - 1, W * bs, 3 * bs + 2]
    B, scale = len(lens), 0.3
    bt = torch.full((B, W), num_blocks, dtype=torch.int32)
    for b, n in enumerate(lens):
        bt[b, :-(-n // bs)] = torch.randperm(num_blocks, generator=g)[:-(-n // bs)].int()

    def dense_kv(b, n):
        return [x[bt[b].long()].reshape(W * bs, hkv, d)[:n] for x in (cache.k[0], cache.v[0])]

    q = torch.randn(B, hq, d, generator=g, dtype=torch.float64)
    out = paged_decode_attention(q, cache.k[0], cache.v[0], bt, torch.tensor(lens), scale)
    for b, n in enumerate(lens):
        ref = _dense_attention(q[b:b + 1], *dense_kv(b, n), scale)[0]
        assert (out[b] - ref).abs().max() < 1e-12, b
    # prefill: row b's last new[b] tokens are new (a whole prompt, one token, a block's worth)
    new = [1, bs, 1, bs - 1, W * bs, 5]
    cu = torch.tensor([0] + new).cumsum(0)
    qp = torch.randn(int(cu[-1]), hq, d, generator=g, dtype=torch.float64)
    out = paged_prefill_attention(qp, cache.k[0], cache.v[0], bt, cu, torch.tensor(lens), scale)
    # the runner's form: keys gathered into right-padded rows of N, the new queries placed at
    # their positions (padding keys: the scratch block's slot 0), one causal SDPA
    N = max(lens)
    key_slots = torch.full((B, N), num_blocks * bs)
    q_index = []
    for b, n in enumerate(lens):
        p = torch.arange(n)
        key_slots[b, :n] = bt[b, p // bs].long() * bs + p % bs
        q_index += [b * N + i for i in range(n - new[b], n)]
    padded = padded_prefix_attention(qp * scale * d ** 0.5, cache.k[0], cache.v[0],
                                     key_slots.view(-1), torch.tensor(q_index), B, N)
    for b, n in enumerate(lens):
        ref = _dense_attention(qp[cu[b]:cu[b + 1]], *dense_kv(b, n), scale)
        assert (out[cu[b]:cu[b + 1]] - ref).abs().max() < 1e-12, b
        assert (padded[cu[b]:cu[b + 1]] - ref).abs().max() < 1e-12, b


@pytest.mark.parametrize("hq,hkv", [(14, 2), (9, 3)])
def test_paged_decode_equals_the_static_slot_cache(hq, hkv):
    """The same K/V in kv_cache's rows and in scattered blocks; one decode step (the new token
    written, then attention) on each: bit for bit (W·block_size = max_model_len)."""
    g, d, bs, W, B = torch.Generator().manual_seed(1), 64, 16, 4, 5
    L = W * bs
    static = KVCache(1, B, L, hkv, d, torch.float32, "cpu")
    paged = PagedKVCache(1, B * W, bs, hkv, d, torch.float32, "cpu")
    bt = torch.randperm(B * W, generator=g).int().view(B, W)
    slots = torch.tensor([3, 0, 1, 4, 2])
    pos = torch.tensor([0, bs - 1, bs, L - 1, 37])            # the new token's position
    for b in range(B):
        p = torch.arange(int(pos[b]))
        k, v = (torch.randn(len(p), hkv, d, generator=g) for _ in range(2))
        static.write(0, slots[b].repeat(len(p)), p, k, v)
        paged.write(0, bt[b, p // bs].long() * bs + p % bs, k, v)
    q = torch.randn(B, hq, d, generator=g)
    k_new, v_new = (torch.randn(B, hkv, d, generator=g) for _ in range(2))
    want = DecodeContext(static, 0, slots, pos, "sdpa", L).attend(0, q, k_new, v_new)
    paged.write(0, bt[torch.arange(B), pos // bs].long() * bs + pos % bs, k_new, v_new)
    got = paged_decode_attention(q, paged.k[0], paged.v[0], bt, pos + 1)
    assert torch.equal(got, want)


class _ToyModel:
    """One attention layer over embeddings, in fp64: k_t, v_t depend on (token_t, t) only, as
    a decoder's K/V depend on the prefix only; the next token is the argmax of the output's
    logits plus noise fixed per (sequence, position), as sampling.uniforms is keyed."""

    def __init__(self, g, num_seqs, vocab=11, hq=4, hkv=2, d=16, max_len=32):
        f64 = dict(generator=g, dtype=torch.float64)
        self.hkv, self.d, self.scale = hkv, d, d ** -0.5
        self.eq, self.ek, self.ev = (torch.randn(vocab, h, d, **f64) for h in (hq, hkv, hkv))
        self.pos = torch.randn(max_len, hkv, d, **f64)
        self.unembed = torch.randn(hq * d, vocab, **f64)
        self.noise = torch.rand(num_seqs, max_len + 1, vocab, **f64) * 4

    def qkv(self, tokens, positions):
        tokens, positions = torch.tensor(tokens), torch.tensor(positions)
        return self.eq[tokens], self.ek[tokens] + self.pos[positions], self.ev[tokens]

    def sample(self, out, seq_ids, positions) -> list[int]:
        logits = out.reshape(out.shape[0], -1) @ self.unembed
        return (logits + self.noise[seq_ids, positions]).argmax(-1).tolist()


def _dense_generate(model, prompts, n, max_gen):
    done = {}
    for i, prompt in enumerate(prompts):
        for s in range(i * n, i * n + n):
            toks = list(prompt)
            while len(toks) < len(prompt) + max_gen[i]:
                q, k, v = model.qkv(toks, list(range(len(toks))))
                out = _dense_attention(q[-1:], k, v, model.scale)
                toks += model.sample(out, [s], [len(toks)])
            done[s] = toks
    return done


def _paged_generate(model, prompts, n, max_gen, num_blocks, bs, W):
    """The runner's loop in miniature: a prefill step (one prompt, its n samples, the cached
    prefix skipped) whenever the next waiting one fits, else a decode step of every running
    sequence, preempting the youngest when blocks run out; a preempted sequence comes back
    first, its prompt and generated tokens prefilled again (recompute)."""
    t = BlockTables(BlockAllocator(num_blocks, bs))
    cache = PagedKVCache(1, num_blocks, bs, model.hkv, model.d, torch.float64, "cpu")
    k_cache, v_cache = cache.k[0], cache.v[0]
    waiting = deque((i * n, list(p), n) for i, p in enumerate(prompts))
    tokens, done, num_cached = {}, {}, 0
    while waiting or t.tables:
        if waiting and t.can_admit(waiting[0][1], waiting[0][2]):
            seq_id, toks, k = waiting.popleft()
            cached = t.admit(seq_id, toks, k)
            num_cached += cached
            q, kk, vv = model.qkv(toks[cached:], list(range(cached, len(toks))))
            src, dst = t.prefill_slots(seq_id, k, cached)
            cache.write(0, torch.tensor(dst), kk[src], vv[src])
            out = paged_prefill_attention(q, k_cache, v_cache, t.block_table([seq_id], W),
                                          torch.tensor([0, q.shape[0]]),
                                          torch.tensor([len(toks)]), model.scale)
            for s in range(seq_id, seq_id + k):
                tokens[s] = toks + model.sample(out[-1:], [s], [len(toks)])
        else:
            assert t.tables, "a waiting prompt that never fits"
            for s in t.preempt_for_decode(sorted(t.tables)):
                waiting.appendleft((s, tokens.pop(s), 1))
            rows = sorted(t.tables)
            slots = [block * bs + offset for block, offset in map(t.append_slot, rows)]
            pos = [len(tokens[s]) - 1 for s in rows]
            q, kk, vv = model.qkv([tokens[s][-1] for s in rows], pos)
            cache.write(0, torch.tensor(slots), kk, vv)
            out = paged_decode_attention(q, k_cache, v_cache, t.block_table(rows, W),
                                         torch.tensor(pos) + 1, model.scale)
            for s, x in zip(rows, model.sample(out, rows, [p + 1 for p in pos])):
                tokens[s].append(x)
        t.check()
        for s in [s for s in tokens if len(tokens[s]) == len(prompts[s // n]) + max_gen[s // n]]:
            t.finish(s)
            done[s] = tokens.pop(s)
    assert t.allocator.num_free == num_blocks
    return done, t.num_preemptions, num_cached


def test_toy_generation_with_sharing_and_preemption_equals_dense_generation():
    g, rng = torch.Generator().manual_seed(0), random.Random(0)
    stems = [[rng.randrange(11) for _ in range(10)] for _ in range(2)]    # common prefixes
    prompts = [stems[0][:9], stems[0][:9], stems[0][:6], stems[1][:8], stems[1][:10],
               stems[0][:3], stems[1][:5] + [1, 2, 3], stems[0][:9]]
    max_gen, n = [rng.randint(3, 8) for _ in prompts], 2
    model = _ToyModel(g, num_seqs=n * len(prompts))
    want = _dense_generate(model, prompts, n, max_gen)
    got, preemptions, cached = _paged_generate(model, prompts, n, max_gen, num_blocks=14,
                                               bs=4, W=5)
    assert got == want and preemptions > 0 and cached > 0


TRITON_CHECK = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"          # Triton's CPU interpreter
import hybridengine.kernels.decode_attention as da
from hybridengine.kernels.paged_decode_attention import (paged_decode_attention,
                                                         paged_decode_attention_rope)
from hybridengine.models.attention import RotaryEmbedding, apply_rope
from hybridengine.rollout import paged_cache
torch.manual_seed(0)
d, num_blocks, W = 64, 20, 6
rope = RotaryEmbedding(d, 10000.0)
# 64 "SMs": several splits (empty ones too) and the merge; 1: one split. A block_size of 5:
# tiles straddle blocks. The last row is a CUDA-graph padding row (the scratch block).
for hq, hkv, bs, dtype, tol, sms in ((14, 2, 16, torch.float32, 1e-5, 64),
                                     (9, 3, 5, torch.float16, 2e-3, 1),
                                     (9, 3, 5, torch.float32, 1e-5, 64)):
    da._num_sms = lambda device, n=sms: n
    k, v = (torch.randn(num_blocks + 1, bs, hkv, d).to(dtype) for _ in range(2))
    lens = torch.tensor([1, bs, bs + 1, W * bs, 1], dtype=torch.int32)
    bt = torch.full((5, W), num_blocks, dtype=torch.int32)
    for b in range(4):
        bt[b, :-(-int(lens[b]) // bs)] = torch.randperm(num_blocks)[:-(-int(lens[b]) // bs)].int()
    qkv = torch.randn(5, hq + 2 * hkv, d).to(dtype)
    q = qkv[:, :hq]                                   # strided, as the decoder hands it over
    out = paged_decode_attention(q, k, v, bt, lens, 0.2)
    ref = paged_cache.paged_decode_attention(q.double(), k.double(), v.double(), bt, lens, 0.2)
    err = (out.double() - ref).abs().max().item()
    assert out.dtype == dtype and out.shape == q.shape and err < tol, (hq, bs, dtype, err)
    # the fused form: q and k_new rotated, k_new / v_new written at each row's slot (position
    # lens - 1 through its table; the padding row's: the scratch block), the new token from
    # registers; against apply_rope (tables rounded as it does), the write, the reference
    pos = (lens - 1).long()
    slot_mapping = bt[torch.arange(5), pos // bs].long() * bs + pos % bs
    slot_mapping[-1] = num_blocks * bs
    cos, sin = rope(pos)
    k_new, v_new = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    kc, vc = k.clone(), v.clone()
    # the lengths and tables come from the runner's state by row id (rows in any order; the
    # other rows' entries out of range, so that reading one would fail)
    rows = torch.tensor([3, 0, 6, 1, 7])
    row_positions = torch.full((8,), 10 ** 6, dtype=torch.long).index_copy_(0, rows, pos)
    row_tables = torch.full((8, W), 10 ** 6, dtype=torch.int32).index_copy_(0, rows, bt)
    out = paged_decode_attention_rope(q, k_new, v_new, cos, sin, kc, vc, row_tables,
                                      slot_mapping, rows, row_positions, W * bs)
    qk = apply_rope(qkv[:, :hq + hkv].float(), cos.to(dtype).float(), sin.to(dtype).float())
    qk = qk.to(dtype)
    kf, vf = k.view(-1, hkv, d), v.view(-1, hkv, d)
    kf[slot_mapping], vf[slot_mapping] = qk[:, hq:], v_new
    assert torch.equal(kc, k) and torch.equal(vc, v), (hq, bs, dtype)     # bit for bit
    ref = paged_cache.paged_decode_attention(qk[:, :hq].double(), k.double(), v.double(), bt,
                                             lens, d ** -0.5)
    err = (out.double() - ref).abs().max().item()
    assert out.dtype == dtype and err < tol, (hq, bs, dtype, err, "rope")
# the prefill's Triton cache write takes (block, offset) for (slot, position) unchanged
from hybridengine.kernels.kv_write import write_kv_rows
cache = paged_cache.PagedKVCache(1, num_blocks, 5, 2, 16, torch.float32, torch.device("cpu"))
kk, vv = (torch.randn(30, 2, 16) for _ in range(2))
slots = torch.randperm(num_blocks * 5)[:30]
cache.write(0, slots, kk, vv)
k, v = torch.zeros_like(cache.k[0]), torch.zeros_like(cache.v[0])
write_kv_rows(k, v, slots // 5, slots % 5, kk, vv, torch.arange(30))
assert torch.equal(k, cache.k[0]) and torch.equal(v, cache.v[0])
# The engine on the paged layout with the triton backend (RoPE and the cache write fused into
# the kernel, or before it), eager and graph-shaped, with preemption and prefix hits: the
# static layout's greedy tokens and log-probs
from dataclasses import replace
from hybridengine.kernels.settings import RolloutKernelSettings
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
model = Decoder(cfg)
prompts = [[1, 2, 3], [7] * 20, [4, 9], [7] * 20 + [5]]
params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
base = RolloutConfig(max_num_seqs=4, max_model_len=32, max_prefill_tokens=64,
                     attn_backend="sdpa")
ref = Engine(model, base).generate(prompts, params)
for fused, graph_shaped in ((True, True), (False, False)):
    engine = Engine(model, replace(base, attn_backend="triton", kv_layout="paged", block_size=4,
                                   kv_cache_tokens=12 * 4,
                                   kernels=RolloutKernelSettings(fused_rope=fused)))
    engine.runner.static_shapes = graph_shaped
    got = engine.generate(prompts, params)
    assert engine.runner.backend == "triton" and engine.stats["num_preemptions"] > 0
    assert engine.stats["num_prefix_cached_tokens"] > 0
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids, (fused, graph_shaped)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
print("ok")
"""


def test_triton_paged_decode_attention_matches_the_reference_in_the_interpreter():
    """The Triton paged kernel, plain and with RoPE and the cache write fused, against
    paged_cache.paged_decode_attention (fp64), the prefill's Triton cache write into blocks, and
    the paged engine on the triton backend against the static engine, run by Triton's CPU
    interpreter in a fresh process (TRITON_INTERPRET=1 before the import)."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_kv_cache_tokens_beyond_the_device_is_one_clear_error(monkeypatch):
    """An explicit KV budget larger than the device's free memory fails before any layer is
    allocated, naming the field (session 18: the 7B long benchmark ran out of memory inside
    the allocation); the budget path and the CPU are never checked."""
    from hybridengine.rollout.kv_cache import check_fits_device
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 2**31))
    with pytest.raises(ValueError, match=r"kv_cache_tokens=4096 needs 2\.00 GiB .* 1\.00 GiB"):
        check_fits_device(2**31, 4096, "cuda")
    check_fits_device(2**29, 4096, "cuda")
    check_fits_device(2**31, None, "cuda")
    check_fits_device(2**40, 4096, "cpu")
