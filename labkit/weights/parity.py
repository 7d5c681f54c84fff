"""Logits parity between an HF checkpoint (run by torch) and its converted MindSpore copy (run by mindformers).

"It loads" proves nothing: a transposed square matrix or a wrong rope_theta loads fine. Parity runs both models on
the same fixed token ids, in float32, and compares the logits at every position and a greedy continuation.

Memory: the two sides run one after the other; only the first side's logits ([seq, vocab] float32) are kept while
the second runs, so the limit is one model in float32 (4 bytes per parameter) plus the framework's overhead.

Two mindformers behaviours shape how the MindSpore side runs (both checked on mindformers 1.9.0, CPU):
- its causal mask also hides every *key* whose id equals `pad_token_id` (HF hides nothing without an attention
  mask), so the parity model is built with pad_token_id=-1, which no token has;
- its `generate()` fails on CPU (kernel ArgMaxExt is not registered), so greedy decoding here is a loop of full
  forward passes over a fixed-length window: the prompt, then generated tokens, then filler that the causal mask
  keeps out of every position that is read.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import threading
import time
from pathlib import Path

import numpy as np

from labkit.config import to_dict
from labkit.errors import LabkitError, LabkitFailure
from labkit.io import atomic_dir
from labkit.logs import quiet_mindformers as quiet_mindformers
from labkit.model.llama import build_model
from labkit.output import add_common_flags, emit
from labkit.weights.formats import as_float32, ckpt_index, nonfinite_counts, read_ckpt_tensor
from labkit.weights.hf_config import model_config_from_hf, read_model_config
from labkit.weights.pairs import check_converted

TOLERANCE = 1e-3  # max |logit difference| allowed in float32


class PeakRSS:
    """Samples this process's resident memory in a thread; `.peak` and `.start` in bytes."""

    def __init__(self, every: float = 0.02):
        import psutil

        self._p, self._every, self._stop = psutil.Process(), every, threading.Event()
        self.start = self.peak = self._p.memory_info().rss

    def _run(self):
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, self._p.memory_info().rss)

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._p.memory_info().rss)


def fixed_tokens(vocab_size: int, seq_len: int, seed: int = 0) -> list[int]:
    """The token ids both sides see: uniform over the whole vocabulary (special ids included), fixed by `seed`."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=seq_len).tolist()


def refuse_nonfinite(side: str, counts: dict) -> None:
    """Stop parity when weights hold NaN or Inf: logits computed from them make any difference meaningless."""
    bad = {n: c for n, c in counts.items() if c}
    if bad:
        listed = "; ".join(f"{n}: {c[0]} NaN, {c[1]} Inf" for n, c in list(bad.items())[:4])
        raise LabkitFailure(f"{side}: weights hold non-finite values ({listed}{'; ...' if len(bad) > 4 else ''}), "
                            "so a logit comparison would be meaningless", "repair or re-download the source "
                            "checkpoint (labkit convert hf2ms lists such tensors as warnings), then convert again")


def hf_side(hf_dir: str | Path, tokens: list[int], gen_tokens: int) -> dict:
    """float32 logits [seq, vocab] and a greedy continuation from the HF model (torch)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    with PeakRSS() as mem:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise LabkitError(f"transformers cannot load {hf_dir}: {str(e).strip().splitlines()[0]}",
                              "--hf must be an HF model directory with a valid config.json and weights") from None
        refuse_nonfinite(f"--hf {hf_dir}", {n: nonfinite_counts(p.detach().float().numpy(), "float32")
                                            for n, p in model.named_parameters()})
        model.eval()
        with torch.no_grad():
            seq = torch.tensor([tokens])
            logits = model(seq, use_cache=False).logits[0].float().numpy().copy()
            nxt, gen = int(logits[-1].argmax()), []
            for k in range(gen_tokens):
                gen.append(nxt)
                if k < gen_tokens - 1:
                    seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
                    nxt = int(model(seq, use_cache=False).logits[0, -1].argmax())
        params = sum(p.numel() for p in model.parameters())
        del model
        gc.collect()
    return dict(logits=logits, generated=gen, params=params, seconds=time.perf_counter() - t0,
                peak_rss_mb=round(mem.peak / 2**20), rss_growth_mb=round((mem.peak - mem.start) / 2**20))


def ms_side(ms_dir: str | Path, tokens: list[int], gen_tokens: int) -> dict:
    """float32 logits [seq, vocab] and a greedy continuation from mindformers, weights from a converted directory."""
    t0 = time.perf_counter()
    quiet_mindformers()
    import mindspore as ms


    cfg = read_model_config(ms_dir)
    ckpt = Path(ms_dir) / "model.ckpt"
    n, window = len(tokens), len(tokens) + gen_tokens
    with PeakRSS() as mem:
        index = ckpt_index(ckpt)
        model = build_model(dataclasses.replace(cfg, pad_token_id=-1), seq_length=window, no_init=True)  # float32
        params = dict(model.parameters_and_names())
        if set(params) != set(index):
            raise LabkitFailure(f"{ckpt} and the mindformers model disagree on: "
                                + ", ".join(sorted(set(params) ^ set(index))[:8]), "convert again")
        bad = {}
        for name, e in index.items():
            if tuple(params[name].shape) != e.shape:
                raise LabkitFailure(f"{name}: checkpoint {list(e.shape)}, model {list(params[name].shape)}")
            arr = as_float32(read_ckpt_tensor(ckpt, e), e.dtype)
            bad[name] = nonfinite_counts(arr, "float32")
            params[name].set_data(ms.Tensor(arr))
        refuse_nonfinite(f"--ms {ckpt}", bad)
        model.set_train(False)
        buf = np.zeros((1, window), np.int32)  # filler after the prompt: never visible to a position we read
        buf[0, :n] = tokens

        def forward(net=model):
            return net(ms.Tensor(buf))[0].asnumpy().reshape(window, -1)

        out = forward()
        logits = out[:n].copy()
        nxt, gen = int(out[n - 1].argmax()), []
        for k in range(gen_tokens):
            gen.append(nxt)
            buf[0, n + k] = nxt
            if k < gen_tokens - 1:
                nxt = int(forward()[n + k].argmax())
        count = sum(int(np.prod(p.shape)) for p in params.values())
        del model, params
        gc.collect()
    return dict(logits=logits, generated=gen, params=count, seconds=time.perf_counter() - t0,
                peak_rss_mb=round(mem.peak / 2**20), rss_growth_mb=round((mem.peak - mem.start) / 2**20))


BYTES_PER_PARAM = 4.5  # measured peak growth per parameter of one side (float32 weights + working set), ~1B model
FIXED_BYTES = 2 * 2**30  # frameworks, interpreter, the other side's leftovers


def size_limit(total_bytes: int | None = None) -> dict:
    """The largest model parity can run on this machine, one side at a time. Measured with a TinyLlama-shaped
    1.1B model (bench/convert_throughput.py --tinyllama --parity): the HF side grew by ~4.2 B/param, the
    MindSpore side by ~3.3 B/param. 85% of RAM is taken as usable."""
    import psutil

    total = total_bytes or psutil.virtual_memory().total
    max_params = max(0, int((0.85 * total - FIXED_BYTES) / BYTES_PER_PARAM))
    return dict(ram_gib=round(total / 2**30, 1), max_params=max_params,
                text=f"about {max_params / 1e9:.1f}B parameters with {total / 2**30:.0f} GiB RAM "
                     "(one side at a time, float32 weights)")


def config_diff(hf_dir: str | Path, ms_dir: str | Path) -> dict:
    """Fields where the HF config.json and the converted model.yaml disagree (name aside); when config.json
    cannot be read as a Llama config, {"not_compared": why} (an empty dict means the configs agree)."""
    try:
        hf = to_dict(model_config_from_hf(json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))))
    except (LabkitError, OSError, ValueError) as e:
        why = e.what if isinstance(e, LabkitError) else f"{type(e).__name__}: {e}"
        return {"not_compared": f"{Path(hf_dir) / 'config.json'}: {why}"}
    ms = to_dict(read_model_config(ms_dir))
    return {k: [hf[k], ms[k]] for k in hf if k != "name" and hf[k] != ms[k]}


def run_parity(hf_dir: str | Path, ms_dir: str | Path, seq_len: int = 32, gen_tokens: int = 8,
               tolerance: float = TOLERANCE, seed: int = 0) -> dict:
    """Compare logits and greedy generation; returns the report (`passed` says whether it holds)."""
    if seq_len < 1 or gen_tokens < 0:
        raise LabkitError(f"--seq-len {seq_len} / --gen-tokens {gen_tokens}", "use seq-len >= 1 and gen-tokens >= 0")
    cfg = check_converted(ms_dir)  # model.ckpt against model.yaml, its tokenizer against the vocabulary: nothing built
    if seq_len + gen_tokens > cfg.max_position_embeddings:
        raise LabkitError(f"seq-len + gen-tokens = {seq_len + gen_tokens} exceeds max_position_embeddings "
                          f"{cfg.max_position_embeddings}", "use a shorter window")
    diff = config_diff(hf_dir, ms_dir)
    if "vocab_size" in diff:
        raise LabkitFailure(f"vocab sizes differ: HF {diff['vocab_size'][0]}, MindSpore {diff['vocab_size'][1]}",
                            "compare a converted model with the HF model it came from")
    tokens = fixed_tokens(cfg.vocab_size, seq_len, seed)
    hf = hf_side(hf_dir, tokens, gen_tokens)
    hf_logits = hf.pop("logits")
    gc.collect()
    ms = ms_side(ms_dir, tokens, gen_tokens)
    ms_logits = ms.pop("logits")
    delta = np.abs(hf_logits.astype(np.float64) - ms_logits)
    agree = float((hf_logits.argmax(-1) == ms_logits.argmax(-1)).mean())
    report = dict(max_abs_diff=float(delta.max()), mean_abs_diff=float(delta.mean()), argmax_agreement=agree,
                  generation_match=hf["generated"] == ms["generated"], tolerance=tolerance,
                  logit_scale=float(np.abs(hf_logits).max()), seq_len=seq_len, gen_tokens=gen_tokens, seed=seed,
                  hf_generated=hf["generated"], ms_generated=ms["generated"], config_diff=diff,
                  params=hf["params"], hf=hf, ms=ms, size_limit=size_limit()["text"])
    report["passed"] = bool(report["max_abs_diff"] <= tolerance and agree == 1.0 and report["generation_match"])
    return report


# ---------------------------------------------------------------------------------- test checkpoints

TINY_HF = dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256, rope_theta=10000.0,
               initializer_range=0.15)


def make_hf_llama(dst: str | Path, *, seed: int = 0, dtype: str = "float32", max_shard_size: str | None = None,
                  safe_serialization: bool = True, overwrite: bool = False, **config) -> Path:
    """Create a small random HF Llama locally (transformers + torch, fixed seed; nothing is downloaded).
    `config` overrides TINY_HF (GQA and tied embeddings on). initializer_range 0.15 makes attention sharp enough
    that a RoPE mistake changes the logits (at 0.02 a random model attends almost uniformly)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_HF, **config})).to(getattr(torch, dtype))
    with atomic_dir(dst, overwrite=overwrite) as tmp:
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(tmp, safe_serialization=safe_serialization, **kw)
    return Path(dst)


def make_variant(src: str | Path, dst: str | Path, *, drop: tuple = (), transpose: tuple = (),
                 config: dict | None = None, overwrite: bool = False) -> Path:
    """A deliberately broken copy of a single-file safetensors checkpoint: drop keys, transpose matrices,
    change config.json fields. For the notebook's and tests' failure cases."""
    from safetensors.torch import load_file, save_file

    src = Path(src)
    sd = load_file(src / "model.safetensors")
    for k in list(drop) + list(transpose):
        if k not in sd:
            raise LabkitError(f"{k} is not in {src / 'model.safetensors'}")
    for k in drop:
        del sd[k]
    for k in transpose:
        sd[k] = sd[k].T.contiguous()
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg.update(config or {})
    with atomic_dir(dst, overwrite=overwrite) as tmp:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return Path(dst)


# ------------------------------------------------------------------------------------------- CLI


def add_cli(parser) -> None:
    parser.add_argument("--hf", required=True, help="HF model directory (run with torch, float32)")
    parser.add_argument("--ms", required=True, help="converted directory (model.ckpt + model.yaml)")
    parser.add_argument("--seq-len", type=int, default=32, help="prompt length in tokens (default 32)")
    parser.add_argument("--gen-tokens", type=int, default=8, help="greedy tokens to generate and compare (default 8)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help=f"max |logit diff| (default {TOLERANCE})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fixed token ids")
    add_common_flags(parser)
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    r = run_parity(args.hf, args.ms, seq_len=args.seq_len, gen_tokens=args.gen_tokens, tolerance=args.tolerance,
                   seed=args.seed)
    r["ok"] = r["passed"]
    text = (f"parity {'PASSED' if r['passed'] else 'FAILED'}: max_abs_diff {r['max_abs_diff']:.3g} "
            f"(tolerance {r['tolerance']:g}, logits up to {r['logit_scale']:.3g}), argmax_agreement "
            f"{r['argmax_agreement']:.3f}, generation_match {r['generation_match']}\n"
            f"  HF {r['hf_generated']}\n  MS {r['ms_generated']}\n"
            f"  peak RSS: HF side {r['hf']['peak_rss_mb']} MB, MindSpore side {r['ms']['peak_rss_mb']} MB; "
            f"limit {r['size_limit']}")
    if "not_compared" in r["config_diff"]:
        text += f"\n  configs not compared: {r['config_diff']['not_compared']}"
    elif r["config_diff"]:
        text += f"\n  configs differ (HF, MindSpore): {r['config_diff']}"
    emit(args, r, text)
    return 0 if r["passed"] else 1
