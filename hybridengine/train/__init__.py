"""The training runtime: one role's model with its pipeline schedule and optimizer (TrainEngine),
the distributed optimizer and its learning-rate schedule, host offload, sharded checkpoints.
Usable without RL (tests, benchmarks); built on parallel (groups, TP layers) and models."""
