"""The planner's terms for context parallelism (cp; the mechanism by hand is labkit.byhand): one sequence split over
cp devices. What mindformers 1.9 accepts, what it adds to the memory of a decoder layer, and what it sends per layer.
The planner (labkit.parallel.planner), the memory model (labkit.parallel.memory) and the YAML writer
(labkit.parallel.mindformers_yaml) take their cp terms from here.

Every device holds s/cp tokens of each sequence outside attention (mindformers shards the sequence axis cp ways:
llama_transformer.py, LLamaAttention: wq/wk/wv.shard(((dp * cp, 1), (mp, 1))); llama.py, LlamaForCausalLM: the
output layer and the loss over dp * cp). Attention must see the whole sequence; the algorithms
(labkit.layout.CP_ALGOS, Layout.ring and Layout.ulysses) differ in how:

  ring (colossalai_cp, Liu et al. 2023 "Ring Attention with Blockwise Transformers", arXiv:2310.01889; Megatron
    Core's context parallelism docs): each device keeps its own query, key and value blocks (s/cp tokens) and
    passes the key/value blocks round the ring, r - 1 steps, computing attention block pair by block pair with the
    online softmax. With flash attention nothing of size s x s is stored, only the softmax statistics of its own
    queries; the backward pass passes the key/value blocks round again with their gradients dK, dV.
  Ulysses (ulysses_cp, Jacobs et al. 2023 "DeepSpeed Ulysses", arXiv:2309.14509): an all-to-all turns the
    sequence split of Q, K, V into a head split (the whole sequence for heads / (mp x cp) heads), attention runs
    as without cp, a fourth all-to-all turns the output back; the backward pass runs the four in reverse.
  hybrid_cp: Ulysses over `ulysses_degree` devices, the ring over cp / ulysses_degree.

The per-layer activation formula the rest is added to is Korthikanti et al. 2022 (arXiv:2205.05198, Table 2),
counted for a Llama layer in labkit.parallel.memory.layer_activations, at sequence s/cp."""
from __future__ import annotations

from labkit.config import ModelConfig
from labkit.errors import LabkitError
from labkit.layout import Layout

CP_DEGREES = (1, 2, 4, 8)  # the planner's search; any degree mindformers accepts can be pinned
SEARCHED_ALGOS = ("colossalai_cp", "ulysses_cp")  # hybrid_cp only when pinned (it needs ulysses_degree too)
SEMI_AUTO = ("semi_auto_parallel", "auto_parallel")


def check_mindformers(cfg: ModelConfig, layout: Layout, *, seq_len: int, flash_attention: bool,
                      parallel_mode: str = "semi_auto_parallel", seq_split_num: int = 1,
                      where: str = "parallel") -> None:
    """Raise a LabkitError naming the key and the fix for a context-parallel layout mindformers 1.9 would refuse or
    silently change, by the rules in its source:

      - cp a positive integer, the algorithm one of its values, hybrid_cp's Ulysses degree dividing cp
        (Layout.check_context: op_parallel_config.py OpParallelConfig; transformer.py
        TransformerOpParallelConfig._check_context_parallel);
      - cp > 1 only under semi_auto_parallel or auto_parallel: in the other modes the trainer resets
        context_parallel to 1 (trainer/base_trainer.py, BaseTrainer._check_global_batch_size_for_auto_parallel);
      - cp > 1 only with flash attention (tools/check_rules.py, _check_parallel: "context_parallel is only
        available for flash attention"); the ring (use_ring_attention) needs it too (models/llama/llama.py,
        LlamaModel.__init__);
      - heads and key/value heads divisible by model_parallel x the Ulysses degree (models/llama/
        llama_transformer.py, LLamaAttention.__init__), and for ulysses_cp cp x mp <= key/value heads
        (tools/check_rules.py, _check_context_parallel_algo_valid);
      - the ring refused with seq_split_num > 1 (llama.py, LlamaModel.__init__: "When the seq_pipe = True, the
        use_ring_attention cannot be True.");
      - the sequence divisible by cp: MindSpore splits the sequence axis cp ways (the shard strategies above)."""
    layout.check_context(where)
    cp = layout.cp
    if cp == 1:
        return
    if parallel_mode not in SEMI_AUTO:
        raise LabkitError(f"{where}.cp = {cp} with parallel_mode {parallel_mode}: mindformers resets "
                          "context_parallel to 1 outside semi_auto_parallel/auto_parallel "
                          "(BaseTrainer._check_global_batch_size_for_auto_parallel)",
                          f"set {where}.parallel_mode: semi_auto_parallel, or {where}.cp: 1")
    if not flash_attention:
        raise LabkitError(f"{where}.cp = {cp} without flash attention: mindformers refuses it "
                          "(check_rules._check_parallel)", "run on Ascend with use_flash_attention, or cp: 1")
    heads = layout.mp * layout.ulysses
    for name, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.kv_heads)):
        if n % heads:
            raise LabkitError(f"{where}: model.{name} {n} is not divisible by mp {layout.mp} x Ulysses degree "
                              f"{layout.ulysses}: mindformers refuses it (LLamaAttention.__init__)",
                              "use colossalai_cp, a smaller cp or mp, or a Ulysses degree dividing the heads")
    if layout.cp_algo == "ulysses_cp" and cp * layout.mp > cfg.kv_heads:
        raise LabkitError(f"{where}: cp {cp} x mp {layout.mp} > {cfg.kv_heads} key/value heads with ulysses_cp "
                          "(check_rules._check_context_parallel_algo_valid)", "use colossalai_cp or a smaller cp")
    if layout.ring > 1 and seq_split_num > 1:
        raise LabkitError(f"{where}: the ring ({layout.cp_algo}) with seq_split_num {seq_split_num}: mindformers "
                          "refuses use_ring_attention with a sequence pipeline (LlamaModel.__init__)",
                          "use ulysses_cp, or seq_split_num 1")
    if seq_len % cp:
        raise LabkitError(f"{where}: seq_len {seq_len} is not divisible by cp {cp}",
                          f"choose a cp dividing {seq_len}")


def invalid(cfg: ModelConfig, layout: Layout, seq_len: int, flash_attention: bool) -> str | None:
    """Why the planner skips a context-parallel candidate (check_mindformers' rules, shortened), or None. The
    planner asks for a sequence divisible by 2 x cp: the load-balanced causal split gives each device two chunks of
    s / (2 cp) tokens, one early and one late, so each does the same attention work (Megatron Core's context
    parallelism; Liu et al.'s ring with a causal mask)."""
    if layout.cp == 1:
        return None
    if not flash_attention:
        return "context parallel needs flash attention"
    if cfg.num_heads % (layout.mp * layout.ulysses) or cfg.kv_heads % (layout.mp * layout.ulysses):
        return "heads not divisible by mp x Ulysses degree"
    if seq_len % (2 * layout.cp):
        return "sequence not divisible by 2 x cp"
    return None


def attention_elements(cfg: ModelConfig, seq_len: int, micro_batch: int, *, mp: int, cp: int, ulysses: int,
                       act_bytes: int) -> dict[str, float]:
    """Activation elements context parallelism adds to one decoder layer of one micro-batch on one device, beyond
    the layer's own tensors at sequence s/cp (labkit.parallel.memory.layer_activations): `stored` for the backward
    pass, `working` alive only while one layer's attention runs. With s_c = s/cp, b the micro-batch, h the hidden
    size, kv the key/value width (kv heads x head dim), r = cp / ulysses the ring and u = ulysses the Ulysses
    degree:

      Ulysses (u > 1), stored: s_c b h / mp, the attention output in the head split, which flash attention's
        backward reads, beside its copy after the all-to-all back (the input of wo, already counted); Q, K, V after
        the all-to-all replace the ones before it (same element count: s b / (mp u) per head group), the
        statistics are 2 a s_c b / mp as without cp (each device holds a / (mp u) heads of the s tokens).
        working: the all-to-alls of dQ, dK, dV and dO in the backward pass, s_c b (2 h + 2 kv) / mp.
      ring (r > 1), stored: nothing more: each device keeps its own Q, K, V blocks and the softmax statistics of
        its queries (Liu et al. 2023), which the layer count already holds at s/cp. working: in the backward pass
        the K and V blocks and the dK, dV blocks travelling with them, each being used and the next one received:
        8 s_c b kv / mp, plus the float32 accumulator of dQ (of the output in the forward pass): s_c b h / mp x
        4 / act_bytes elements of the activations' dtype."""
    if cp == 1:
        return {"stored": 0.0, "working": 0.0}
    sc_b = seq_len / cp * micro_batch
    h, kv = cfg.hidden_size, cfg.kv_heads * cfg.head_dim
    stored = working = 0.0
    if ulysses > 1:
        stored += sc_b * h / mp
        working += sc_b * (2 * h + 2 * kv) / mp
    if cp // ulysses > 1:
        working += 8 * sc_b * kv / mp + sc_b * h / mp * 4 / act_bytes
    return {"stored": stored, "working": working}


def comm_bytes(cfg: ModelConfig, layout: Layout, seq_len: int, act_bytes: int, recompute: str = "none") -> dict:
    """Bytes one device sends for context parallelism per decoder layer and micro-batch, forward and backward (and
    the forward again with full recomputation), by kind. With s_c = s/cp, b, h, kv as in attention_elements and
    F the forward pass's:

      ring (r = cp / u devices): r - 1 steps, each sending the device's current key and value blocks,
        F = (r - 1) x 2 s_c b kv / mp x bytes; with r = cp that is 2 (cp - 1) / cp of the key/value of the whole
        sequence (Liu et al. 2023). The backward pass sends K and V again and their gradients dK, dV: 2 F.
      Ulysses (u devices): four all-to-alls (Q, K, V in, the output back), each sending (u - 1) / u of the device's
        tensor: F = (u - 1) / u x s_c b (2 h + 2 kv) / mp x bytes (Jacobs et al. 2023); the backward pass runs
        four more of the same sizes (dO in; dQ, dK, dV out): F."""
    if layout.cp == 1:
        return {"ring": 0.0, "all_to_all": 0.0}
    passes_fwd = 2 if recompute == "full" else 1
    sc_b = seq_len / layout.cp * layout.micro_batch
    h, kv, mp, u, r = cfg.hidden_size, cfg.kv_heads * cfg.head_dim, layout.mp, layout.ulysses, layout.ring
    ring = (r - 1) * 2 * sc_b * kv / mp * act_bytes
    a2a = (u - 1) / u * sc_b * (2 * h + 2 * kv) / mp * act_bytes
    return {"ring": ring * (passes_fwd + 2), "all_to_all": a2a * (passes_fwd + 1)}


# mindformers' compressed causal mask: a 2048 x 2048 uint8 constant (modules/transformer/transformer.py,
# LowerTriangularMaskWithDynamic.__init__, which refuses compression for a shorter sequence)
COMPRESSED_MASK = 2048


def mask_compression(seq_len: int, flash_attention: bool) -> bool:
    """Whether the run YAML sets model_config.use_attn_mask_compression (labkit.parallel.mindformers_yaml): with flash
    attention from COMPRESSED_MASK tokens on, where mindformers accepts it. The compressed mask is the causal
    pattern alone (FlashAttentionScore sparse_mode 2, LLamaAttention.__init__ in models/llama/llama_transformer.py):
    it leaves out the padding row the full mask multiplies in, which changes nothing for a token whose padding
    comes after it (the loader pads at the end: those keys are in its future, masked either way). With the ring the
    device holds no mask either way (mask_bytes); the key still spares the host the [s, s] triangle the mask cell
    builds in LlamaModel.__init__ (models/llama/llama.py)."""
    return flash_attention and seq_len >= COMPRESSED_MASK


def mask_bytes(seq_len: int, micro_batch: int, act_bytes: int, *, ring: bool, compressed: bool) -> dict[str, float]:
    """Bytes of mindformers 1.9's causal attention mask on one device with flash attention, by part (without flash
    attention memory.recompute_mask_elements counts it):

      constant  the triangle LowerTriangularMaskWithDynamic.__init__ holds (modules/transformer/transformer.py): an
                [s, s] tensor in the compute dtype, or with compression the [2048, 2048] uint8 one its construct
                returns as it is
      stored    per micro-batch in flight, the [b, 1, s, s] uint8 mask every layer's FlashAttentionScore reads
                forward and backward (construct: the padding row times the triangle, 1 minus it, cast to uint8);
                none with compression
      working   the two [b, s, s] tensors in the compute dtype construct makes on the way (the product and 1 minus
                it), alive while the mask is built at the start of a forward pass

    The cell is split over dp only (LowerTriangularMaskWithDynamic.shard): a device builds its micro-batch's whole
    mask, whatever cp. With the ring (use_ring_attention) nothing reaches the device: LlamaModel.construct builds no
    mask (models/llama/llama.py: `elif not self.use_ring_attention: mask = self.casual_mask(tokens)`) and
    FlashAttention takes none (modules/flash_attention.py: use_attention_mask False with the ring)."""
    if ring:
        return {"constant": 0.0, "stored": 0.0, "working": 0.0}
    if compressed:
        return {"constant": float(COMPRESSED_MASK * COMPRESSED_MASK), "stored": 0.0, "working": 0.0}
    square = float(seq_len) * seq_len
    return {"constant": square * act_bytes, "stored": micro_batch * square, "working": 2 * micro_batch * square * act_bytes}
