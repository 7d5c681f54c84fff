"""The learning-rate schedule: linear warmup, then cosine to min_lr. `lr_at` is the host-side formula (logged and
taught); `WarmupCosine` is the same schedule inside the graph, the one the optimizer really uses."""
from __future__ import annotations

import math


def lr_at(step: int, cfg) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine to min_lr at decay_steps, then flat (step is 0-based:
    the lr used by update number step+1)."""
    t = step + 1
    if cfg.warmup_steps and t <= cfg.warmup_steps:
        return cfg.lr * t / cfg.warmup_steps
    span = max(1, cfg.decay_steps - cfg.warmup_steps)
    progress = min(1.0, (t - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def WarmupCosine(t):
    """The schedule as a MindSpore LearningRateSchedule (evaluated in-graph from the optimizer's global_step,
    which checkpoints store), equal to `lr_at`."""
    import mindspore as ms
    from mindspore import ops
    from mindspore.nn.learning_rate_schedule import LearningRateSchedule

    class _WarmupCosine(LearningRateSchedule):
        def construct(self, global_step):
            step = global_step.astype(ms.float32) + 1.0
            warm = t.lr * step / max(t.warmup_steps, 1)
            span = float(max(1, t.decay_steps - t.warmup_steps))
            progress = ops.clip_by_value((step - t.warmup_steps) / span, 0.0, 1.0)
            cos = t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + ops.cos(math.pi * progress))
            return ops.select(step <= t.warmup_steps, warm, cos) if t.warmup_steps else cos

    return _WarmupCosine()
