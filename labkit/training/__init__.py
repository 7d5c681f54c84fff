"""The training layer: the trainer and its step, checkpoints and run folders, evaluation, generation, monitoring
(health, memory, OOM), profiling, and the hand-written parallel layouts. May import everything below it (base,
config, model, weights, data, parallel), except the planner."""
