"""The training layer: the trainer and its step, checkpoints and run folders, evaluation, generation, monitoring
(health, memory, OOM), profiling. May import everything below it (base, config, model, weights, data, parallel),
except the planner. The hand-written parallel layouts, which use its schedule, are labkit.byhand, one layer up."""
