"""Seconds per training step of a model preset on this machine, to put other costs (data loading) in proportion."""
from __future__ import annotations

import time

import numpy as np

from labkit.config import model_preset
from labkit.logs import quiet_mindformers
from labkit.model.llama import build_model


def model_step_seconds(seq_len: int = 128, micro_batch: int = 8, steps: int = 2, preset: str = "tiny") -> float:
    """Seconds per training step (forward, backward, AdamW; graph mode) of a model preset on this machine, to put
    the loader's time per step in proportion. Compilation is excluded."""
    import mindspore as ms
    from mindspore import nn



    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = model_preset(preset)
    quiet_mindformers()  # imports mindformers (without torch, HF datasets, nltk) and keeps its console quiet
    model = build_model(cfg, seq_length=seq_len, batch_size=micro_batch, seed=0)
    model.set_train(True)
    step = nn.TrainOneStepCell(model, nn.AdamWeightDecay(model.trainable_params(), 1e-4))
    x = ms.Tensor(np.random.default_rng(0).integers(0, cfg.vocab_size, (micro_batch, seq_len + 1)), ms.int32)
    step(x).asnumpy()  # compile
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x).asnumpy()
    return (time.perf_counter() - t0) / steps
