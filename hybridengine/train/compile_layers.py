"""The compiled decoder layers of training (actor.use_torch_compile): how TrainEngine compiles
them, and with which inductor options."""
from __future__ import annotations

import json
import os

from hybridengine.models.decoder import Decoder, LayerGroup, ModelConfig

TRAIN_INDUCTOR_OPTIONS_ENV = "HYBRIDENGINE_TRAIN_INDUCTOR_OPTIONS"
TRAIN_LAYER_GROUP_ENV = "HYBRIDENGINE_TRAIN_LAYER_GROUP"


def compile_decoder_layers(model: Decoder, backend: str = "inductor",
                           group: int | None = None) -> None:
    """torch.compile each decoder layer of `model` in place (actor.use_torch_compile): per layer,
    dynamic shapes (packed micro-batches change T every call). The layers share their code, so
    a process compiles one graph per grad mode (forward-only, training) and layer setup (dtype,
    TP / SP), whatever the micro-batches' lengths (tests/test_compile_bound.py). Tests pass
    backend="aot_eager" to run the same setup on the CPU.

    group > 1 (default: HYBRIDENGINE_TRAIN_LAYER_GROUP, else 1): `group` consecutive layers are
    compiled as one unit (models.decoder.LayerGroup; the last may hold fewer: one more graph).
    The updates are host-bound (bench/RESULTS.md sessions 23-27): each compiled call and its
    autograd node cost host time per micro-batch, 2 x 24 of them a forward and backward at
    0.5B; a group of 24 makes it 2. The cost: a unit's backward returns all its parameters'
    gradients at once, so up to a unit's worth of them is alive before the accumulation hooks
    (train.optimizer) free them, where one layer's was (the whole model's at group = all
    layers: +2 bytes a parameter in bf16), and its graph compiles longer. An experiment switch
    until a GPU run has timed it (bench/gpu_session.sh group_ab). With
    recomputation (model.recompute_layers, set before) the units stay single layers: each is
    what a checkpoint recomputes."""
    cuda = next(model.parameters()).is_cuda
    options = training_inductor_options(model.cfg, cuda) if backend == "inductor" else None
    group = layer_group_size() if group is None else group
    if group > 1 and not model.recompute_layers:
        layers = list(model.layers)
        model.layer_groups = [LayerGroup(layers[i:i + group])
                              for i in range(0, len(layers), group)]
    for unit in model.layer_groups or model.layers:
        unit.compile(dynamic=True, backend=backend, options=options)


def layer_group_size() -> int:
    """HYBRIDENGINE_TRAIN_LAYER_GROUP: decoder layers per compiled unit (1 when unset)."""
    raw = os.environ.get(TRAIN_LAYER_GROUP_ENV, "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{TRAIN_LAYER_GROUP_ENV}={raw!r}: layers per compiled unit, an "
                         f"integer >= 1")
    return int(raw)


def training_inductor_options(model_config: ModelConfig | None = None,
                              cuda: bool = True) -> dict:
    """Inductor options of the compiled training layers. Inductor fuses a norm's two backward
    reductions of different loop orders (its mix-order reduction) only above 5 Mi elements;
    with T dynamic that choice becomes a guard on T (576*T < 5242880 at hidden 576), so a
    micro-batch that crossed it compiled the layers again mid-run (0.7-2.7 s at steps 3 and 21
    of SmolLM2 GRPO runs on an H200, bench/RESULTS.md 2026-12-01 session 12). Off, the layers
    keep one graph per grad mode whatever the micro-batches' lengths.

    Inductor's C++ wrapper (`cpp_wrapper`, CUDA only: the engine compiles on CUDA; the CPU's
    compiled-layer tests keep the Python wrapper): the layers' generated code calls kernels from
    C++ instead of Python. The updates are host-bound (a layer's forward and backward spend more
    host time than kernel time: bench/RESULTS.md session 23) and a Triton launch from inductor's
    Python wrapper costs ~25 us (PPO seed step 38.2k against 36.2k tok/s, session 24). Its cost
    is the wrapper's C++ compile: the PPO seed step's compile took 128 s cold on an H200 against
    48 s with the Python wrapper's cache warm (its artefacts go to inductor's cache as the
    others do; a warm C++ start is not timed yet). Not for soft-capped attention (Gemma 2): its
    layers call the Python custom op models.spec_attention, which the C++ wrapper reaches
    through its Python-op bridge, never run on a GPU here (torch 2.11's bridge refused
    varlen_attn's List[int] argument, bench/RESULTS.md session 23).
    HYBRIDENGINE_TRAIN_INDUCTOR_OPTIONS (JSON) overrides or adds options, for experiments."""
    from torch._inductor import config
    options = {"triton.mix_order_reduction": False} \
        if hasattr(config.triton, "mix_order_reduction") else {}
    options["cpp_wrapper"] = cuda and (model_config is None or model_config.attn_softcap is None)
    extra = os.environ.get(TRAIN_INDUCTOR_OPTIONS_ENV, "").strip()
    if extra:       # benchmarks' experiments, e.g. '{"cpp_wrapper": true}'
        try:
            parsed = json.loads(extra)
        except json.JSONDecodeError as e:
            raise ValueError(f"{TRAIN_INDUCTOR_OPTIONS_ENV}: not a JSON object ({e})") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{TRAIN_INDUCTOR_OPTIONS_ENV}: not a JSON object: {extra}")
        options.update(parsed)
    return options
