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
    return r


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
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=r, timeout=600)
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
                                             "plan"}

