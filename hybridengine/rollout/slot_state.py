"""The model runner's per-slot state, on the device (index = cache slot; the last one is scratch):

    tokens, positions   the last sampled token and its position (the next decode's input)
    counts, max_gen     tokens generated so far / allowed
    keys, active        random key of the occupant; still generating
    out_tok/lp/slp      [slots + 1, max_model_len + 1] the occupant's outputs so far

and the result buffers of one generate call (res_tok/lp/slp [N, max_gen], res_len [N]). A step
writes its rows' sampled tokens and counters back with `commit`, on the device; the host learns
which rows finished from a [B] bool copied into pinned memory and read one step later
(`Pending`), so it never waits for the step it just launched. When the host frees a finished
slot, `collect` copies the slot's outputs to the result buffers (in stream order, before any
prefill reuses the slot); `results` moves them to the host once per generate call.
"""
from __future__ import annotations

import numpy as np
import torch


def h2d(values, device: torch.device) -> torch.Tensor:
    """Host int64 values (a list or a numpy array) on the device without synchronising
    (pinned, non-blocking: the pinned allocator keeps the buffer until the copy has run)."""
    t = torch.as_tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def h2d_into(dst: torch.Tensor, values: np.ndarray) -> None:
    """Host int64 values copied into the device tensor dst without synchronising (as h2d,
    with no device tensor of their own in between)."""
    t = torch.from_numpy(values)
    dst.copy_(t.pin_memory() if dst.device.type == "cuda" else t, non_blocking=True)


class Pending:
    """The finished flags of one step, readable without stalling the device queue."""

    def __init__(self, slots: list[int], fin: torch.Tensor):
        self.slots = slots
        self.event = None
        if fin.is_cuda:
            self.host = torch.empty(fin.shape, dtype=torch.bool, pin_memory=True)
            self.host.copy_(fin, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = fin.clone()

    def finished_slots(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return [s for s, f in zip(self.slots, self.host.tolist()) if f]


class SlotState:
    """The per-slot tensors of num_slots cache slots (+ scratch) of max_model_len tokens."""

    def __init__(self, num_slots: int, max_model_len: int, device: torch.device):
        S, L = num_slots, max_model_len
        self.device = device
        long = dict(dtype=torch.long, device=device)
        self.tokens, self.positions, self.counts, self.max_gen, self.keys = (
            torch.zeros(S + 1, **long) for _ in range(5))
        self.active = torch.zeros(S + 1, dtype=torch.bool, device=device)
        self.out_tok = torch.zeros(S + 1, L + 1, **long)
        self.out_lp = torch.zeros(S + 1, L + 1, dtype=torch.float32, device=device)
        self.out_slp = torch.zeros_like(self.out_lp)

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens, self.positions, self.counts, self.max_gen, self.keys, self.active,
                self.out_tok, self.out_lp, self.out_slp]

    def begin(self, num_seqs: int, max_gen: int) -> None:
        """No slot active; result buffers for num_seqs sequences of up to max_gen tokens."""
        self.active.zero_()
        self.res_width = max_gen
        dev = self.device
        self.res_tok = torch.zeros(num_seqs, max_gen, dtype=torch.long, device=dev)
        self.res_lp = torch.zeros(num_seqs, max_gen, dtype=torch.float32, device=dev)
        self.res_slp = torch.zeros_like(self.res_lp)
        self.res_len = torch.zeros(num_seqs, dtype=torch.long, device=dev)

    def results(self):
        """(tokens, logprobs, sampled_logprobs [N, max_gen], lengths [N]) on the host."""
        return tuple(t.cpu() for t in (self.res_tok, self.res_lp, self.res_slp, self.res_len))

    def collect(self, s: torch.Tensor, r: torch.Tensor) -> None:
        """Copy the outputs of slots s to result rows r (device index tensors)."""
        W = self.res_width
        self.res_tok.index_copy_(0, r, self.out_tok.index_select(0, s)[:, :W])
        self.res_lp.index_copy_(0, r, self.out_lp.index_select(0, s)[:, :W])
        self.res_slp.index_copy_(0, r, self.out_slp.index_select(0, s)[:, :W])
        self.res_len.index_copy_(0, r, self.counts.index_select(0, s))

    def commit(self, slots, tok, logprob, sampled, stop_ids) -> torch.Tensor:
        """Record one sampled token per row [B] and return the rows that finished [B] bool (a
        stop_ids token, or max_gen tokens). Inactive rows (padding, or finished one step ago)
        change nothing that is kept: their outputs land past their length, their counters do
        not move."""
        # (index_put_ on whole state tensors: in place under torch.compile too; duplicate
        # indices occur only for the scratch slot)
        act = self.active[slots]
        cnt, pos = self.counts[slots], self.positions[slots]
        col = cnt.clamp(max=self.out_tok.shape[1] - 1)
        self.out_tok[slots, col] = tok
        self.out_lp[slots, col] = logprob
        self.out_slp[slots, col] = sampled
        stop = (tok.unsqueeze(1) == stop_ids).any(-1)
        fin = act & (stop | (cnt + 1 >= self.max_gen[slots]))
        inc = act.long()
        self.counts[slots] = cnt + inc
        self.positions[slots] = pos + inc
        self.tokens[slots] = torch.where(act, tok, self.tokens[slots])
        self.active[slots] = act & ~fin
        return fin
