"""How a training step is spread over devices and what it recomputes: the one vocabulary the config, the trainer,
the planner, the memory model and mindformers' YAML share (`Recompute`, `Layout`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from labkit.errors import LabkitError

RECOMPUTE = ("none", "selective", "full")  # the planner's modes, each for every decoder layer
OPTIMIZER_LEVELS = ("level1", "level2", "level3")  # MindSpore's parallel_optimizer_config.optimizer_level
RECOMPUTE_FORMS = "none, all, last:K, first:K, A-B (layer index range, inclusive), selective or full"
# mindformers 1.9's parallel_config.context_parallel_algo values (modules/transformer/transformer.py,
# ContextParallelAlgo): a ring over key/value blocks, Ulysses' all-to-all (sequence split <-> head split), both
CP_ALGOS = ("colossalai_cp", "ulysses_cp", "hybrid_cp")


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation: what each recomputed decoder layer recomputes in the backward pass (`mode`:
    none; selective = the attention core; full = the whole layer from its input) and which layers do it.

    The layers are a slice of the layer list, `start` to `stop` (exclusive; None = through the last layer); a
    negative `start` counts from the end. Written as text (YAML, `--set`, parameters) in one of RECOMPUTE_FORMS:
    `all` = full on every layer, `last:K` = full on the last K, `first:K`, `A-B`; `selective` and `full` are the
    planner's modes on every layer. str() gives the text back."""

    mode: Literal["none", "selective", "full"] = "none"
    start: int = 0
    stop: int | None = None

    @classmethod
    def parse(cls, value: Any, where: str = "train.recompute") -> Recompute:
        """One of RECOMPUTE_FORMS (or true/false); a LabkitError naming `where` and the accepted forms if not."""
        if isinstance(value, Recompute):
            return value
        if value is None or isinstance(value, bool):
            return cls("full") if value else cls()
        s = str(value).strip().lower()
        try:
            if s in ("none", "off", "false", ""):
                return cls()
            if s in ("all", "full", "true", "on"):
                return cls("full")
            if s == "selective":
                return cls("selective")
            if s.startswith("last:"):
                k = int(s[5:])
                return cls("full", -k) if k > 0 else cls()
            if s.startswith("first:"):
                k = int(s[6:])
                return cls("full", 0, k) if k > 0 else cls()
            if "-" in s:
                a, b = (int(x) for x in s.split("-"))
                if 0 <= a <= b:
                    return cls("full", a, b + 1)
        except ValueError:
            pass
        raise LabkitError(f"{where} = {value!r} is not understood", f"use {RECOMPUTE_FORMS}")

    def __str__(self) -> str:
        if self.mode == "none":
            return "none"
        if self.start == 0 and self.stop is None:
            return "all" if self.mode == "full" else self.mode
        if self.start < 0:
            return f"last:{-self.start}"
        return f"first:{self.stop}" if self.start == 0 else f"{self.start}-{self.stop - 1}"

    def layers(self, num_layers: int, where: str = "train.recompute") -> list[int]:
        """The indices of the recomputed decoder layers of a `num_layers`-layer model."""
        if self.mode == "none":
            return []
        if self.start > 0 and self.stop is not None and self.stop > num_layers:
            raise LabkitError(f"{where} = {str(self)!r} names layers outside the model's",
                              f"use {RECOMPUTE_FORMS} with layers 0..{num_layers - 1}")
        return list(range(num_layers))[self.start:self.stop]

    def fraction(self, num_layers: int) -> float:
        return len(self.layers(num_layers)) / num_layers

    def planner_modes(self, num_layers: int) -> dict[str, float]:
        """The planner's whole-model modes (RECOMPUTE) and the weight of each: the planner's memory and time of
        this recomputation are its rows for these modes, weighted (activations are per layer)."""
        frac = self.fraction(num_layers)
        if self.mode != "full" or frac in (0.0, 1.0):
            return {self.mode if frac else "none": 1.0}
        return {"none": 1 - frac, "full": frac}

    def stage_counts(self, num_layers: int, pp: int) -> list[int]:
        """Layers recomputed per pipeline stage. mindformers' `recompute: [n, ...]` recomputes the FIRST n layers of
        each stage (LayerSetting in 1.9.0); with equal layers per stage that stores the same activations as any
        other n layers of the stage, so `last:16` becomes [16] with one stage."""
        per = num_layers // pp
        idx = self.layers(num_layers)
        return [sum(1 for i in idx if s * per <= i < (s + 1) * per) for s in range(pp)]

    def mindformers(self, num_layers: int | None = None, pp: int = 1) -> dict:
        """mindformers' recompute_config keys `recompute` (true, or layers per stage when only some layers are)
        and `select_recompute`. `num_layers` is needed only when some layers recompute and others do not."""
        flags = {"recompute": self.mode == "full", "select_recompute": self.mode == "selective"}
        if self.mode != "full" or (self.start == 0 and self.stop is None):
            return flags
        if num_layers is None:
            raise LabkitError(f"recompute {str(self)!r} names some layers: mindformers counts them per pipeline stage",
                              "give the model's num_layers")
        frac = self.fraction(num_layers)
        return {**flags, "recompute": frac == 1 if frac in (0.0, 1.0) else self.stage_counts(num_layers, pp)}


@dataclass(frozen=True)
class OptimizerParallel:
    """MindSpore's parallel optimizer, as `parallel.parallel_optimizer_config` and the recompute config set it; in
    force when the layout's `optimizer_shard` (`enable_parallel_optimizer`) is on. MindSpore 2.9's own words
    (`mindspore/context.py`, `set_auto_parallel_context`, `parallel_optimizer_config`): level1 splits the weights
    and the optimizer state over the data-parallel devices, level2 also the gradients (it replaces
    `gradient_accumulation_shard`, which shards the accumulation buffer), level3 also all-gathers the weights again
    before the backward pass "to release the memory used by the forward pass allgather". Parameters smaller than
    `threshold_kb` (shape product x dtype size, KB) are not sharded; `weight_shard_size` caps the shard group
    (-1: the parameter's whole data-parallel group). `comm_recompute` is mindformers'
    `recompute_config.parallel_optimizer_comm_recompute`: the all-gathers of recomputed layers are recomputed."""

    level: Literal["level1", "level2", "level3"] = "level1"
    gradient_accumulation_shard: bool = False
    threshold_kb: int = 64
    weight_shard_size: int = -1
    comm_recompute: bool = False

    def check(self, where: str = "parallel") -> None:
        if self.level not in OPTIMIZER_LEVELS:
            raise LabkitError(f"{where}.optimizer_level = {self.level!r} is not one of MindSpore's",
                              f"use {', '.join(OPTIMIZER_LEVELS)}")
        if self.gradient_accumulation_shard and self.level != "level2":
            raise LabkitError(f"{where}: gradient_accumulation_shard with optimizer_level {self.level}: MindSpore 2.9 "
                              "refuses it (set_parallel_optimizer_config)", "use optimizer_level level2, which "
                              "shards the accumulation buffer itself")
        if self.threshold_kb < 0 or self.weight_shard_size == 0 or self.weight_shard_size < -1:
            raise LabkitError(f"{where}: parallel_optimizer_threshold ({self.threshold_kb} KB) must be >= 0 and "
                              f"optimizer_weight_shard_size ({self.weight_shard_size}) -1 or positive",
                              "as MindSpore's parallel_optimizer_config accepts them")

    def shards_gradients(self) -> bool:
        """Whether the gradients (and the accumulation buffer) are kept 1/shard: level2, level3, or
        gradient_accumulation_shard."""
        return self.level != "level1" or self.gradient_accumulation_shard

    def shard_size(self, dp: int) -> int:
        """Devices one parameter's slices spread over: the data-parallel group, or weight_shard_size when it divides
        it (MindSpore ignores a size that does not)."""
        s = self.weight_shard_size
        return s if 0 < s <= dp and dp % s == 0 else dp


@dataclass(frozen=True)
class Layout:
    """How one training step is spread over devices: data, tensor (model), pipeline and context parallel sizes,
    samples per device per micro-step and micro-steps per optimizer step, recomputation, optimizer states sharded
    over dp (x cp), and sequence parallel (the norms' activations split over mp as well).

    Context parallelism (`cp`, mindformers' parallel_config.context_parallel) splits every sequence over cp devices;
    `cp_algo` is how attention sees the whole sequence (CP_ALGOS): colossalai_cp passes key/value blocks round a
    ring, ulysses_cp swaps the sequence split for a head split with all-to-alls, hybrid_cp does Ulysses over
    `ulysses_degree` (ulysses_degree_in_cp) devices and the ring over the rest. Weights are replicated over cp."""

    dp: int = 1
    mp: int = 1
    pp: int = 1
    micro_batch: int = 1
    accum: int = 1  # micro-steps per optimizer step (pipeline micro-batches with pp > 1)
    recompute: Recompute = Recompute()
    optimizer_shard: bool = False
    sequence_parallel: bool = False
    optimizer: OptimizerParallel = OptimizerParallel()  # how MindSpore shards when optimizer_shard is on
    cp: int = 1  # context parallel: devices one sequence is split over
    cp_algo: str = "colossalai_cp"  # one of CP_ALGOS (ignored with cp 1)
    ulysses_degree: int = 1  # hybrid_cp only: the Ulysses part of cp (mindformers' ulysses_degree_in_cp)

    KEYS = ("dp", "mp", "pp", "cp", "cp_algo", "ulysses_degree", "micro_batch", "accum", "recompute",
            "optimizer_shard")  # a planner row's layout
    CP_DEFAULTS = {"cp": 1, "cp_algo": "colossalai_cp", "ulysses_degree": 1}  # for rows written before cp existed

    @property
    def devices(self) -> int:
        """dp x mp x pp x cp: mindformers requires it to equal the device count (tools/check_rules.py,
        _check_parallel)."""
        return self.dp * self.mp * self.pp * self.cp

    @property
    def ulysses(self) -> int:
        """The devices attention's all-to-all spreads heads over: mindformers' get_ulysses_cp_num
        (modules/transformer/transformer.py, TransformerOpParallelConfig): 1 without cp or with colossalai_cp, cp
        with ulysses_cp, ulysses_degree with hybrid_cp."""
        if self.cp == 1 or self.cp_algo == "colossalai_cp":
            return 1
        return self.cp if self.cp_algo == "ulysses_cp" else self.ulysses_degree

    @property
    def ring(self) -> int:
        """The devices key/value blocks circulate over: cp / ulysses (llama_transformer.py, LLamaAttention: cp_co)."""
        return self.cp // self.ulysses

    def check_context(self, where: str = "parallel") -> None:
        """The context-parallel keys as mindformers 1.9 accepts them, before any model is known: cp a positive
        integer (modules/transformer/op_parallel_config.py, OpParallelConfig: Validator.check_positive_int), the
        algorithm one of its values (transformer.py, ContextParallelAlgo), and with hybrid_cp a Ulysses degree
        dividing cp (transformer.py, TransformerOpParallelConfig._check_context_parallel raises ValueError)."""
        if not isinstance(self.cp, int) or self.cp < 1:
            raise LabkitError(f"{where}.cp = {self.cp!r} must be a positive integer", "use 1 (no context "
                              "parallelism) or the devices to split each sequence over, e.g. 2, 4, 8")
        if self.cp_algo not in CP_ALGOS:
            raise LabkitError(f"{where}.cp_algo = {self.cp_algo!r} is not one of mindformers'",
                              f"use {', '.join(CP_ALGOS)}")
        if self.ulysses_degree < 1:
            raise LabkitError(f"{where}.ulysses_degree = {self.ulysses_degree} must be >= 1",
                              "give the Ulysses part of cp for hybrid_cp, else leave it 1")
        if self.cp_algo == "hybrid_cp" and self.cp > 1 and self.cp % self.ulysses_degree:
            raise LabkitError(f"{where}: cp {self.cp} is not divisible by ulysses_degree {self.ulysses_degree}: "
                              "mindformers refuses it (TransformerOpParallelConfig._check_context_parallel)",
                              f"choose a ulysses_degree dividing {self.cp}")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.dp * self.accum

    @classmethod
    def of(cls, row: dict, sequence_parallel: bool = False,
           optimizer: OptimizerParallel = OptimizerParallel()) -> Layout:
        """The layout of a planner row (or any mapping with the KEYS)."""
        given = {**cls.CP_DEFAULTS, **row}
        return cls(**{k: given[k] for k in cls.KEYS if k != "recompute"},
                   recompute=Recompute.parse(row["recompute"], "recompute"), sequence_parallel=sequence_parallel,
                   optimizer=optimizer)

    def row(self) -> dict:
        """The KEYS as a planner row holds them (recompute as text: the planner's mode when every layer does it)."""
        rc = self.recompute
        whole = rc.mode == "none" or (rc.start == 0 and rc.stop is None)
        return {"dp": self.dp, "mp": self.mp, "pp": self.pp, "cp": self.cp, "cp_algo": self.cp_algo,
                "ulysses_degree": self.ulysses_degree, "micro_batch": self.micro_batch, "accum": self.accum,
                "recompute": rc.mode if whole else str(rc), "optimizer_shard": self.optimizer_shard}
