"""Build `mindformers.LlamaForCausalLM` from a labkit ModelConfig, with the flags each device target needs.

CPU needs (verified with mindformers 1.9.0 / MindSpore 2.9.0): `fused_rms_norm=False` (the fused kernel is not
registered on CPU), `use_rope_slice=True` (a BatchMatMul broadcast in RoPE fails otherwise), no flash attention,
and `disable_lazy_inline=True` passed as `config=` keyword (Lazy Inline breaks graph compilation on CPU under a
parallel mode). Ascend takes the fused RMSNorm and flash attention from the same call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.config import ModelConfig
from labkit.errors import LabkitError
from labkit.logs import quiet_mindformers
from labkit.model.kernels import KERNELS, use_custom_kernels

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class BackendFlags:
    fused_rms_norm: bool
    use_rope_slice: bool
    use_flash_attention: bool
    disable_lazy_inline: bool


def backend_flags(device_target: str, use_flash_attention: bool | None = None) -> BackendFlags:
    """The backend-safe switches for a device target. `use_flash_attention=None` means: where supported."""
    if device_target == "CPU":
        if use_flash_attention:
            raise LabkitError("flash attention is not available on CPU", "set use_flash_attention: false or null")
        return BackendFlags(fused_rms_norm=False, use_rope_slice=True, use_flash_attention=False,
                            disable_lazy_inline=True)
    if device_target == "Ascend":
        fa = True if use_flash_attention is None else use_flash_attention
        return BackendFlags(fused_rms_norm=True, use_rope_slice=False, use_flash_attention=fa,
                            disable_lazy_inline=False)
    if device_target == "GPU":
        # mindformers' FlashAttentionScore and fused RmsNorm are Ascend kernels
        return BackendFlags(fused_rms_norm=False, use_rope_slice=True, use_flash_attention=False,
                            disable_lazy_inline=False)
    raise LabkitError(f"unknown device_target '{device_target}'", "use CPU, GPU or Ascend")


@dataclass(frozen=True)
class Backend:
    """How the model computes: the device target, the dtypes (labkit.config.AMP_LEVELS gives them per mixed-precision
    level: Backend(**AMP_LEVELS[level])), flash attention (None: what the target supports) and, on CPU, MindSpore's
    own kernels or labkit's C++ ones."""

    device_target: str = "CPU"
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    softmax_dtype: str = "float32"
    norm_dtype: str = "float32"
    embedding_dtype: str | None = None  # None: param_dtype
    rotary_dtype: str = "float32"
    use_flash_attention: bool | None = None
    kernels: str = "native"  # one of labkit.model.kernels.KERNELS


def llama_config_kwargs(cfg: ModelConfig, *, seq_length: int, batch_size: int = 1,
                        backend: Backend = Backend()) -> dict:
    """The mindformers `LlamaConfig` arguments for this model (also written out as mindformers YAML)."""
    b = backend
    embedding = b.embedding_dtype or b.param_dtype
    for name, dt in (("compute_dtype", b.compute_dtype), ("param_dtype", b.param_dtype),
                     ("softmax_dtype", b.softmax_dtype), ("norm_dtype", b.norm_dtype), ("embedding_dtype", embedding),
                     ("rotary_dtype", b.rotary_dtype)):
        if dt not in DTYPES:
            raise LabkitError(f"{name} '{dt}' is not supported", f"use one of {', '.join(DTYPES)}")
    flags = backend_flags(b.device_target, b.use_flash_attention)
    return dict(
        batch_size=batch_size, seq_length=seq_length, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, n_kv_heads=cfg.num_kv_heads if cfg.kv_heads != cfg.num_heads else None,
        intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, multiple_of=cfg.multiple_of,
        ffn_dim_multiplier=cfg.ffn_dim_multiplier, rms_norm_eps=cfg.rms_norm_eps, theta=cfg.rope_theta,
        max_position_embedding=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        tie_word_embeddings=cfg.tie_word_embeddings, init_method_std=cfg.init_std,
        compute_dtype=b.compute_dtype, layernorm_compute_type=b.norm_dtype, softmax_compute_type=b.softmax_dtype,
        rotary_dtype=b.rotary_dtype, param_init_type=b.param_dtype, embedding_init_type=embedding,
        fused_rms_norm=flags.fused_rms_norm, use_rope_slice=flags.use_rope_slice,
        use_flash_attention=flags.use_flash_attention, disable_lazy_inline=flags.disable_lazy_inline,
    )


def build_model(cfg: ModelConfig, *, seq_length: int, batch_size: int = 1, backend: Backend = Backend(),
                recompute_layers: list[int] | None = None, parallel_config: dict | None = None, no_init: bool = False,
                seed: int | None = None):
    """A `mindformers.LlamaForCausalLM` computing as `backend` says.

    recompute_layers: indices of decoder layers whose activations are recomputed in the backward pass.
    no_init: build the structure without allocating weights (exact shapes and counts, ~no memory).
    seed: re-initialise with labkit's documented scheme (see `init_weights`); None keeps mindformers' init.
    backend.kernels: "custom" runs RMSNorm, SwiGLU, RoPE, the attention softmax and the cross-entropy as C++ operators
        on CPU (labkit.model.kernels; the trainer adds the AdamW update); GPU/Ascend and "native" keep mindformers'.
    """
    quiet_mindformers()
    import mindspore as ms
    from mindformers import LlamaConfig, LlamaForCausalLM

    kwargs = llama_config_kwargs(cfg, seq_length=seq_length, batch_size=batch_size, backend=backend)
    if parallel_config:
        kwargs["parallel_config"] = parallel_config
    llama_cfg = LlamaConfig(**kwargs)
    if no_init:
        with ms.nn.utils.no_init_parameters():
            model = LlamaForCausalLM(config=llama_cfg)
        return model
    model = LlamaForCausalLM(config=llama_cfg)  # keyword: the lazy-inline decorator reads kwargs['config']
    if seed is not None:
        init_weights(model, cfg, seed)
    if backend.kernels not in KERNELS:
        raise LabkitError(f"kernels '{backend.kernels}' is not known", f"use one of {', '.join(KERNELS)}")
    if backend.kernels == "custom" and backend.device_target == "CPU":
        use_custom_kernels(model)
    for i in recompute_layers or []:
        if not 0 <= i < cfg.num_layers:
            raise LabkitError(f"recompute layer {i} is outside 0..{cfg.num_layers - 1}")
        model.model.layers[i].recompute()
    return model


def init_weights(model, cfg: ModelConfig, seed: int) -> None:
    """Normal(0, init_std) for every matrix; the two residual-branch output projections (`attention.wo`,
    `feed_forward.w2`) use init_std / sqrt(2 * num_layers) (GPT-2 / Megatron scaling), so the residual
    stream's variance does not grow with depth (`scale_residual_init: false` turns that off, for notebook 08a's
    comparison); RMSNorm gains start at 1. Deterministic in `seed`."""
    import numpy as np
    import mindspore as ms

    rng = np.random.default_rng(seed)
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers) if cfg.scale_residual_init else cfg.init_std
    for name, p in sorted(model.parameters_and_names(), key=lambda kv: kv[0]):
        if len(p.shape) == 1:
            value = np.ones(p.shape, np.float32)
        else:
            std = out_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else cfg.init_std
            value = rng.normal(0.0, std, size=p.shape).astype(np.float32)
        p.set_data(ms.Tensor(value, dtype=p.dtype))


def count_parameters(model) -> int:
    return sum(int(math.prod(p.shape)) for p in model.get_parameters())
