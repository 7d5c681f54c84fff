"""HF ⇄ MindSpore weight conversion for Llama-family checkpoints, streamed tensor by tensor.

The name mapping is data (`MAPPING`). Layouts are the same on both sides, checked by parity, not assumed:
mindformers' Linear stores `[out_features, in_features]` like torch (`transpose_b=True`), and its RoPE rotates
the two halves of each head like HF's `rotate_half`, so q/k need no permutation. Nothing is transposed here.

A converted directory (what `hf2ms` writes and `ms2hf`, parity and training read):
  model.ckpt               MindSpore checkpoint, mindformers parameter names
  model.yaml               the labkit ModelConfig
  mindformers_model.yaml   the equivalent mindformers `model:` block (LlamaConfig + LlamaForCausalLM)
  conversion.json          source dtype, original HF names and order, shards, crc32 of every source tensor
  tokenizer files, generation_config.json   copied when the source has them
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import yaml

from labkit import __version__
from labkit.config import ModelConfig, RunConfig, load, to_dict
from labkit.errors import LabkitError
from labkit.io import atomic_dir, check_output_dir
from labkit.logs import quiet_mindformers
from labkit.model.llama import build_model, llama_config_kwargs
from labkit.model.shapes import expected_hf_shapes, num_params
from labkit.output import add_common_flags, emit
from labkit.paths import lab_path
from labkit.weights.formats import (
    DTYPES,
    STORE,
    CkptWriter,
    HFSource,
    as_float32,
    cast,
    ckpt_index,
    open_hf,
    read_ckpt_tensor,
    st_write,
    training_checkpoint,
)
from labkit.weights.hf_config import hf_config_from_model, model_config_from_hf, read_model_config
from labkit.weights.name_map import BUFFER, MAPPING, TIED_COPY, hf_to_ms, mapping_table, ms_shapes
from labkit.weights.pairs import CONVERTED_TOKENIZER_FIX, check_tokenizer_fits, check_weights

# ------------------------------------------------------------------------------------------ the mapping


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")
EXTRA_FILES = ("generation_config.json",)


# ------------------------------------------------------------------------------------- hf2ms


def _target_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Parameter names and shapes of the mindformers model itself (built without allocating weights)."""
    quiet_mindformers()
    model = build_model(cfg, seq_length=8, no_init=True)
    return {n: tuple(p.shape) for n, p in model.parameters_and_names()}


def _plan(src: HFSource, cfg: ModelConfig) -> list[dict]:
    """Match every source tensor to its target; collect every problem, then refuse with all of them at once."""
    want = expected_hf_shapes(cfg)
    steps, unknown, wrong, bad_dtype = [], [], [], []
    seen = set()
    for t in src.tensors:
        step = dict(hf_name=t.name, ms_name=None, role="param", shape=list(t.shape), source_dtype=t.dtype, file=t.file)
        if t.dtype not in DTYPES:
            bad_dtype.append(f"{t.name} ({t.dtype})")
        if t.name in want:
            step["ms_name"] = hf_to_ms(t.name)
            if t.shape != want[t.name]:
                hint = " (looks transposed: HF stores Linear weights [out, in])" if t.shape == want[t.name][::-1] else ""
                if t.name in ("model.embed_tokens.weight", "lm_head.weight") and t.shape[1:] == want[t.name][1:]:
                    hint = f" (the tensor has {t.shape[0]} rows, config.json vocab_size is {cfg.vocab_size})"
                wrong.append(f"{t.name} {list(t.shape)} but config.json implies {list(want[t.name])}{hint}")
            seen.add(t.name)
        elif t.name == TIED_COPY and cfg.tie_word_embeddings:
            step["role"] = "tied_copy"
            if t.shape != (cfg.vocab_size, cfg.hidden_size):
                wrong.append(f"{t.name} {list(t.shape)} but the tied embedding is {[cfg.vocab_size, cfg.hidden_size]}")
        elif BUFFER.match(t.name) and int(BUFFER.match(t.name).group(1)) < cfg.num_layers:
            step["role"] = "buffer"
        else:
            unknown.append(t.name)
        steps.append(step)
    missing = [k for k in want if k not in seen]
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} source key(s) without a target: {', '.join(unknown[:8])}"
                        + (" ..." if len(unknown) > 8 else ""))
    if missing:
        problems.append(f"{len(missing)} target parameter(s) without a source: {', '.join(missing[:8])}"
                        + (" ..." if len(missing) > 8 else ""))
    if wrong:
        problems.append("shape mismatch: " + "; ".join(wrong[:8]))
    if bad_dtype:
        problems.append("unsupported dtype: " + ", ".join(bad_dtype[:8]))
    if problems:
        raise LabkitError("cannot convert " + str(src.root) + ": " + " | ".join(problems),
                          "fix the checkpoint or config.json so names and shapes agree; nothing was written")
    return steps


def _check_target(steps: list[dict], cfg: ModelConfig) -> None:
    target = _target_shapes(cfg)
    got = {s["ms_name"]: tuple(s["shape"]) for s in steps if s["ms_name"]}
    diff = [f"{n}: target {list(target.get(n, ()))}, source {list(got.get(n, ()))}"
            for n in sorted(set(target) | set(got)) if target.get(n) != got.get(n)]
    if diff:
        raise LabkitError("the mindformers model does not match the mapped weights: " + "; ".join(diff[:8]),
                          "this is a mapping bug or an unsupported config; nothing was written")


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES + EXTRA_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    # only for checkpoints big enough to wait for; None = on unless stderr is not a terminal
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False,
                disable=None if total > 200e6 else True)


def mindformers_yaml(cfg: ModelConfig, seq_length: int | None = None) -> str:
    kw = llama_config_kwargs(cfg, seq_length=seq_length or cfg.max_position_embeddings)
    head = ("# mindformers model block for this checkpoint (CPU-safe flags; on Ascend set fused_rms_norm: true,\n"
            "# use_rope_slice: false, use_flash_attention: true). Weights: model.ckpt beside this file.\n")
    return head + yaml.safe_dump({"model": {"model_config": {"type": "LlamaConfig", **kw},
                                            "arch": {"type": "LlamaForCausalLM"}}}, sort_keys=False)


def hf2ms(src: str | Path, dst: str | Path, dtype: str | None = None, overwrite: bool = False,
          check_target: bool = True) -> dict:
    """Convert an HF Llama checkpoint directory into a converted directory (see the module docstring)."""
    if dtype is not None and dtype not in DTYPES:
        raise LabkitError(f"--dtype {dtype} is not supported", f"use one of {', '.join(DTYPES)}")
    t0 = time.perf_counter()
    check_output_dir(dst, overwrite)  # before mindformers' import below: a refusal answers at once
    source = open_hf(src)
    cfg = model_config_from_hf(source.config, name=Path(src).resolve().name)
    steps = _plan(source, cfg)
    check_tokenizer_fits(source.root, cfg.vocab_size, f"{source.root / 'config.json'}",
                         "put the tokenizer the model was trained with beside its weights in --src, or convert and "
                         "then give the embeddings a row per token id (`labkit tokenizer resize-embeddings`)")
    if check_target:
        _check_target(steps, cfg)  # imports mindformers: seconds of fixed cost, excluded from MB/s
    t1 = time.perf_counter()
    embed_crc = None
    total = sum(t.nbytes for t in source.tensors)
    with atomic_dir(dst, overwrite=overwrite) as tmp, _progress(total, "hf2ms") as bar:
        writer = CkptWriter(tmp / "model.ckpt")
        try:
            for t, step in zip(source.tensors, steps):
                arr = source.read(t)
                step["crc32"] = zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B"))
                if step["role"] == "param":
                    out = dtype or t.dtype
                    step["stored_dtype"] = out
                    writer.write(step["ms_name"], cast(arr, t.dtype, out), out)
                    if t.name == "model.embed_tokens.weight":
                        embed_crc = (t.dtype, step["crc32"])
                elif step["role"] == "buffer":
                    step["data_b64"] = base64.b64encode(arr.tobytes()).decode()
                    _check_inv_freq(t.name, as_float32(arr, t.dtype), cfg)
                else:
                    step["copy_of"] = "model.embed_tokens.weight"
                bar.update(t.nbytes)
                del arr
        finally:
            writer.close()
        for s in steps:  # a tied lm_head must be the embedding, bit for bit
            if s["role"] == "tied_copy" and (s["source_dtype"], s["crc32"]) != embed_crc:
                raise LabkitError(f"{s['hf_name']} differs from model.embed_tokens.weight but tie_word_embeddings is "
                                  "true", "set tie_word_embeddings: false in config.json if the head is separate")
        stored = sorted({s["stored_dtype"] for s in steps if "stored_dtype" in s})
        record = dict(format="labkit-converted/1", labkit_version=__version__, direction="hf2ms",
                      source=dict(format=source.format, files=source.files, sharded=source.index is not None,
                                  index_metadata=(source.index or {}).get("metadata"), metadata=source.metadata),
                      dtype=stored[0] if len(stored) == 1 else "mixed", tensors=steps, hf_config=source.config)
        (tmp / "model.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
        (tmp / "mindformers_model.yaml").write_text(mindformers_yaml(cfg), encoding="utf-8")
        record["copied_files"] = _copy_side_files(source.root, tmp)
        (tmp / "conversion.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
        written = writer.bytes
    end = time.perf_counter()
    return dict(ok=True, direction="hf2ms", src=str(src), dst=str(dst), tensors=len(steps),
                parameters=num_params(cfg), source_format=source.format, sharded=source.index is not None,
                source_dtypes=sorted({t.dtype for t in source.tensors}), dtype=record["dtype"], bytes_read=total,
                bytes_written=written, seconds=round(end - t0, 3), check_seconds=round(t1 - t0, 3),
                mb_per_s=round(total / 1e6 / max(end - t1, 1e-9), 1), copied_files=record["copied_files"],
                warnings=source.nonfinite_warnings())


def _check_inv_freq(name: str, inv: np.ndarray, cfg: ModelConfig) -> None:
    d = cfg.head_dim
    expect = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if inv.shape != expect.shape or not np.allclose(inv, expect, rtol=1e-3):
        raise LabkitError(f"{name} does not match rope_theta={cfg.rope_theta:g} from config.json",
                          "the checkpoint was trained with another RoPE base: fix rope_theta in config.json")


# ------------------------------------------------------------------------------------- converted dirs


def load_converted(directory: str | Path, bf16: str = "float32") -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(ModelConfig, {mindformers name: numpy array}). numpy has no bfloat16: bf16 tensors come back as float32
    (exact) or, with bf16="bits", as their uint16 bit patterns."""
    cfg = read_model_config(directory)
    path = Path(directory) / "model.ckpt"
    if not path.is_file():
        raise LabkitError(f"{path} not found", "convert again: the directory is incomplete")
    out = {}
    for name, e in ckpt_index(path).items():
        arr = read_ckpt_tensor(path, e)
        out[name] = arr if (e.dtype != "bfloat16" or bf16 == "bits") else as_float32(arr, "bfloat16")
    return cfg, out


def write_converted(dst: str | Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: str = "float32",
                    overwrite: bool = False, copy_from: str | Path | None = None) -> Path:
    """Write a converted directory from mindformers-named float arrays (e.g. after resizing the embeddings).
    Tokenizer/generation files and the HF record (names, order) are carried over from `copy_from`."""
    want = ms_shapes(cfg)
    diff = sorted(n for n in set(want) | set(tensors) if n not in tensors or want.get(n) != tuple(tensors[n].shape))
    if diff:
        raise LabkitError(f"tensors do not fit model {cfg.name}: {', '.join(diff[:8])}",
                          "give every mindformers parameter with the shape the config implies")
    with atomic_dir(dst, overwrite=overwrite) as tmp:
        w = CkptWriter(tmp / "model.ckpt")
        try:
            for n in want:
                src_dt = "bfloat16" if tensors[n].dtype == np.uint16 else str(tensors[n].dtype)
                w.write(n, cast(tensors[n], src_dt, dtype), dtype)
        finally:
            w.close()
        (tmp / "model.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
        (tmp / "mindformers_model.yaml").write_text(mindformers_yaml(cfg), encoding="utf-8")
        if copy_from:
            _copy_side_files(Path(copy_from), tmp)
            rec_path = Path(copy_from) / "conversion.json"
            if rec_path.is_file():
                rec = json.loads(rec_path.read_text(encoding="utf-8"))
                for s in rec["tensors"]:
                    if s.get("ms_name") in tensors:
                        s["shape"] = list(tensors[s["ms_name"]].shape)
                rec["dtype"] = dtype
                (tmp / "conversion.json").write_text(json.dumps(rec, indent=1), encoding="utf-8")
    return Path(dst)


# ------------------------------------------------------------------------------------- ms2hf


def _ms2hf_plan(src: Path, cfg: ModelConfig, index: dict, dtype: str | None) -> tuple[list[dict], dict | None]:
    """The HF tensors to write (name, file, dtypes, shapes) and the conversion record, when there is one: its names,
    order, files and dtypes are kept; shapes come from the checkpoint (it may have been resized)."""
    want = {hf_to_ms(k): (k, v) for k, v in expected_hf_shapes(cfg).items()}
    check_weights(str(src / "model.ckpt"), index, cfg, "the checkpoint and model.yaml must describe the same model",
                  against=str(src / "model.yaml"))
    rec_path = src / "conversion.json"
    rec = json.loads(rec_path.read_text(encoding="utf-8")) if rec_path.is_file() else None
    if rec and not cfg.tie_word_embeddings:  # untied since: lm_head is a parameter now
        rec["tensors"] = [s for s in rec["tensors"] if s["role"] != "tied_copy"]
    if rec:
        steps = [s for s in rec["tensors"] if s["role"] != "param" or s["ms_name"] in index]
        have = {s["ms_name"] for s in steps}
        steps += [dict(hf_name=want[n][0], ms_name=n, role="param", source_dtype=index[n].dtype,
                       file=rec["source"]["files"][-1]) for n in want if n not in have]
        if rec["source"]["format"] == "pytorch_bin":
            for s in steps:
                s["file"] = re.sub(r"^pytorch_model", "model", s["file"]).replace(".bin", ".safetensors")
    else:
        steps = [dict(hf_name=h, ms_name=n, role="param", source_dtype=index[n].dtype, file="model.safetensors")
                 for n, (h, _) in want.items()]
    embed = hf_to_ms("model.embed_tokens.weight")
    for s in steps:
        ms_name = embed if s["role"] == "tied_copy" else s.get("ms_name")
        s["out_dtype"] = dtype or s["source_dtype"]
        s["out_shape"] = tuple(index[ms_name].shape) if ms_name else tuple(s["shape"])
    return steps, rec


def _write_hf(tmp: Path, src: Path, cfg: ModelConfig, steps: list[dict], rec: dict | None, index: dict,
              bar) -> tuple[list[str], int, dict, list[str]]:
    """safetensors file(s), the index when sharded, config.json and the tokenizer files into `tmp`."""
    ckpt, embed = src / "model.ckpt", hf_to_ms("model.embed_tokens.weight")
    by_hf = {s["hf_name"]: s for s in steps}

    def fetch(hf_name: str, out_dtype: str) -> np.ndarray:
        s = by_hf[hf_name]
        if s["role"] == "buffer":
            return np.frombuffer(base64.b64decode(s["data_b64"]), STORE[s["source_dtype"]]).reshape(s["shape"])
        e = index[embed if s["role"] == "tied_copy" else s["ms_name"]]
        return cast(read_ckpt_tensor(ckpt, e), e.dtype, out_dtype)

    files = list(dict.fromkeys(s["file"] for s in steps))
    total = sum(int(np.prod(s["out_shape"])) * np.dtype(STORE[s["out_dtype"]]).itemsize for s in steps)
    meta = {"format": "pt", **(((rec or {}).get("source") or {}).get("metadata") or {})}
    out_dtypes = sorted({s["out_dtype"] for s in steps})
    crcs: dict[str, int] = {}
    for f in files:
        items = [(s["hf_name"], s["out_dtype"], s["out_shape"]) for s in steps if s["file"] == f]
        crcs.update(st_write(tmp / f, items, fetch, meta, bar))
    if len(files) > 1:
        imeta = dict((rec or {}).get("source", {}).get("index_metadata") or {})
        imeta["total_size"] = total
        wmap = {s["hf_name"]: s["file"] for s in steps}
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": imeta, "weight_map": wmap}, indent=2), encoding="utf-8")
    hf_cfg = hf_config_from_model(cfg, (rec or {}).get("hf_config"), out_dtypes[0] if len(out_dtypes) == 1
                                  else "float32")
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    return files, total, crcs, _copy_side_files(src, tmp)


def ms2hf(src: str | Path, dst: str | Path, dtype: str | None = None, overwrite: bool = False) -> dict:
    """Write an HF checkpoint (config.json, safetensors, index when sharded, tokenizer files) from a converted dir,
    or from a training checkpoint (a `labkit train` run folder or one of its checkpoints/step_* folders)."""
    if dtype is not None and dtype not in DTYPES:
        raise LabkitError(f"--dtype {dtype} is not supported", f"use one of {', '.join(DTYPES)}")
    src = Path(src)
    if not (src / "model.yaml").is_file() and is_training_checkpoint(src):
        return _ms2hf_from_training(src, dst, dtype, overwrite)
    t0 = time.perf_counter()
    cfg = read_model_config(src)
    if not (src / "model.ckpt").is_file():
        raise LabkitError(f"{src / 'model.ckpt'} not found", "convert again: the directory is incomplete")
    index = ckpt_index(src / "model.ckpt")
    steps, rec = _ms2hf_plan(src, cfg, index, dtype)
    check_tokenizer_fits(src, cfg.vocab_size, str(src / "model.yaml"), CONVERTED_TOKENIZER_FIX)
    total = sum(int(np.prod(s["out_shape"])) * np.dtype(STORE[s["out_dtype"]]).itemsize for s in steps)
    with atomic_dir(dst, overwrite=overwrite) as tmp, _progress(total, "ms2hf") as bar:
        files, total, crcs, copied = _write_hf(tmp, src, cfg, steps, rec, index, bar)
    by_hf = {s["hf_name"]: s for s in steps}
    exact = [s["hf_name"] for s in steps if "crc32" in s and s["out_dtype"] == s["source_dtype"]
             and tuple(s["shape"]) == s["out_shape"]]
    same = sum(crcs[n] == by_hf[n]["crc32"] for n in exact)
    secs = time.perf_counter() - t0
    out_dtypes = sorted({s["out_dtype"] for s in steps})
    return dict(ok=True, direction="ms2hf", src=str(src), dst=str(dst), tensors=len(steps), files=files,
                dtype=out_dtypes[0] if len(out_dtypes) == 1 else "mixed", bytes_written=total,
                seconds=round(secs, 3), mb_per_s=round(total / 1e6 / max(secs, 1e-9), 1), copied_files=copied,
                crc_checked=len(exact), crc_matches_source=same,
                bit_exact_to_source=(same == len(exact) == len(steps)) if rec else None)


# ------------------------------------------------------------------------------ training checkpoints


def is_training_checkpoint(path: str | Path) -> bool:
    return training_checkpoint(path) is not None


def run_tokenizer(run: RunConfig) -> Path:
    """The tokenizer a run trained with: its dataset's (recorded in stats.json) or data.tokenizer."""
    if run.data.dataset:
        stats = lab_path(run.data.dataset) / "stats.json"
        if stats.is_file():
            return lab_path(json.loads(stats.read_text(encoding="utf-8")).get("tokenizer", run.data.tokenizer))
    return lab_path(run.data.tokenizer)


def _ms2hf_from_training(src: Path, dst, dtype: str | None, overwrite: bool) -> dict:
    """A training checkpoint -> a converted directory (model weights only, float32, with the run's tokenizer) in a
    temporary folder -> HF, the same way as any converted directory."""
    import tempfile

    ck = training_checkpoint(src)
    meta = json.loads((ck / "state.json").read_text(encoding="utf-8"))
    if not isinstance(meta.get("config"), dict):
        raise LabkitError(f"{ck / 'state.json'} holds no run config", "give a checkpoint written by labkit train")
    run = load(RunConfig, meta["config"], f"{ck / 'state.json'}: config")
    cfg = run.model_config()
    path = ck / "state.ckpt"
    check_weights(f"checkpoint {ck}", ckpt_index(path, any_dtype=True), cfg, "give a checkpoint written by labkit "
                  "train (its state.ckpt and state.json belong together)", against="its state.json")
    tok = run_tokenizer(run)
    check_tokenizer_fits(tok, cfg.vocab_size, f"checkpoint {ck}", CONVERTED_TOKENIZER_FIX)
    import mindspore as ms

    names = set(ms_shapes(cfg))
    # MindSpore's reader: the state also holds integer counters (global_step), which the streamed reader refuses
    params = ms.load_checkpoint(str(path), choice_func=lambda n: n in names)
    tensors = {n: p.asnumpy().astype(np.float32) for n, p in params.items()}
    Path(dst).resolve().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".ms2hf-", dir=Path(dst).resolve().parent) as tmp:
        conv = write_converted(Path(tmp) / "converted", cfg, tensors, copy_from=tok if tok.is_dir() else None)
        r = ms2hf(conv, dst, dtype=dtype, overwrite=overwrite)
    return dict(r, src=str(src), checkpoint=str(ck), step=meta.get("step"), tokenizer=str(tok))


# ------------------------------------------------------------------------------------------- CLI


def add_cli(parser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION")
    a = sub.add_parser("hf2ms", help="HF Llama checkpoint -> converted MindSpore directory")
    a.add_argument("--src", help="HF model directory (config.json + safetensors or pytorch_model*.bin)")
    a.add_argument("--dst", help="output directory (written atomically)")
    a.add_argument("--dtype", choices=DTYPES, help="stored dtype (default: each tensor's source dtype)")
    a.add_argument("--overwrite", action="store_true", help="replace --dst if it exists")
    a.add_argument("--show-mapping", action="store_true", help="print the HF -> mindformers name mapping and exit")
    add_common_flags(a)
    a.set_defaults(func=_cli_hf2ms)
    b = sub.add_parser("ms2hf", help="converted MindSpore directory -> HF checkpoint")
    b.add_argument("--src", required=True, help="directory written by hf2ms (model.ckpt + model.yaml), or a labkit "
                                                 "train run folder / checkpoints/step_* folder")
    b.add_argument("--dst", required=True, help="HF output directory (written atomically)")
    b.add_argument("--dtype", choices=DTYPES, help="output dtype (default: the recorded source dtype)")
    b.add_argument("--overwrite", action="store_true", help="replace --dst if it exists")
    add_common_flags(b)
    b.set_defaults(func=_cli_ms2hf)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _summary(r: dict) -> str:
    check = f", of which {r['check_seconds']:.1f} s reading and checking" if "check_seconds" in r else ""
    return (f"{r['direction']}: {r['src']} -> {r['dst']}\n  {r['tensors']} tensors, dtype {r['dtype']}, "
            f"{r.get('bytes_read', r['bytes_written']) / 1e6:.1f} MB in {r['seconds']:.2f} s{check}; "
            f"{r['mb_per_s']} MB/s while streaming" + (f"\n  copied: {', '.join(r['copied_files'])}"
                                                      if r["copied_files"] else "")
            + "".join(f"\n  warning: {w} (copied as is; training or parity from it is meaningless)"
                      for w in r.get("warnings", [])))


def _cli_hf2ms(args) -> int:
    if args.show_mapping:
        rules = [dict(hf=r.hf, ms=r.ms, shape=r.shape, layout=r.layout) for r in MAPPING]
        emit(args, {"ok": True, "mapping": rules, "tied_copy": TIED_COPY, "buffers": BUFFER.pattern}, mapping_table())
        return 0
    if not args.src or not args.dst:
        raise LabkitError("hf2ms needs --src and --dst", "labkit convert hf2ms --src HF_DIR --dst OUT_DIR")
    r = hf2ms(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    emit(args, r, _summary(r))
    return 0


def _cli_ms2hf(args) -> int:
    r = ms2hf(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    text = _summary(r)
    if r["bit_exact_to_source"] is not None:
        text += f"\n  bit-exact to the original HF tensors: {r['bit_exact_to_source']} " \
                f"({r['crc_matches_source']}/{r['tensors']} crc32 match)"
    emit(args, r, text)
    return 0
