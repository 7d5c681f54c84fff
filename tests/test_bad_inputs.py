"""Hostile inputs, table-driven, through the real command line (`python -m labkit ...` in a subprocess).

Every refusal must: exit 1 or 2; print exactly one `labkit <command>: error:` line that names the file, key or
parameter at fault, followed by a fix that suits that input; print no traceback; and leave nothing at the output
path that the next step would read. Inputs that are unusual but legitimate (a GPT-2 byte-level BPE compared fast vs
slow, WordPiece, paths with spaces and Chinese characters, NaN weights in a conversion) must instead WORK, and say
what they found. Fixtures are built offline: tokenizers with the `tokenizers` library, a small random Llama with
transformers, corrupt files by hand.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `make check` leaves this file out (see pyproject.toml's markers)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TOK = ROOT / "data" / "tokenizer"
TEXTS = "hello world\nthe quick brown fox\n中文 测试 ，。\n  two  spaces\n"


# ------------------------------------------------------------------------------------------- fixtures


def _gpt2_dir(d: Path, texts: list[str]) -> Path:
    from tokenizers import ByteLevelBPETokenizer

    t = ByteLevelBPETokenizer()
    t.train_from_iterator(texts, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    d.mkdir(parents=True)
    t.save_model(str(d))  # vocab.json + merges.txt: what transformers' slow GPT2Tokenizer reads
    t.save(str(d / "tokenizer.json"))
    eot = "<|endoftext|>"
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", "bos_token": eot,
                                                         "eos_token": eot, "unk_token": eot}))
    return d


def _wordpiece_dir(d: Path, texts: list[str]) -> Path:
    from tokenizers import BertWordPieceTokenizer
    from tokenizers.processors import BertProcessing

    t = BertWordPieceTokenizer(lowercase=True)
    t.train_from_iterator(texts, vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    t.post_processor = BertProcessing(("[SEP]", t.token_to_id("[SEP]")), ("[CLS]", t.token_to_id("[CLS]")))
    d.mkdir(parents=True)
    t.save_model(str(d))  # vocab.txt: what the slow BertTokenizer reads
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True}))
    return d


def _shipped_copy(d: Path, drop=(), files: dict | None = None) -> Path:
    shutil.copytree(SHIPPED_TOK, d)
    for f in drop:
        (d / f).unlink()
    for name, data in (files or {}).items():
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return d


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """Every bad (and unusual-but-good) input, built once. Paths are absolute; outputs go under `out/`."""
    from safetensors.torch import load_file, save_file

    from labkit.weights import convert, parity

    r = tmp_path_factory.mktemp("hostile")
    texts = ["hello world, this is a small corpus.", "the quick brown fox jumps over the lazy dog",
             "中文 测试 ，。", "  two  spaces"] * 30
    (r / "texts.txt").write_text(TEXTS, encoding="utf-8")
    tok = r / "tok"
    _gpt2_dir(tok / "gpt2", texts)
    _wordpiece_dir(tok / "wordpiece", texts)
    _shipped_copy(tok / "jsononly", drop=("tokenizer.model",))
    _shipped_copy(tok / "notsp", files={"tokenizer.model": b"<html>this is a download error page</html>\n"})
    smap = json.loads((SHIPPED_TOK / "special_tokens_map.json").read_text())
    smap["eos_token"]["content"] = "<|eot|>"
    _shipped_copy(tok / "specials", files={"special_tokens_map.json": json.dumps(smap)})
    _shipped_copy(tok / "分词 器")  # a path with a space and Chinese characters: must work

    hf = parity.make_hf_llama(r / "hf", seed=1)
    convert.hf2ms(hf, r / "ms", check_target=False)
    for name in ("badheader", "badjson", "missingshard", "nan", "模型 目录"):
        shutil.copytree(hf, r / f"hf_{name}")
    st = r / "hf_badheader" / "model.safetensors"
    raw = st.read_bytes()
    st.write_bytes(raw[:8] + b"{garbage" + raw[16:])  # header length intact, JSON broken
    (r / "hf_badjson" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,,}')
    (r / "hf_missingshard" / "model.safetensors").unlink()
    (r / "hf_missingshard" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    sd = load_file(r / "hf_nan" / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    sd["model.norm.weight"][1] = float("inf")
    save_file(sd, r / "hf_nan" / "model.safetensors", metadata={"format": "pt"})

    (r / "tabs.yaml").write_text("model:\n  preset: tiny\ntrain:\n\tsteps: 3\n", encoding="utf-8")
    (r / "gbk.yaml").write_bytes("# 训练配置\nmodel:\n  preset: tiny\n".encode("gbk"))
    corp = r / "corpus"
    corp.mkdir()
    lines = "\n".join(json.dumps({"text": f"document {i}: " + texts[i % len(texts)]}) for i in range(3000))
    gz = gzip.compress(lines.encode())
    (corp / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    (corp / "content.jsonl").write_text(json.dumps({"content": "no text field here"}) + "\n")
    (corp / "empty").mkdir()
    good = r / "语料 目录"
    good.mkdir()
    (good / "docs.jsonl").write_text(lines + "\n", encoding="utf-8")
    (r / "ro").mkdir()
    (r / "out").mkdir()
    _pairs(r, hf)
    return r


def _pairs(r: Path, hf: Path) -> None:
    """What the pairing cases combine: a tiny trained run (one `labkit train`, ~10 s) and copies of it whose
    state.json no longer describes their weights or names a tokenizer bigger than the model, converted weights in
    bfloat16 or beside a tokenizer bigger than their vocabulary, and datasets tokenized otherwise (a stats.json
    only: these are refused before a sample is read)."""
    import yaml

    from labkit.weights import convert

    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3", "TQDM_DISABLE": "1"}
    subprocess.run([sys.executable, "-m", "labkit", "train", "--steps", "2", "--set", "train.save_every=2", "--set",
                    "train.eval_every=0", "--output", str(r / "run")], check=True, cwd=r, env=env,
                   capture_output=True, timeout=600)
    tj = json.loads((SHIPPED_TOK / "tokenizer.json").read_text(encoding="utf-8"))
    tj["added_tokens"].append(dict(tj["added_tokens"][-1], id=5000, content="<big>"))
    _shipped_copy(r / "tok" / "big", files={"tokenizer.json": json.dumps(tj)})
    for name, key, value in (("gen_wide", "model", {"hidden_size": 128}),
                             ("gen_bigtok", "data", {"tokenizer": str(r / "tok" / "big")})):
        shutil.copytree(r / "run", r / name)
        state = r / name / "checkpoints" / "step_000002" / "state.json"
        meta = json.loads(state.read_text(encoding="utf-8"))
        meta["config"][key].update(value)
        state.write_text(json.dumps(meta), encoding="utf-8")
    convert.hf2ms(hf, r / "ms_bf16", dtype="bfloat16", check_target=False)
    for name, src in (("hf_bigtok", hf), ("ms_bigtok", r / "ms")):
        shutil.copytree(src, r / name)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(SHIPPED_TOK / f, r / name / f)
    shutil.copytree(r / "ms", r / "ms_badyaml")
    model = yaml.safe_load((r / "ms_badyaml" / "model.yaml").read_text(encoding="utf-8"))
    (r / "ms_badyaml" / "model.yaml").write_text(yaml.safe_dump(dict(model, vocab_size=999)), encoding="utf-8")
    for name, stats in (("ds_eos", {"eos_id": 0}), ("ds_400", {"vocab_size": 400, "tokenizer": str(r / "tok/gpt2")}),
                        ("ds_specials", {"tokenizer": str(r / "tok" / "specials")})):
        (r / name).mkdir()
        (r / name / "stats.json").write_text(json.dumps({"format": "labkit-dataset/1", "seq_len": 128, "files": {},
                                                         "n_samples": 1000, "vocab_size": 4096, "eos_id": 2,
                                                         "tokenizer": str(SHIPPED_TOK), **stats}))


@dataclass
class Case:
    id: str
    argv: list  # "{r}" is replaced by the fixture root
    codes: tuple = (2,)  # allowed exit statuses
    names: tuple = ()  # substrings the error line must contain (file, key, parameter)
    fix: str = ""  # substring the fix line must contain
    out: str | None = None  # output path that must not exist afterwards ("{r}/...")
    works: bool = False  # an unusual but legitimate input: exit 0 (or the command's own verdict), no error line
    says: tuple = ()  # substrings of stdout+stderr for working cases
    readonly: str | None = None  # a folder mounted read-only for this run
    holder: bool = False  # a live process holds the output folder's lock
    unchanged: str | None = None  # a folder the refusal must leave exactly as it was (a run it would resume)


def _tok_cases() -> list[Case]:
    out = []
    runs = {("gpt2", "hf"), ("gpt2", "hf-slow"), ("wordpiece", "hf"), ("wordpiece", "hf-slow"),
            ("jsononly", "hf"), ("notsp", "hf")}
    refusals = {  # (family, impl): (names in the error line, fix)
        ("gpt2", "mindformers"): (("mindformers", "byte-level BPE", "SentencePiece"), "hf and hf-slow"),
        ("wordpiece", "mindformers"): (("mindformers", "WordPiece", "SentencePiece"), "hf and hf-slow"),
        ("jsononly", "hf-slow"): (("LlamaTokenizer", "tokenizer.model"), "copy tokenizer.model"),
        ("jsononly", "mindformers"): (("mindformers", "tokenizer.model"), "--*-impl hf"),
        ("notsp", "hf-slow"): (("tokenizer.model", "not a SentencePiece model"), "replace tokenizer.model"),
        ("notsp", "mindformers"): (("tokenizer.model", "not a SentencePiece model"), "replace tokenizer.model"),
    }
    for fam in ("gpt2", "wordpiece", "jsononly", "notsp", "specials"):
        for impl in ("hf", "hf-slow", "mindformers"):
            for side in ("a", "b"):
                other = "b" if side == "a" else "a"
                argv = ["tokenizer", "compare", f"--{side}", f"{{r}}/tok/{fam}", f"--{side}-impl", impl,
                        f"--{other}", f"{{r}}/tok/{fam}", f"--{other}-impl", "hf", "--texts", "{r}/texts.txt"]
                if (fam, impl) in runs:
                    if side == "a":
                        out.append(Case(f"tok-{fam}-{impl}", argv, codes=(0,), works=True, says=("ALIGNED",)))
                elif fam == "specials":
                    if impl == "hf" and side == "b":
                        continue  # the same as side a
                    out.append(Case(f"tok-{fam}-{impl}-{side}", argv, names=("special_tokens_map.json", "eos_token",
                                                                             "<|eot|>"), fix="name the same tokens"))
                else:
                    names, fix = refusals[(fam, impl)]
                    out.append(Case(f"tok-{fam}-{impl}-{side}", argv, names=names, fix=fix))
    return out


RESUME = ["train", "--resume", "--output", "{r}/run", "--steps", "4"]  # the tiny run of the fixture, to step 4
HF_TINY = [x for kv in ("vocab_size=1000", "hidden_size=64", "intermediate_size=176", "num_heads=4", "num_kv_heads=2",
                        "tie_word_embeddings=true") for x in ("--set", f"model.{kv}")]  # parity.TINY_HF's model

CASES = _tok_cases() + [
    # tokenizer: other actions
    Case("tok-train-cut-gzip", ["tokenizer", "train", "--corpus", "{r}/corpus/cut.jsonl.gz", "--vocab-size", "300",
                                "--output", "{r}/out/tok1"], names=("cut.jsonl.gz", "damaged gzip"),
         fix="gzip -t", out="{r}/out/tok1"),
    Case("tok-train-readonly", ["tokenizer", "train", "--corpus", "{r}/语料 目录", "--vocab-size", "400",
                                "--output", "{r}/ro/tok"], names=("ro/tok", "Read-only"), fix="--output",
         out="{r}/ro/tok", readonly="{r}/ro"),
    Case("tok-resize-not-converted", ["tokenizer", "resize-embeddings", "--model", "{r}/hf", "--vocab-size", "2000",
                                      "--output", "{r}/out/resized"], names=("model.ckpt",), fix="labkit convert",
         out="{r}/out/resized"),
    Case("tok-compare-chinese-path", ["tokenizer", "compare", "--a", "{r}/tok/分词 器", "--b", "{r}/tok/分词 器",
                                      "--b-impl", "mindformers", "--texts", "{r}/texts.txt"],
         codes=(0,), works=True, says=("ALIGNED",)),
    # convert
    Case("convert-bad-header", ["convert", "hf2ms", "--src", "{r}/hf_badheader", "--dst", "{r}/out/c1"],
         names=("model.safetensors", "corrupt safetensors header"), fix="re-download", out="{r}/out/c1"),
    Case("convert-config-not-json", ["convert", "hf2ms", "--src", "{r}/hf_badjson", "--dst", "{r}/out/c2"],
         names=("config.json", "not valid JSON"), fix="restore config.json", out="{r}/out/c2"),
    Case("convert-missing-shard", ["convert", "hf2ms", "--src", "{r}/hf_missingshard", "--dst", "{r}/out/c3"],
         names=("model.safetensors.index.json", "model-00001-of-00002.safetensors"), fix="copy every shard",
         out="{r}/out/c3"),
    Case("convert-nan-warns", ["convert", "hf2ms", "--src", "{r}/hf_nan", "--dst", "{r}/out/c_nan"], codes=(0,),
         works=True, says=("warning: model.layers.0.mlp.up_proj.weight holds 1 NaN",
                           "model.norm.weight holds 0 NaN and 1 Inf")),
    Case("convert-chinese-paths", ["convert", "hf2ms", "--src", "{r}/hf_模型 目录", "--dst", "{r}/out/转换 结果"],
         codes=(0,), works=True, says=("hf2ms:",)),
    Case("convert-readonly", ["convert", "hf2ms", "--src", "{r}/hf", "--dst", "{r}/ro/c"],
         names=("ro/c", "Read-only"), fix="--output", out="{r}/ro/c", readonly="{r}/ro"),
    Case("convert-dst-exists", ["convert", "hf2ms", "--src", "{r}/hf", "--dst", "{r}/ms"],
         names=("/ms", "already exists"), fix="another --output"),
    # parity
    Case("parity-nan-hf", ["parity", "--hf", "{r}/hf_nan", "--ms", "{r}/ms"], codes=(1,),
         names=("hf_nan", "model.layers.0.mlp.up_proj.weight", "non-finite"), fix="re-download"),
    Case("parity-config-not-json", ["parity", "--hf", "{r}/hf_badjson", "--ms", "{r}/ms"],
         names=("hf_badjson", "config.json"), fix="config.json"),
    Case("parity-ms-missing", ["parity", "--hf", "{r}/hf", "--ms", "{r}/nowhere"], names=("nowhere",), fix="convert"),
    # data
    Case("data-cut-gzip", ["data", "build", "--corpus", "{r}/corpus/cut.jsonl.gz", "--tokenizer", str(SHIPPED_TOK),
                           "--seq-len", "16", "--output", "{r}/out/d1"], names=("cut.jsonl.gz", "damaged gzip"),
         fix="gzip -t", out="{r}/out/d1"),
    Case("data-no-text-field", ["data", "build", "--corpus", "{r}/corpus/content.jsonl", "--tokenizer",
                                str(SHIPPED_TOK), "--seq-len", "16", "--output", "{r}/out/d2"],
         names=("content.jsonl:1", "'text'", "content"), fix="--text-field", out="{r}/out/d2"),
    Case("data-empty-dir", ["data", "build", "--corpus", "{r}/corpus/empty", "--tokenizer", str(SHIPPED_TOK),
                            "--seq-len", "16", "--output", "{r}/out/d3"], names=("corpus/empty",),
         fix="--corpus", out="{r}/out/d3"),
    Case("data-readonly", ["data", "build", "--corpus", "{r}/语料 目录", "--tokenizer", str(SHIPPED_TOK),
                           "--seq-len", "16", "--output", "{r}/ro/d"], names=("ro/d", "Read-only"), fix="--output",
         out="{r}/ro/d", readonly="{r}/ro"),
    Case("data-chinese-paths", ["data", "build", "--corpus", "{r}/语料 目录", "--tokenizer", "{r}/tok/分词 器",
                                "--seq-len", "16", "--output", "{r}/out/数据 集"], codes=(0,), works=True,
         says=("数据 集",)),
    # train
    Case("train-yaml-tabs", ["train", "--config", "{r}/tabs.yaml", "--output", "{r}/out/t1"],
         names=("tabs.yaml", "line 4 column 1"), fix="spaces", out="{r}/out/t1"),
    Case("train-yaml-gbk", ["train", "--config", "{r}/gbk.yaml", "--output", "{r}/out/t2"],
         names=("gbk.yaml", "not UTF-8", "line 1"), fix="UTF-8", out="{r}/out/t2"),
    Case("train-bad-key", ["train", "--set", "train.stepz=3", "--output", "{r}/out/t3"], names=("stepz",),
         fix="steps", out="{r}/out/t3"),
    Case("train-resume-nothing", ["train", "--resume", "--output", "{r}/out/t4", "--steps", "1"],
         names=("--resume", "t4"), fix="without --resume"),
    Case("train-locked-output", ["train", "--steps", "1", "--output", "{r}/out/busy"],
         names=("out/busy", "another run", ".labkit-lock-node0.json"), fix="wait for that run", holder=True),
    # launch
    Case("launch-yaml-tabs", ["launch", "--config", "{r}/tabs.yaml", "--dry-run", "--output", "{r}/out/l1"],
         names=("tabs.yaml", "line 4"), fix="spaces", out="{r}/out/l1"),
    Case("launch-yaml-gbk", ["launch", "--config", "{r}/gbk.yaml", "--dry-run", "--output", "{r}/out/l2"],
         names=("gbk.yaml", "not UTF-8"), fix="UTF-8", out="{r}/out/l2"),
    Case("launch-workers-0", ["launch", "--workers", "0", "--dry-run", "--output", "{r}/out/l3"],
         names=("workers",), fix="", out="{r}/out/l3"),
    # plan
    Case("plan-yaml-tabs", ["plan", "--config", "{r}/tabs.yaml", "--devices", "8", "--device-memory", "64"],
         names=("tabs.yaml", "line 4 column 1"), fix="spaces"),
    Case("plan-yaml-gbk", ["plan", "--config", "{r}/gbk.yaml", "--devices", "8", "--device-memory", "64"],
         names=("gbk.yaml", "not UTF-8"), fix="UTF-8"),
    Case("plan-devices-0", ["plan", "--preset", "tiny", "--devices", "0", "--device-memory", "64"],
         names=("devices",), fix=""),
    # run
    Case("run-params-tabs", ["run", "--params", "{r}/tabs.yaml", "--output", "{r}/out/r1"],
         names=("tabs.yaml", "line 4"), fix="spaces", out="{r}/out/r1"),
    Case("run-params-gbk", ["run", "--params", "{r}/gbk.yaml", "--output", "{r}/out/r2"],
         names=("gbk.yaml", "not UTF-8"), fix="UTF-8", out="{r}/out/r2"),
    Case("run-only-unknown", ["run", "--only", "99", "--output", "{r}/out/r3"], names=("--only 99",),
         out="{r}/out/r3"),
] + [  # every pair of artefacts a command combines, checked before anything is built (labkit.training.run_dir)
    # train --resume: the checkpoint against the config (the run folder must stay as it was)
    Case("train-resume-model-shape", [*RESUME, "--set", "model.hidden_size=128", "--set", "model.num_heads=4"],
         names=("run/checkpoints/step_000002", "model.hidden_size 256",
                "(model.tok_embeddings.embedding_weight [4096, 256])", "the config asks for 128"),
         fix="run/config.yaml", unchanged="{r}/run"),
    Case("train-resume-num-heads", [*RESUME, "--set", "model.num_heads=4", "--set", "model.num_kv_heads=2"],
         names=("step_000002", "model.num_heads 8", "asks for 4"), fix="run/config.yaml", unchanged="{r}/run"),
    Case("train-resume-amp-no-loss-scale", [*RESUME, "--set", "train.amp_level=O2"],
         names=("step_000002", "no loss-scale state", "amp_level O0", "amp_level O2"), fix="amp_level O0",
         unchanged="{r}/run"),
    Case("train-resume-amp-dtype", [*RESUME, "--set", "train.amp_level=O3"],
         names=("step_000002", "as float32", "parameters are float16", "amp_level O3"), fix="amp_level O0",
         unchanged="{r}/run"),
    Case("train-resume-seed", [*RESUME, "--seed", "7"], names=("step_000002", "train.seed 1234", "asks for 7"),
         fix="train.seed 1234", unchanged="{r}/run"),
    Case("train-resume-global-batch", [*RESUME, "--micro-batch", "4"],
         names=("step_000002", "global batch 8", "gives 4"), fix="micro_batch x dp x accum = 8", unchanged="{r}/run"),
    Case("train-resume-other-tokenizer", [*RESUME, "--set", "data.dataset={r}/ds_specials", "--set",
                                          "data.tokenizer={r}/tok/specials"],
         names=("ds_specials", "tokenized with", "tok/specials", "step_000002", "data/tokenizer"),
         fix="labkit data build --tokenizer", unchanged="{r}/run"),
    # train: the dataset against the config and its tokenizer, init_checkpoint against the model
    Case("train-dataset-other-tokenizer", ["train", "--set", "data.dataset={r}/ds_400", "--output", "{r}/out/t5"],
         names=("ds_400", "400 token ids", "data.tokenizer data/tokenizer has 4096"),
         fix="labkit data build --tokenizer data/tokenizer", out="{r}/out/t5"),
    Case("train-dataset-eos", ["train", "--set", "data.dataset={r}/ds_eos", "--output", "{r}/out/t6"],
         names=("ds_eos", "token id 0", "eos_token_id is 2"), fix="model.eos_token_id=0", out="{r}/out/t6"),
    Case("train-init-shape", ["train", "--set", "train.init_checkpoint={r}/ms", "--output", "{r}/out/t7"],
         names=("train.init_checkpoint", "ms/model.ckpt", "model.vocab_size 1000", "asks for 4096"),
         fix="ms/model.yaml", out="{r}/out/t7"),
    Case("train-init-dtype", ["train", *HF_TINY, "--set", "train.init_checkpoint={r}/ms_bf16", "--output",
                              "{r}/out/t8"],
         names=("ms_bf16/model.ckpt", "as bfloat16", "parameters are float32", "amp_level O0"),
         fix="--dtype float32", out="{r}/out/t8"),
    # launch: the same checks, before any process starts
    Case("launch-resume-model-shape", ["launch", "--workers", "1", "--dry-run", *RESUME[1:], "--set",
                                       "model.hidden_size=128", "--set", "model.num_heads=4"],
         names=("step_000002", "model.hidden_size 256", "asks for 128"), fix="run/config.yaml", unchanged="{r}/run"),
    Case("launch-init-shape", ["launch", "--workers", "1", "--dry-run", "--set", "train.init_checkpoint={r}/ms",
                               "--output", "{r}/out/l4"],
         names=("train.init_checkpoint", "model.vocab_size 1000", "asks for 4096"), fix="model.yaml",
         out="{r}/out/l4"),
    # generate: a checkpoint's weights against its own state.json, the tokenizer against the vocabulary
    Case("generate-weights-vs-state-json", ["generate", "--checkpoint", "{r}/gen_wide", "--prompt", "hi"],
         names=("gen_wide/checkpoints/step_000002", "model.hidden_size 256", "its state.json asks for 128"),
         fix="belong together"),
    Case("generate-tokenizer-too-big", ["generate", "--checkpoint", "{r}/gen_bigtok", "--prompt", "hi"],
         names=("tok/big", "up to 5000", "gen_bigtok/checkpoints/step_000002", "vocab_size 4096"),
         fix="tokenizer the model was trained with"),
    # convert and parity: converted weights against their model.yaml and the tokenizer beside them
    Case("convert-tokenizer-too-big", ["convert", "hf2ms", "--src", "{r}/hf_bigtok", "--dst", "{r}/out/c4"],
         names=("hf_bigtok", "tokenizer.json", "up to 4095", "config.json has vocab_size 1000"),
         fix="resize-embeddings", out="{r}/out/c4"),
    Case("convert-ms2hf-tokenizer-too-big", ["convert", "ms2hf", "--src", "{r}/ms_bigtok", "--dst", "{r}/out/c5"],
         names=("ms_bigtok", "up to 4095", "model.yaml has vocab_size 1000"), fix="resize-embeddings",
         out="{r}/out/c5"),
    Case("convert-ms2hf-weights-vs-state-json", ["convert", "ms2hf", "--src", "{r}/gen_wide", "--dst", "{r}/out/c6"],
         names=("gen_wide/checkpoints/step_000002", "model.hidden_size 256", "state.json asks for 128"),
         fix="belong together", out="{r}/out/c6"),
    Case("parity-ms-tokenizer-too-big", ["parity", "--hf", "{r}/hf", "--ms", "{r}/ms_bigtok"],
         names=("ms_bigtok", "up to 4095", "vocab_size 1000"), fix="resize-embeddings"),
    Case("parity-weights-vs-model-yaml", ["parity", "--hf", "{r}/hf", "--ms", "{r}/ms_badyaml"],
         names=("ms_badyaml/model.ckpt", "model.vocab_size 1000", "model.yaml asks for 999"), fix="convert again"),
]


def _readonly_wrap(argv: list, folder: str) -> list | None:
    """Run argv with `folder` mounted read-only: as root in a private mount namespace (root ignores mode bits)."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        return argv
    if not shutil.which("unshare"):
        return None
    script = ('mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && shift && exec "$@"')
    return ["unshare", "-m", "sh", "-c", script, "sh", folder, *argv]


def _listing(folder: str) -> dict:
    """Every file under `folder` with its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).rglob("*")}


def run_case(case: Case, r: Path) -> tuple[int, str, str]:
    sub = lambda s: s.replace("{r}", str(r))  # noqa: E731
    argv = [sys.executable, "-m", "labkit", *map(sub, case.argv)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3", "TQDM_DISABLE": "1"}
    holder = None
    if case.holder:  # another process writes the folder right now: a live pid in its lock file
        import socket

        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        busy = Path(sub(case.argv[case.argv.index("--output") + 1]))
        busy.mkdir(parents=True, exist_ok=True)
        (busy / ".labkit-lock-node0.json").write_text(json.dumps(
            {"pid": holder.pid, "host": socket.gethostname(), "node_rank": 0, "command": "labkit train",
             "started": "2026-12-01T00:00:00"}))
    if case.readonly:
        argv = _readonly_wrap(argv, sub(case.readonly))
        if argv is None:
            pytest.skip("no way to make a read-only folder here (not root: chmod; root: unshare -m)")
    before = _listing(sub(case.unchanged)) if case.unchanged else None
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=r, timeout=600)
        if before is not None:
            assert _listing(sub(case.unchanged)) == before, f"{case.unchanged} changed"
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case, fx):
    code, out, err = run_case(case, fx)
    both = out + err
    head = f"labkit {case.argv[0]}: error:"
    errors = [line for line in err.splitlines() if line.startswith(head)]
    assert "Traceback" not in both, both[-3000:]
    if case.works:
        assert code in case.codes, both[-3000:]
        assert not errors, errors
        for s in case.says:
            assert s in both, (s, both[-2000:])
        return
    assert code in case.codes and code in (1, 2), (code, both[-3000:])
    assert len(errors) == 1, err[-3000:]
    line = errors[0]
    for s in case.names:
        assert s in line, (s, line)
    if case.fix:
        fixes = [x for x in err.splitlines() if x.strip().startswith("fix:")]
        assert fixes and case.fix in fixes[0], (case.fix, err[-1500:])
    if case.out:
        target = Path(case.out.replace("{r}", str(fx)))
        assert not target.exists(), f"{target} exists after a refusal"
        leftovers = [p.name for p in target.parent.glob(f".tmp-{target.name}-*")]
        assert not leftovers, leftovers
    if case.holder:
        busy = fx / "out" / "busy"
        assert sorted(p.name for p in busy.iterdir()) == [".labkit-lock-node0.json"], list(busy.iterdir())


def test_table_is_big_enough():
    commands = {c.argv[0] for c in CASES}
    assert len(CASES) >= 40 and commands >= {"run", "convert", "parity", "tokenizer", "data", "train", "launch",
                                             "plan", "generate"}

