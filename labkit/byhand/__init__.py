"""Parallelism by hand on CPU workers (msrun): the hand-written Llama (labkit.model.scratch) trained with every
parallel dimension written out, one module per dimension, its communication beside it. May import base, config,
model, data and training (the lr schedule); not the planner (labkit.parallel), which estimates what these measure.

    comm                Group, its counted collectives (CPU stand-ins), Traffic and the Op names by dimension
    mappings            each collective with its backward, one named function (Megatron's mappings.py)
    tensor_parallel     tensor, sequence and vocabulary parallel: the model's hooks, the vocab-parallel loss
    context_parallel    context parallel: ring attention and Ulysses, the balanced (zigzag) split
    pipeline_parallel   p stages, GPipe and 1F1B: the schedule (the simulator's too), stage-to-stage transfers
    data_parallel       data parallel and ZeRO-1/2: the optimizers, flat sharded buffers
    optimizer_parallel  MindSpore's optimizer parallel, levels 1-3 (the weights sharded too)
    worker              HandLayout (the grid of one run), a worker's parameters, groups and step
    runs                the msrun worker program (python -m labkit.byhand.runs) and its RankResult
    shards              each worker's shard of a checkpoint in MindSpore's files, its strategy (ParallelStrategyMap)
    reshard             a sharded checkpoint checked, merged by hand or by MindSpore's tools, cut for another layout
    ckpt_commands       labkit ckpt inspect | merge | reshard"""
