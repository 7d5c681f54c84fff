"""Training throughput: labkit's MindSpore loop vs an HF transformers + PyTorch reference, in one run.

Same architecture (the model preset, built by mindformers on one side and transformers on the other), same batch of
real packed samples from the shipped corpus, same optimizer (AdamW 0.9/0.95, wd 0.1, grad clip 1.0), float32 on CPU.
Each side runs in its own process (thread pools and allocators stay separate); the first steps (graph compile,
warm-up) are excluded. MFU = model FLOPs per token (labkit.parallel.planner) x tokens/s / each framework's own GEMM peak, measured in the same run.

    python bench/train_throughput.py [--preset tiny] [--steps 20] [--micro-batch 8] [--seq-len 128] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def torch_worker(preset: str, steps: int, micro_batch: int, seq_len: int, skip: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from labkit.config import model_preset
    from labkit.data.dataset import ensure_dataset
    from labkit.data.loader import make_loader

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    m = model_preset(preset)
    hf = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_size,
                     num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                     num_key_value_heads=m.kv_heads, rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta,
                     max_position_embeddings=m.max_position_embeddings, tie_word_embeddings=m.tie_word_embeddings,
                     attn_implementation="sdpa")
    model = LlamaForCausalLM(hf).train()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    loader = make_loader(ensure_dataset(seq_len), micro_batch, seed=0)
    times = []
    for _ in range(steps):
        x = torch.from_numpy(next(loader)).long()
        start = time.perf_counter()
        logits = model(input_ids=x[:, :-1], use_cache=False).logits  # same 128 predictions as mindformers
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
    steady = times[skip:]
    return {"tokens_per_s": micro_batch * seq_len * len(steady) / sum(steady), "steps": steps}


def torch_gemm_gflops(n: int = 1024, repeats: int = 20) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def ms_side(preset: str, steps: int, micro_batch: int, seq_len: int, skip: int, out: Path) -> dict:
    from labkit.training.metrics import read_metrics
    from labkit.training.trainer import train_in_subprocess

    train_in_subprocess("configs/tiny_cpu.yaml", [
        f"model.preset={preset}", f"output_dir={out}", f"train.steps={steps}", f"train.micro_batch={micro_batch}",
        f"data.seq_len={seq_len}", "train.accum=1", "train.save_every=0", "train.peak_tflops=1",
        "train.grad_clip=1.0", "train.amp_level=O0", "train.recompute=none"])
    rows = read_metrics(out)[skip:]
    return {"tokens_per_s": micro_batch * seq_len * len(rows) / sum(r["step_time_s"] for r in rows), "steps": steps}


def main(argv=None) -> int:
    from labkit.output import add_common_flags, emit

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3, help="first steps excluded (compile, warm-up)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    add_common_flags(ap)
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.torch_worker:
        print(json.dumps(torch_worker(a.preset, a.steps, a.micro_batch, a.seq_len, a.skip)))
        return 0

    from labkit.config import model_preset
    from labkit.data.dataset import ensure_dataset
    from labkit.parallel.devices import measure_gemm_peak
    from labkit.paths import RUNS
    from labkit.model.shapes import flops_per_token

    ensure_dataset(a.seq_len)  # build once, outside the timed runs
    gemm = measure_gemm_peak()
    ms = ms_side(a.preset, a.steps, a.micro_batch, a.seq_len, a.skip, RUNS / "bench" / "train_throughput")
    p = subprocess.run([sys.executable, __file__, "--torch-worker", "--preset", a.preset, "--steps", str(a.steps),
                        "--skip", str(a.skip), "--micro-batch", str(a.micro_batch), "--seq-len", str(a.seq_len)],
                       capture_output=True, text=True, check=True)
    th = json.loads(p.stdout.strip().splitlines()[-1])
    fpt = flops_per_token(model_preset(a.preset), a.seq_len)["model"]
    result = {
        "preset": a.preset, "micro_batch": a.micro_batch, "seq_len": a.seq_len, "steps_timed": a.steps - a.skip,
        "ms_tokens_per_s": ms["tokens_per_s"], "torch_tokens_per_s": th["tokens_per_s"],
        "ratio": ms["tokens_per_s"] / th["tokens_per_s"], "gemm_gflops": gemm / 1e9,
        "torch_gemm_gflops": (tgemm := torch_gemm_gflops()), "flops_per_token": fpt,
        # each side against its own framework's GEMM peak (torch's fp32 matmul is faster on this CPU)
        "ms_mfu": fpt * ms["tokens_per_s"] / gemm, "torch_mfu": fpt * th["tokens_per_s"] / (tgemm * 1e9),
        "machine": f"{os.cpu_count()} CPU cores",
    }
    if a.json:
        emit(a, result)
    else:
        print(f"{'':22}{'MindSpore (labkit)':>20}{'PyTorch + HF':>16}")
        print(f"{'tokens/s':22}{result['ms_tokens_per_s']:>20.0f}{result['torch_tokens_per_s']:>16.0f}")
        print(f"{'MFU vs own GEMM peak':22}{result['ms_mfu']:>20.1%}{result['torch_mfu']:>16.1%}")
        print(f"ratio MindSpore / PyTorch: {result['ratio']:.2f}   GEMM peak (MindSpore fp32 1024^3): "
              f"{result['gemm_gflops']:.0f} GFLOP/s, torch {result['torch_gemm_gflops']:.0f}   ({result['machine']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
