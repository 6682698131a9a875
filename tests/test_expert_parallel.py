"""Expert parallelism (issue 29; parallel.layout, parallel.experts, models.moe): test_moe_model's
tiny Qwen3-MoE (a dense layer among sparse ones) and Mixtral, 4 experts, on 4 gloo ranks in one
launch: logits = transformers' at ep 2 and 4 (and tp 2 x ep 2, SP on), every replica with
different tokens; float64 gradients at ep 2 with the router losses on = one process's over the
same batches; the HybridEngine's switch to rollout TP 1 / 2 gives every rank every expert
(exact), its bytes counted from the collectives issued; 3 AdamW steps (router losses on) agree
with one process at ep 2, ep 4 and tp 2 x ep 2, and the HF checkpoint saved from ep 2 loads in
transformers."""
import json

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_dist
from hybridengine.hybrid.reshard import HybridEngine
from hybridengine.models.attention import PackedInput
from hybridengine.models.decoder import Decoder
from hybridengine.models.hf import first_expert, load_decoder, load_hf_weights, \
    read_model_config
from hybridengine.models.moe import is_expert_param
from hybridengine.parallel import tensor as ptensor
from hybridengine.parallel.layout import GenLayout, Layout
from hybridengine.parallel.mesh import build_gen_mesh, build_mesh
from hybridengine.train.engine import MicroBatch, OptimConfig, TrainEngine
from model_utils import rel_err

CASES = ["qwen3_moe", "mixtral"]
VOCAB, REPLICAS, NUM_MICRO, STEPS = 97, 4, 2, 3
LENGTHS = [7, 12, 5, 9, 11, 6, 8, 10]
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5, bucket_mb=0.01)
ROUTER_LOSSES = (0.3, 0.05)
# (tp, pp, dp, ep) on 4 ranks
LOGIT_LAYOUTS = [(1, 1, 4, 2), (1, 1, 4, 4), (2, 1, 2, 2)]
STEP_LAYOUTS = [(1, 1, 4, 2), (1, 1, 4, 4), (2, 1, 2, 2)]
RESHARD = [((2, 1, 2, 2), 1), ((2, 1, 2, 2), 2), ((1, 1, 4, 4), 1)]


def _seqs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _logits(model, seqs, tp):
    packed = PackedInput.from_lengths(torch.cat(seqs), [len(s) for s in seqs], multiple_of=tp)
    with torch.no_grad():
        return packed.strip(model.logits(model(packed)))


def _layout(lay):
    return Layout(lay[0], lay[1], lay[2], sequence_parallel=True, ep=lay[3])


def _mine(seqs, replica):
    """A replica's own order of the sequences: different tokens at every position."""
    return seqs[replica:] + seqs[:replica]


def _with_router_losses(model):
    for layer in model.layers:
        if hasattr(layer.mlp, "aux_loss_coef"):
            layer.mlp.aux_loss_coef, layer.mlp.z_loss_coef = ROUTER_LOSSES
    return model


def _replica_loss(model, seqs, tp):
    packed = PackedInput.from_lengths(torch.cat(seqs), [len(s) for s in seqs], multiple_of=tp)
    targets = torch.roll(packed.input_ids, -1)
    logp, _ = model.logprob_entropy(model(packed), targets)
    return -packed.strip(logp).sum() / 100.0


def _reference_grads(model_dir):
    """One process, float64: every replica's batch through the model, gradients summed."""
    model = _with_router_losses(load_decoder(model_dir, dtype=torch.float64)).train()
    for r in range(REPLICAS):
        _replica_loss(model, _mine(_seqs(), r)[:4], 1).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# --- training: 3 AdamW steps -----------------------------------------------------------------

def _microbatches(step, replicas, replica, tp):
    g = torch.Generator().manual_seed(100 + step)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g)
            for n in torch.randint(3, 12, (16,), generator=g).tolist()]
    total = sum(len(s) - 1 for s in seqs)
    mine = seqs[replica::replicas]
    per = len(mine) // NUM_MICRO
    mbs = []
    for i in range(NUM_MICRO):
        chunk = mine[i * per:(i + 1) * per]
        packed = PackedInput.from_lengths(torch.cat(chunk), [len(s) for s in chunk],
                                          multiple_of=tp)
        mask = torch.cat([torch.arange(len(s)) < len(s) - 1 for s in chunk]).double()
        mbs.append(MicroBatch(packed, {"targets": torch.cat([torch.roll(s, -1) for s in chunk]),
                                       "mask": mask}))
    return mbs, total


def train_history(model_dir, mesh, replicas, out_dir, pad_to=1):
    """3 steps on the micro-batches of `replicas` replicas (one process: all of them), packed
    to multiples of pad_to (the sequence-parallel pad, which the router losses skip)."""
    engine = TrainEngine(model_dir, mesh, sequence_parallel=True, optim=OPTIM,
                         dtype=torch.float64, router_losses=ROUTER_LOSSES)
    mine = range(replicas) if mesh.layout.num_replicas == 1 else \
        [mesh.dp_rank * mesh.cp + mesh.cp_rank]
    history = []
    for step in range(STEPS):
        mbs = []
        for r in mine:
            part, total = _microbatches(step, replicas, r, pad_to)
            mbs += part

        def loss_fn(out, mb):
            loss = -(out["logprob"] * mb.tensors["mask"]).sum() / total
            return loss, {"loss": loss.detach()}
        m = engine.train_step(mbs, loss_fn)
        history.append([m["loss"], m["grad_norm"], m["moe/load_balancing_loss"]])
    engine.save_hf(out_dir)
    return history


# --- the 4-rank worker ----------------------------------------------------------------------

class _Counter:
    """Bytes each rank receives through tensor.all_gather_flat (test_reshard's)."""

    def __init__(self):
        self.inner, self.bytes, self.calls = ptensor.all_gather_flat, 0, 0
        ptensor.all_gather_flat = self

    def __call__(self, out, x, group, async_op=False):
        self.bytes += (ptensor.group_size(group) - 1) * x.numel() * x.element_size()
        self.calls += 1
        return self.inner(out, x, group, async_op=async_op)


def _check_logits_and_grads(rank, dirs, refs, worst):
    for lay in LOGIT_LAYOUTS:
        mesh = build_mesh(_layout(lay))
        replica = mesh.dp_rank
        for name in CASES:
            model = load_decoder(dirs[name], mesh, sequence_parallel=True)
            assert len(model.layers[0].mlp.experts) == 4 // lay[3]
            order = _mine(list(range(len(LENGTHS))), replica)
            want = torch.cat([refs[name]["logits"][i] for i in order])
            err = rel_err(_logits(model, _mine(_seqs(), replica), lay[0]), want)
            assert err < 1e-5, (lay, name, err)
            worst[f"logits {lay}"] = max(worst.get(f"logits {lay}", 0.0), err)
            if lay[0] == 1:         # float64 gradients, router losses on: dense over dp,
                model = _with_router_losses(load_decoder(    # experts over expert-dp
                    dirs[name], mesh, dtype=torch.float64)).train()
                _replica_loss(model, _mine(_seqs(), replica)[:4], 1).backward()
                for n, p in model.named_parameters():
                    group = mesh.edp_group if is_expert_param(n) else mesh.dp_group
                    got = ptensor.all_reduce(p.grad.clone(), group)
                    want = refs[name]["grads"][n]
                    if is_expert_param(n):      # this EP rank's experts of the stack
                        want = want[first_expert(model):first_expert(model) + p.shape[0]]
                    err = rel_err(got, want)
                    assert err < 1e-6, (lay, name, n, err)
                    worst[f"grads {lay}"] = max(worst.get(f"grads {lay}", 0.0), err)


def _check_reshard(rank, dirs, refs, counter):
    for lay, gen_tp in RESHARD:
        layout = _layout(lay)
        mesh, gm = build_mesh(layout), build_gen_mesh(GenLayout(layout, gen_tp))
        for name in CASES:
            cfg = read_model_config(dirs[name])
            train = load_decoder(dirs[name], mesh, sequence_parallel=True)
            want = Decoder(cfg, gm.gen_tp_group)
            load_hf_weights(want, dirs[name], gm.gen_tp_rank)
            engine = HybridEngine(cfg, mesh, gm, bucket_mb=0.05)
            counter.bytes = counter.calls = 0
            gen = engine.to_generation(train)
            rep = engine.reports[-1]
            got, ref = dict(gen.named_parameters()), dict(want.named_parameters())
            assert got.keys() == ref.keys()
            for n, p in got.items():
                rows = min(p.shape[0], ref[n].shape[0])   # the training vocabulary padding
                assert torch.equal(p[:rows], ref[n][:rows]) and not p[rows:].any(), (lay, n)
            tag = (lay, gen_tp, name)
            assert rel_err(_logits(gen, _seqs(), 1), torch.cat(refs[name]["logits"])) < 1e-5
            plan, _ = engine.plan(torch.float32)
            stacks = [p for n, p in train.named_parameters() if is_expert_param(n)]
            gathered = (lay[3] - 1) * sum(p.numel() for p in stacks) * 4
            assert counter.bytes == rep.bytes_received == plan.received_numel * 4 + gathered, tag
            # one gather per stacked experts parameter (coalesced under NCCL), no packed copy
            assert counter.calls == rep.num_collectives == plan.num_collectives + len(stacks), \
                tag
            engine.to_training()
            assert all(p.is_meta for p in gen.parameters()), tag     # released


def _worker(rank, world, dirs, refs, tmp):
    worst = {}          # max relative errors, printed by the test (pytest -s)
    _check_logits_and_grads(rank, dirs, refs, worst)
    (tmp / f"worst_{rank}.json").write_text(json.dumps(worst))
    _check_reshard(rank, dirs, refs, _Counter())
    for lay in STEP_LAYOUTS:
        mesh = build_mesh(_layout(lay))
        hist = train_history(dirs["qwen3_moe"], mesh, mesh.layout.num_replicas,
                             tmp / f"out_{lay}", lay[0])
        if rank == 0:
            (tmp / f"hist_{lay}.json").write_text(json.dumps(hist))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from model_utils import save_cases
    from test_moe_model import moe_hf_model
    return save_cases(tmp_path_factory.mktemp("ep"), moe_hf_model, CASES)


def test_layout_groups_and_refusals():
    lay = Layout(2, 1, 2, ep=2)
    assert lay.ep_groups() == [[0, 2], [1, 3]] and lay.edp_groups() == [[0], [1], [2], [3]]
    lay = Layout(1, 1, 2, cp=2, ep=2)       # EP spans data- and context-parallel replicas
    assert lay.ep_groups() == [[0, 1], [2, 3]] and lay.edp_groups() == [[0, 2], [1, 3]]
    assert [lay.ep_rank(r) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 must be positive and"):
        Layout.of_world(1, 1, 4, section="actor.megatron", ep=3)
    from hybridengine.models.decoder import ModelConfig
    moe = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=4, num_experts=4)
    with pytest.raises(ValueError, match="must divide the model's num_experts=4"):
        moe.check_ep(8)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=2, head_dim=4).check_ep(2)


@pytest.mark.multiproc
def test_expert_parallel_logits_grads_reshard_and_steps(dirs, tmp_path):
    from test_moe_model import moe_hf_model
    refs = {}
    for name in CASES:
        hf = moe_hf_model(name)
        with torch.no_grad():
            logits = [hf(s[None]).logits[0] for s in _seqs()]
        refs[name] = {"logits": logits, "grads": _reference_grads(dirs[name])}
    # (tp 2 has 2 replicas, tp 1 4; the references unpadded, the tp 2 layouts padded)
    ref_hist = {replicas: train_history(dirs["qwen3_moe"], build_mesh(Layout()), replicas,
                                        tmp_path / f"ref_{replicas}")
                for replicas in (2, 4)}
    run_dist(_worker, 4, dirs, refs, tmp_path)
    worst = {}
    for r in range(4):
        for k, v in json.loads((tmp_path / f"worst_{r}.json").read_text()).items():
            worst[k] = max(worst.get(k, 0.0), v)
    for lay in STEP_LAYOUTS:
        replicas = lay[2]
        hist = json.loads((tmp_path / f"hist_{lay}.json").read_text())
        for got, want in zip(hist, ref_hist[replicas]):
            assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, want)), (lay, got, want)
            worst[f"steps {lay}"] = max([worst.get(f"steps {lay}", 0.0)] + [
                abs(a - b) / abs(b) for a, b in zip(got, want)])
        saved = load_file(str(next((tmp_path / f"out_{lay}").glob("*.safetensors"))))
        ref = load_file(str(next((tmp_path / f"ref_{replicas}").glob("*.safetensors"))))
        assert saved.keys() == ref.keys()
        for k, v in ref.items():
            assert rel_err(saved[k], v) < 1e-6, (lay, k)
            worst[f"params {lay}"] = max(worst.get(f"params {lay}", 0.0), rel_err(saved[k], v))
    # the checkpoint saved from ep 2 in transformers: its logits = ours from that directory
    from transformers import AutoModelForCausalLM
    out = tmp_path / f"out_{STEP_LAYOUTS[0]}"
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.cat([hf(s[None]).logits[0] for s in _seqs()])
    worst["save ep 2 -> transformers logits"] = rel_err(
        _logits(load_decoder(out, dtype=torch.float32), _seqs(), 1), want)
    print("\nmax relative errors:", json.dumps(worst, indent=1))
    assert worst["save ep 2 -> transformers logits"] < 1e-5
