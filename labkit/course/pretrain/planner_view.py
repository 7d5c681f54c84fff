"""The planner's view of one layout of notebook 07's run: its row (memory and time, with labkit's partial
recomputation), the batch arithmetic for one dp, and whether this machine has the devices for its share."""
from __future__ import annotations

from labkit.doctor.env import collect_hardware
from labkit.errors import LabkitError
from labkit.parallel import planner
from labkit.parallel.memory import Numerics


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def estimate(model, machine, layout, *, seq_len: int, amp_level: str, flash_attention: bool):
    """The planner's Strategy for one layout. labkit recomputes whole layers (`last:K` etc.): memory and time are the
    planner's rows for Recompute.planner_modes (`none` and `full`) weighted by the fraction of layers recomputed.
    `machine`: a labkit.parallel.planner.Machine; `layout`: a labkit.layout.Layout."""
    lay, memory_gib, devices = layout, machine.device_memory_gib, machine.devices
    dp, mp, pp = lay.dp, lay.mp, lay.pp
    modes = lay.recompute.planner_modes(model.num_layers)
    frac = list(modes.values())[-1]  # the weight of the last mode (full); the first one's is 1 - frac
    rows = {}
    for rc in modes:
        res = planner.plan(model, machine, seq_len=seq_len, global_batch=lay.global_batch,
                           numerics=Numerics(amp_level=amp_level,
                                             flash_attention=flash_attention),
                           constraints={**lay.row(), "recompute": rc}, optimizer=lay.optimizer)
        if not res["strategies"]:
            raise LabkitError(f"dp {dp} x mp {mp} x pp {pp} cannot run this model: "
                              + ("; ".join(res["skipped"]) or "no valid strategy"))
        rows[rc] = res["strategies"][0]
    lo, hi = rows[next(iter(modes))], rows[list(modes)[-1]]
    mix = lambda a, b: a + (b - a) * frac  # noqa: E731
    mem = {k: round(mix(lo.memory_gib[k], hi.memory_gib[k]), 3) for k in lo.memory_gib}
    step = mix(lo.step_time_s, hi.step_time_s)
    tokens = lay.global_batch * seq_len
    return planner.Strategy(layout=lay, memory_gib=mem, stage=lo.stage, params_per_device=lo.params_per_device,
                            step_time_s=step, time_s={k: mix(lo.time_s[k], hi.time_s[k]) for k in lo.time_s},
                            tokens_per_s=tokens / step, tokens_per_s_per_device=tokens / step / devices,
                            mfu=lo.mfu * lo.step_time_s / step, fits=mem["total"] <= memory_gib,
                            why_not=planner.why_not(mem, memory_gib))


def split_batch(g_fixed, mb_param, accum_param, mb_config: int, dp: int):
    """(micro_batch, accum, global_batch, None) for one dp, or (.., reason) when the arithmetic cannot work."""
    if g_fixed is None:  # micro_batch and accum both given: the global batch follows
        return mb_param, accum_param, mb_param * dp * accum_param, None
    if g_fixed % dp:
        return None, None, g_fixed, f"global_batch {g_fixed} is not divisible by dp {dp}"
    per = g_fixed // dp
    if mb_param is not None:
        if per % mb_param:
            return None, None, g_fixed, (f"micro_batch {mb_param} does not divide global_batch / dp = "
                                         f"{g_fixed} / {dp} = {per}")
        mb = mb_param
    else:
        mb = max(d for d in divisors(per) if d <= max(1, mb_config))
    acc = per // mb
    if accum_param is not None and accum_param != acc:
        return None, None, g_fixed, (f"micro_batch {mb} x dp {dp} x accum {accum_param} = "
                                     f"{mb * dp * accum_param}, not global_batch {g_fixed}")
    return mb, acc, g_fixed, None


def shortfall(target: str, workers: int) -> str | None:
    """None when this machine has the devices for its share of the run, else why not."""
    if target == "CPU":
        return None

    hw = collect_hardware()
    have = len(hw["npus"] if target == "Ascend" else hw["nvidia_gpus"])
    if have < workers:
        return f"this machine has {have} {target} device(s) and the run needs {workers} per node"
    return None
