"""Which parts of which role live on the device in each phase of a step (megatron.*_offload).

With `param_offload`, `grad_offload` or `optimizer_offload` set for a role (verl's keys, under
`actor_rollout_ref.actor.megatron`, `actor_rollout_ref.ref.megatron` and `critic.megatron`), that
part lives in host memory except in the phases that use it:

    phase           actor                       ref       critic
    rollout         params (the gather reads    -         -
                    them; parked again after it
                    unless the generation model
                    shares them)
    old_log_prob    params                      -         -
    ref             -                           params    -
    values          -                           -         params
    update_critic   -                           -         params, grads, optimizer
    update_actor    params, grads, optimizer    -         -
    save / resume   params, optimizer           -         params, optimizer

So the actor's optimizer state is off the device during generation (room for the KV cache) and
each role's gradients and optimizer state are off it while the other role updates (a lower
peak). Gradient buffers hold nothing between updates, so grad_offload frees them without a copy.
A phase not in the table (advantages, setup) changes nothing. The price is the host-device
copies, timed as timing_s/offload.
"""
from __future__ import annotations

from hybridengine.train.engine import PARTS, TrainEngine

PHASE_USES: dict[str, dict[str, tuple[str, ...]]] = {
    "rollout": {"actor": ("params",)},
    "validate": {"actor": ("params",)},
    "old_log_prob": {"actor": ("params",)},
    "ref": {"ref": ("params",)},
    "values": {"critic": ("params",)},
    "update_critic": {"critic": PARTS},
    "update_actor": {"actor": PARTS},
    "update_critic_actor": {"actor": PARTS, "critic": PARTS},     # rl.roles.INTERLEAVED
    "save": {"actor": ("params", "optimizer"), "critic": ("params", "optimizer")},
    "resume": {"actor": ("params", "optimizer"), "critic": ("params", "optimizer")},
}

# part -> its key under a role's `megatron` section
OFFLOAD_FLAGS = {"params": "param_offload", "grads": "grad_offload",
                 "optimizer": "optimizer_offload"}


def offload_parts(megatron_cfg, has_optimizer: bool) -> tuple[str, ...]:
    """The parts a role's megatron config asks to offload (a role without an optimizer, the
    reference, only has params)."""
    parts = PARTS if has_optimizer else PARTS[:1]
    # (optimizer_offload=host_step keeps the optimizer on the host for good: nothing to move)
    return tuple(p for p in parts if getattr(megatron_cfg, OFFLOAD_FLAGS[p]) is True)


class Residency:
    """roles: name -> (engine, parts it may offload). Call enter(phase) before each phase."""

    def __init__(self, roles: dict[str, tuple[TrainEngine, tuple[str, ...]]]):
        self.roles = {n: (e, parts) for n, (e, parts) in roles.items() if parts}
        self.seconds = 0.0
        # the latest entry of each phase (and "generation"): role -> device bytes parked
        self.parked_by_phase: dict[str, dict[str, int]] = {}

    def enter(self, phase: str) -> None:
        uses = PHASE_USES.get(phase)
        if uses is None or not self.roles:
            return
        for name, (engine, parts) in self.roles.items():
            need = uses.get(name, ())
            self.seconds += engine.unpark([p for p in parts if p in need])
            self.seconds += engine.park([p for p in parts if p not in need])
        self.parked_by_phase[phase] = {n: e.parked_bytes() for n, (e, _) in self.roles.items()}

    def after_gather(self, gen_model) -> None:
        """The actor's weights the generation model does not share go to the host."""
        if "params" in self.roles.get("actor", (None, ()))[1]:
            engine = self.roles["actor"][0]
            self.seconds += engine.park(["params"], skip=list(gen_model.parameters()))
            self.parked_by_phase["generation"] = {"actor": engine.parked_bytes()}

    def before_gather(self) -> None:
        """The actor's weights on the device again (a second rollout within a step: DAPO)."""
        if "params" in self.roles.get("actor", (None, ()))[1]:
            self.seconds += self.roles["actor"][0].unpark(["params"])

    def unpark_all(self) -> None:
        """Everything back on the device (the end of fit: callers may read any tensor)."""
        for engine, parts in self.roles.values():
            self.seconds += engine.unpark(parts)

    def pop_metrics(self) -> dict[str, float]:
        if not self.roles:
            return {}
        out = {"timing_s/offload": self.seconds}
        self.seconds = 0.0
        return out
