"""Conversion throughput (MB/s) and peak memory: labkit's streaming hf2ms / ms2hf against a plain
"load the whole state dict, then save" baseline, on a random Llama checkpoint of a few hundred MB made locally.

Each method runs in its own subprocess; the child reports its peak RSS (ru_maxrss) and its RSS after importing
MindSpore + mindformers, so the difference is the memory the method itself needed. The checkpoint is also made in a
subprocess: on Linux a child's ru_maxrss starts from the parent's RSS at fork (the old address space's high-water
mark survives execve), so a parent that had held the checkpoint would inflate every child's figure. VmHWM from
/proc/self/status (reset by execve) is reported beside it as a cross-check.

    python bench/convert_throughput.py [--size-mb 400] [--dtype bfloat16] [--shard-mb 200] [--json]
    python bench/convert_throughput.py --tinyllama --parity     # TinyLlama-1.1B's shape, plus logits parity

With --parity the converted copy is also checked against the HF original (`labkit.weights.parity`, float32, one side
at a time), which is how the ~1B-parameter parity figure in notebook 01 was measured.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


TINYLLAMA = dict(h=2048, f=5632, heads=32, kv=4, vocab=32000, layers=22)  # TinyLlama-1.1B's config.json


def make_checkpoint(dst: Path, size_mb: int, dtype: str, shard_mb: int, tinyllama: bool = False) -> dict:
    """A Llama-shaped HF checkpoint with random weights (norm gains 1), written shard by shard; no model object."""
    import torch
    from safetensors.torch import save_file

    elt = 4 if dtype == "float32" else 2
    h, f, heads, kv, vocab = 1024, 2816, 16, 4, 32000
    per_layer = 2 * h * h + 2 * h * (kv * h // heads) + 3 * h * f + 2 * h
    layers = max(1, round((size_mb * 1e6 / elt - 2 * vocab * h) / per_layer))
    if tinyllama:
        h, f, heads, kv, vocab, layers = (TINYLLAMA[k] for k in ("h", "f", "heads", "kv", "vocab", "layers"))
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=h,
               intermediate_size=f, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
               max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               hidden_act="silu", dtype=dtype)
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.k_proj.weight": (kv * h // heads, h),
                       p + "self_attn.v_proj.weight": (kv * h // heads, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "post_attention_layernorm.weight": (h,), p + "mlp.gate_proj.weight": (f, h),
                       p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (vocab, h)})
    dst.mkdir(parents=True)
    torch.manual_seed(0)
    shards, cur, cur_bytes = [], {}, 0
    for name, shape in shapes.items():
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape) * 0.02
        cur[name] = t.to(getattr(torch, dtype))
        cur_bytes += cur[name].numel() * elt
        if cur_bytes >= shard_mb * 1e6:
            shards.append(cur)
            cur, cur_bytes = {}, 0
    shards += [cur] if cur else []
    wmap = {}
    for i, sd in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sd, str(dst / fname), metadata={"format": "pt"})
        wmap.update({k: fname for k in sd})
    total = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": wmap}))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dict(bytes=total, shards=len(shards), layers=layers,
                largest_tensor_bytes=vocab * h * elt, largest_shard_bytes=max(
                    p.stat().st_size for p in dst.glob("*.safetensors")))


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def child(method: str, src: Path, dst: Path) -> dict:
    """Runs in a fresh process: import the frameworks, note RSS, convert, report peak RSS."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from labkit.weights import convert
    from labkit import logs
    from labkit.weights import name_map as mapping

    logs.quiet_mindformers()  # MindSpore + mindformers imported: the fixed cost both methods share
    import mindspore as ms  # noqa: F401

    base = _rss_mb()
    t0 = time.perf_counter()
    if method == "streaming_hf2ms":
        convert.hf2ms(src, dst)
    elif method == "streaming_ms2hf":
        convert.ms2hf(src, dst)
    elif method == "parity":
        from labkit.weights import parity

        r = parity.run_parity(src, dst)
        return dict(method=method, seconds=time.perf_counter() - t0, **{k: r[k] for k in (
            "passed", "max_abs_diff", "argmax_agreement", "generation_match", "tolerance", "params", "seq_len",
            "gen_tokens")}, hf_peak_rss_mb=r["hf"]["peak_rss_mb"], ms_peak_rss_mb=r["ms"]["peak_rss_mb"],
            hf_rss_growth_mb=r["hf"]["rss_growth_mb"], ms_rss_growth_mb=r["ms"]["rss_growth_mb"])
    elif method == "naive_hf2ms":  # what a short script does: whole state dict in memory, then one save
        import torch
        from safetensors.torch import load_file

        sd = {}
        for f in sorted(src.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        items = []
        for k, v in sd.items():
            data = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
            items.append({"name": mapping.hf_to_ms(k), "data": ms.Tensor(data, dtype=getattr(ms, str(v.dtype)[6:]))})
        dst.mkdir()
        ms.save_checkpoint(items, str(dst / "model.ckpt"))
    else:
        raise SystemExit(f"unknown method {method}")
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(method=method, seconds=secs, peak_rss_mb=peak, rss_after_imports_mb=base, vm_hwm_mb=_vm_hwm_mb())


def _vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_child(method: str, src: Path, dst: Path, *extra: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--_child", method, str(src), str(dst), *extra],
                         capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(f"{method} failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    from labkit.output import add_common_flags, emit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=400, help="checkpoint size to create (MB)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--shard-mb", type=int, default=200, help="safetensors shard size (MB)")
    ap.add_argument("--tinyllama", action="store_true", help="use TinyLlama-1.1B's shape (ignores --size-mb)")
    ap.add_argument("--parity", action="store_true", help="also run logits parity HF vs converted (slow)")
    add_common_flags(ap)
    ap.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child and args._child[0] == "make":
        print(json.dumps(make_checkpoint(Path(args._child[1]), args.size_mb, args.dtype, args.shard_mb,
                                         args.tinyllama)))
        return 0
    if args._child:
        print(json.dumps(child(args._child[0], Path(args._child[1]), Path(args._child[2]))))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="labkit-bench-convert-"))
    try:
        info = run_child("make", tmp / "hf", tmp, "--size-mb", str(args.size_mb), "--dtype", args.dtype,
                         "--shard-mb", str(args.shard_mb), *(["--tinyllama"] if args.tinyllama else []))
        rows = [run_child("streaming_hf2ms", tmp / "hf", tmp / "ms"),
                run_child("naive_hf2ms", tmp / "hf", tmp / "naive"),
                run_child("streaming_ms2hf", tmp / "ms", tmp / "back")]
        par = run_child("parity", tmp / "hf", tmp / "ms") if args.parity else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mb = info["bytes"] / 1e6
    for r in rows:
        r["mb_per_s"] = round(mb / r["seconds"], 1)
        r["extra_rss_mb"] = round(r["peak_rss_mb"] - r["rss_after_imports_mb"])
        r["extra_rss_x_checkpoint"] = round(r["extra_rss_mb"] * 2**20 / info["bytes"], 2)
        r["seconds"] = round(r["seconds"], 2)
        r["peak_rss_mb"] = round(r["peak_rss_mb"])
        r["rss_after_imports_mb"] = round(r["rss_after_imports_mb"])
        r["vm_hwm_mb"] = round(r["vm_hwm_mb"])
    import platform

    import psutil

    result = dict(checkpoint_mb=round(mb, 1), dtype=args.dtype, shards=info["shards"], layers=info["layers"],
                  largest_tensor_mb=round(info["largest_tensor_bytes"] / 1e6, 1),
                  largest_shard_mb=round(info["largest_shard_bytes"] / 1e6, 1), rows=rows, parity=par,
                  machine=f"{platform.machine()}, {psutil.cpu_count()} cores, "
                          f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM")
    if args.json:
        emit(args, result)
        return 0
    print(f"checkpoint: {result['checkpoint_mb']} MB {args.dtype} in {info['shards']} shards "
          f"(largest tensor {result['largest_tensor_mb']} MB, largest shard {result['largest_shard_mb']} MB); "
          f"{result['machine']}")
    print(f"{'method':18} {'seconds':>8} {'MB/s':>7} {'peak RSS MB':>12} {'VmHWM MB':>9} {'after imports':>14} "
          f"{'extra MB':>9} {'extra/ckpt':>10}")
    for r in rows:
        print(f"{r['method']:18} {r['seconds']:8.2f} {r['mb_per_s']:7.1f} {r['peak_rss_mb']:12} {r['vm_hwm_mb']:9} "
              f"{r['rss_after_imports_mb']:14} {r['extra_rss_mb']:9} {r['extra_rss_x_checkpoint']:10.2f}")
    if par:
        print(f"parity ({par['params'] / 1e9:.2f}B params, float32, seq {par['seq_len']} + {par['gen_tokens']} "
              f"generated): passed={par['passed']} max_abs_diff={par['max_abs_diff']:.3g} "
              f"argmax_agreement={par['argmax_agreement']} generation_match={par['generation_match']} "
              f"in {par['seconds']:.0f} s; peak RSS HF side {par['hf_peak_rss_mb']} MB, "
              f"MindSpore side {par['ms_peak_rss_mb']} MB")
    return 0


if __name__ == "__main__":
    from labkit.runtime import prepare_process

    prepare_process("CPU")  # before anything imports MindSpore
    sys.exit(main())
