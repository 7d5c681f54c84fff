"""Tokenizers that match their weights: train a Llama-style SentencePiece BPE, compare implementations, grow a vocab.

A tokenizer directory (what `train` writes, HF layout; `data/tokenizer/` is one):
  tokenizer.model          the SentencePiece model: BPE, byte fallback, identity normaliser, <unk>=0 <s>=1 </s>=2
  tokenizer.json           the same model converted for HF's fast (Rust) tokenizer
  tokenizer_config.json    every knob spelled out, so HF fast, HF slow and mindformers read the same thing
  special_tokens_map.json  bos/eos/unk/pad
  labkit_tokenizer.json    how it was trained (trainer settings, corpus fingerprint, sha256 of the files)

Why each knob is pinned (measured with transformers 4.57.1 and mindformers 1.9.0; notebook 02 shows each one):
  normalization identity   SentencePiece's default `nmt_nfkc` rewrites text (full-width "，" becomes ","), but HF's
                           fast converter ignores the SentencePiece normaliser: fast and slow ids then differ, and
                           decode(encode(text)) != text. Identity keeps all three equal and the round trip lossless.
  remove_extra_whitespaces false   the default collapses runs of spaces, which the fast tokenizer does not.
  legacy: true             mindformers' LlamaTokenizer cannot load with legacy=false here (its bundled protobuf
                           module fails to import); HF warns when the key is missing.
  pad_token: <unk>         mindformers defaults pad to <unk> (id 0), HF to None: say it once, for everybody.
  add_prefix_space absent  setting it makes HF fast rebuild itself from tokenizer.model and ignore tokenizer.json;
                           `false` changes fast ids only (slow ignores it in legacy mode).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from pathlib import Path

from labkit.data.corpus import ReadReport, fingerprint, read_documents
from labkit.data.embeddings import EMBED, HEAD, resize_embeddings  # noqa: F401  (vocabulary growth lives there)
from labkit.data.tokenizer_files import check_loadable
from labkit.errors import LabkitError
from labkit.io import atomic_dir
from labkit.logs import quiet_mindformers, quiet_mindformers_console
from labkit.output import add_common_flags, emit
from labkit.paths import DATA, ROOT, lab_path

SHIPPED_TOKENIZER = DATA / "tokenizer"
IMPLS = ("hf", "hf-slow", "mindformers")
SPECIAL_NAMES = ("bos", "eos", "pad", "unk")
DECODE_CHECKS = 2000  # texts whose decoded strings are also compared (informational; ids decide `aligned`)

# SentencePiece trainer settings: Llama's own (byte fallback, digits split, whitespace kept, identity normaliser)
TRAINER = dict(model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
               remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
               allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
               unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", input_sentence_size=0,
               max_sentence_length=1 << 16, shuffle_input_sentence=False)


def _token_entry(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def tokenizer_config() -> dict:
    """The tokenizer_config.json written next to tokenizer.model (see the module docstring for each key)."""
    return {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "sp_model_kwargs": {},
        "added_tokens_decoder": {str(i): {**_token_entry(t), "special": True}
                                 for i, t in enumerate(("<unk>", "<s>", "</s>"))},
    }


def display_path(path) -> str:
    """A path as recorded in files we write: relative to the lab root when inside it, else just its name."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return p.name


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------- training


def _sentences(docs: list[str]):
    """SentencePiece learns from lines; newlines themselves are left to byte fallback (<0x0A>), as in Llama."""
    for doc in docs:
        for line in doc.split("\n"):
            if line.strip():
                yield line.rstrip("\r")


def write_hf_files(directory: str | os.PathLike, model_bytes: bytes, extra: dict | None = None) -> None:
    """tokenizer.model + tokenizer_config.json + special_tokens_map.json + tokenizer.json into `directory`."""
    from transformers import LlamaTokenizerFast
    from transformers.utils import logging as hf_logging

    d = Path(directory)
    (d / "tokenizer.model").write_bytes(model_bytes)
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    specials = {"bos_token": _token_entry("<s>"), "eos_token": _token_entry("</s>"),
                "unk_token": _token_entry("<unk>"), "pad_token": _token_entry("<unk>")}
    (d / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        fast = LlamaTokenizerFast.from_pretrained(str(d), from_slow=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    fast.backend_tokenizer.save(str(d / "tokenizer.json"))
    record = {"format": "labkit-tokenizer/1", **(extra or {}),
              "sha256": {f: _sha256(d / f) for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                                     "special_tokens_map.json")}}
    (d / "labkit_tokenizer.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n",
                                             encoding="utf-8")


def train(corpus, vocab_size: int, output, *, text_field: str = "text", split_on_blank_lines: bool = False,
          character_coverage: float = 0.995, normalization: str = "identity", overwrite: bool = False) -> dict:
    """Train a Llama-style SentencePiece BPE tokenizer on `corpus` and write an HF tokenizer directory."""
    import sentencepiece as spm


    if vocab_size < 300:
        raise LabkitError(f"--vocab-size {vocab_size} is too small",
                          "use at least 300: 256 byte tokens and 3 special tokens come first")
    if not 0.98 <= character_coverage <= 1:  # SentencePiece's own bounds
        raise LabkitError(f"--character-coverage {character_coverage} must be within [0.98, 1]", "e.g. 0.995")
    report = ReadReport()
    docs = read_documents(corpus, text_field=text_field, split_on_blank_lines=split_on_blank_lines, report=report)
    t0 = time.perf_counter()
    buf = io.BytesIO()
    settings = dict(TRAINER, vocab_size=vocab_size, character_coverage=character_coverage,
                    normalization_rule_name=normalization)
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=_sentences(docs), model_writer=buf, minloglevel=2,
                                       num_threads=os.cpu_count() or 1, **settings)
    except RuntimeError as e:
        msg = str(e).split("] ")[-1] or str(e)
        fix = ("lower --vocab-size or give more text" if "too high" in msg else
               "raise --vocab-size or lower --character-coverage" if "required_chars" in msg else
               "check --normalization (identity, nmt_nfkc, nfkc, nmt_nfkc_cf, nfkc_cf)")
        raise LabkitError(f"SentencePiece training failed: {msg}", fix) from None
    seconds = time.perf_counter() - t0
    model_bytes = buf.getvalue()
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    sample = docs[:: max(1, len(docs) // 500)]
    lossless = sum(sp.decode(sp.encode(d)) == d for d in sample)
    extra = {"trainer": settings, "corpus": [display_path(f) for f in report.files], "corpus_sha256": fingerprint(corpus),
             "n_documents": len(docs)}
    with atomic_dir(output, overwrite=overwrite) as tmp:
        write_hf_files(tmp, model_bytes, extra)
    n_byte = sum(sp.is_byte(i) for i in range(sp.get_piece_size()))
    return dict(ok=True, output=str(output), vocab_size=sp.get_piece_size(), byte_pieces=n_byte,
                n_documents=len(docs), normalization=normalization, character_coverage=character_coverage,
                train_seconds=round(seconds, 2), roundtrip_ok=lossless, roundtrip_checked=len(sample),
                warnings=report.summary())


def make_variant(src, dst, *, set_config: dict | None = None, drop_config: tuple = (), add_tokens: tuple = (),
                 overwrite: bool = False) -> Path:
    """Copy a tokenizer directory and change it the way real ones drift: keys of tokenizer_config.json set or
    removed (a removed special token also leaves special_tokens_map.json), tokens added (through HF, which writes them into tokenizer_config.json and tokenizer.json)."""
    src = lab_path(src)
    with atomic_dir(dst, overwrite=overwrite) as tmp:
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        cfg_path = tmp / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        cfg.update(set_config or {})
        for k in drop_config:
            cfg.pop(k, None)
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        smap_path = tmp / "special_tokens_map.json"
        if drop_config and smap_path.is_file():  # a special token dropped from the config goes from the map too
            smap = json.loads(smap_path.read_text(encoding="utf-8"))
            smap_path.write_text(json.dumps({k: v for k, v in smap.items() if k not in drop_config}, indent=2) + "\n",
                                 encoding="utf-8")
        if add_tokens:
            tok = load(tmp, "hf")
            tok.add_tokens(list(add_tokens))
            tok.save_pretrained(str(tmp))
    return Path(dst)


def verify_files(directory) -> dict:
    """{file: True/False}: does each file still have the sha256 recorded in labkit_tokenizer.json?"""
    d = lab_path(directory)
    rec = d / "labkit_tokenizer.json"
    if not rec.is_file():
        raise LabkitError(f"{rec} not found", "only directories written by `labkit tokenizer train` carry a record")
    recorded = json.loads(rec.read_text(encoding="utf-8"))["sha256"]
    return {f: (d / f).is_file() and _sha256(d / f) == h for f, h in recorded.items()}


# -------------------------------------------------------------------------------------------- loading


def check_files(path, impl: str = "hf") -> Path:
    """The tokenizer directory, after checking from its files alone (no library imported, so it answers at once)
    that `impl` can read it; LabkitError naming the directory, the file and the fix otherwise."""
    if impl not in IMPLS:
        raise LabkitError(f"unknown tokenizer implementation '{impl}'", f"use one of {', '.join(IMPLS)}")
    d = lab_path(path)
    if not d.is_dir():
        raise LabkitError(f"tokenizer directory {path} not found",
                          "point at a tokenizer directory (e.g. data/tokenizer, or train one with "
                          "`labkit tokenizer train`)")
    check_loadable(d, impl)
    return d


def load(path, impl: str = "hf"):
    """Load a tokenizer directory with one implementation: `hf` (AutoTokenizer, fast where it exists), `hf-slow`
    (AutoTokenizer use_fast=False) or `mindformers` (mindformers' LlamaTokenizer). The files are checked first
    (labkit.data.tokenizer_files): an implementation that cannot read the directory's family is refused with why."""
    d = check_files(path, impl)
    try:
        tok = _load_checked(d, impl)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
        raise LabkitError(f"{impl} cannot load {d}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}",
                          "the directory needs tokenizer_config.json (tokenizer_class) and the vocabulary files "
                          "of that class (tokenizer.json for hf)") from None
    if not callable(tok):  # AutoTokenizer returns odd values for folders it half understands
        raise LabkitError(f"{impl} did not build a tokenizer from {d} (got {type(tok).__name__})",
                          "check tokenizer_config.json's tokenizer_class against the files in the directory")
    return tok


def _load_checked(d: Path, impl: str):
    if impl == "mindformers":
        quiet_mindformers()
        import mindformers  # noqa: F401  (creates its logger; keep its console quiet)

        quiet_mindformers_console()
        from mindformers import LlamaTokenizer

        return LlamaTokenizer.from_pretrained(str(d))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d), use_fast=(impl == "hf"))


def vocab_size(tok) -> int:
    """The id space the embedding must cover: largest id + 1 (not len(tok): mindformers' len() counts the
    special tokens twice, 4099 for a 4096-piece model)."""
    return max(tok.get_vocab().values()) + 1


def special_tokens(tok) -> dict:
    return {n: [getattr(tok, f"{n}_token"), getattr(tok, f"{n}_token_id")] for n in SPECIAL_NAMES}


def read_texts(path) -> list[str]:
    """The lines of a UTF-8 text file (`.gz` allowed), without their newlines."""
    import gzip

    p = lab_path(path)
    if not p.is_file():
        raise LabkitError(f"texts file {path} not found", "give a UTF-8 text file, one text per line")
    opener = gzip.open if p.name.endswith(".gz") else open
    try:
        with opener(p, "rt", encoding="utf-8", newline="") as f:
            return [line.rstrip("\r\n") for line in f]
    except UnicodeDecodeError as e:
        raise LabkitError(f"{p} is not UTF-8 ({e.reason} at byte {e.start})", "convert it to UTF-8") from None


def _encode(tok, texts: list[str]) -> tuple[list, list]:
    enc = tok(list(texts))
    return enc["input_ids"], enc["attention_mask"]


def _first_diff(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare(a, b, texts, *, a_impl: str = "hf", b_impl: str = "hf", max_examples: int = 10) -> dict:
    """Encode every text with both tokenizers (directories or loaded tokenizers) and report every disagreement:
    input_ids, attention_mask, vocab size and the bos/eos/pad/unk table. `aligned` only when all agree."""
    for side, impl in ((a, a_impl), (b, b_impl)):  # both refusals before either (slow) load
        if isinstance(side, (str, os.PathLike)):
            check_files(side, impl)
    tok_a = load(a, a_impl) if isinstance(a, (str, os.PathLike)) else a
    tok_b = load(b, b_impl) if isinstance(b, (str, os.PathLike)) else b
    texts = read_texts(texts) if isinstance(texts, (str, os.PathLike)) else list(texts)
    ids_a, mask_a = _encode(tok_a, texts)
    ids_b, mask_b = _encode(tok_b, texts)
    examples, n_bad, n_mask, n_decode, n_decode_checked = [], 0, 0, 0, 0
    decode_every = max(1, len(texts) // DECODE_CHECKS)  # slow decoders are slow: check a spread sample
    for i, text in enumerate(texts):
        mask_same = mask_a[i] == mask_b[i]
        n_mask += not mask_same
        if ids_a[i] == ids_b[i] and mask_same:
            if i % decode_every == 0:
                n_decode_checked += 1
                n_decode += (tok_a.decode(ids_a[i], skip_special_tokens=True)
                             != tok_b.decode(ids_b[i], skip_special_tokens=True))
            continue
        n_bad += 1
        if len(examples) < max_examples:
            pos = _first_diff(ids_a[i], ids_b[i])
            examples.append(dict(line=i + 1, text=text[:200], first_diff=pos, ids_a=ids_a[i], ids_b=ids_b[i],
                                 tokens_a=tok_a.convert_ids_to_tokens(ids_a[i][pos:pos + 5]),
                                 tokens_b=tok_b.convert_ids_to_tokens(ids_b[i][pos:pos + 5]),
                                 attention_mask_same=mask_same))
    specials = {n: {"a": va, "b": vb, "same": va == vb}
                for (n, va), vb in zip(special_tokens(tok_a).items(), special_tokens(tok_b).values())}
    va, vb = vocab_size(tok_a), vocab_size(tok_b)
    notes = []
    for label, tok in (("a", tok_a), ("b", tok_b)):
        if len(tok) != vocab_size(tok):
            notes.append(f"len(tokenizer {label}) = {len(tok)} but its ids span {vocab_size(tok)}: size embeddings "
                         "from the id span (labkit.data.tokenizer.vocab_size), not len()")
    if n_decode:
        notes.append(f"{n_decode} of {n_decode_checked} checked text(s) encode the same but decode differently "
                     "(e.g. HF slow and mindformers drop a leading space)")
    aligned = n_bad == 0 and va == vb and all(s["same"] for s in specials.values())
    return dict(ok=True, aligned=aligned, n_texts=len(texts), n_mismatched=n_bad, n_mask_mismatched=n_mask,
                n_decode_differs=n_decode, n_decode_checked=n_decode_checked, vocab_size_a=va, vocab_size_b=vb, len_a=len(tok_a), len_b=len(tok_b),
                impl_a=a_impl, impl_b=b_impl, special_tokens=specials, examples=examples, notes=notes)


def format_compare(r: dict) -> str:
    lines = [f"{'ALIGNED' if r['aligned'] else 'NOT ALIGNED'}: {r['n_mismatched']}/{r['n_texts']} texts differ "
             f"({r['impl_a']} vs {r['impl_b']}); vocab {r['vocab_size_a']} vs {r['vocab_size_b']}"]
    for n, s in r["special_tokens"].items():
        lines.append(f"  {n:<4} a={s['a']}  b={s['b']}" + ("" if s["same"] else "   <-- differs"))
    for e in r["examples"]:
        lines.append(f"  line {e['line']}: {e['text'][:60]!r} first differs at position {e['first_diff']}: "
                     f"{e['tokens_a']} vs {e['tokens_b']}")
    lines += [f"  note: {n}" for n in r["notes"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI


def add_cli(parser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    t = sub.add_parser("train", help="train a Llama-style SentencePiece BPE tokenizer (HF directory)")
    t.add_argument("--corpus", nargs="+", required=True, help=".txt/.jsonl files (or .gz) or directories")
    t.add_argument("--vocab-size", type=int, required=True, help="pieces, including 256 byte tokens and 3 specials")
    t.add_argument("--output", required=True, help="tokenizer directory to write (atomically)")
    t.add_argument("--text-field", default="text", help="JSON field holding the text in .jsonl files")
    t.add_argument("--split-on-blank-lines", action="store_true", help=".txt: one document per blank-line block")
    t.add_argument("--character-coverage", type=float, default=0.995,
                   help="share of characters given their own piece; the rest use byte fallback")
    t.add_argument("--normalization", default="identity",
                   help="SentencePiece normaliser; identity keeps HF fast/slow/mindformers aligned")
    t.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    add_common_flags(t)
    t.set_defaults(func=_cli_train)

    c = sub.add_parser("compare", help="encode a texts file with two tokenizers and report every difference")
    c.add_argument("--a", required=True, help="tokenizer directory A")
    c.add_argument("--a-impl", choices=IMPLS, default="hf", help="implementation for A")
    c.add_argument("--b", required=True, help="tokenizer directory B")
    c.add_argument("--b-impl", choices=IMPLS, default="hf", help="implementation for B")
    c.add_argument("--texts", required=True, help="UTF-8 file, one text per line")
    c.add_argument("--max-examples", type=int, default=10, help="mismatching texts to show")
    add_common_flags(c)
    c.set_defaults(func=_cli_compare)

    r = sub.add_parser("resize-embeddings", help="grow a converted checkpoint's vocabulary (mean-initialised rows)")
    r.add_argument("--model", required=True, help="converted directory (model.ckpt + model.yaml)")
    r.add_argument("--vocab-size", type=int, required=True, help="new number of rows (the tokenizer's id span)")
    r.add_argument("--output", required=True, help="directory to write (atomically)")
    r.add_argument("--allow-shrink", action="store_true", help="allow dropping rows when N is smaller")
    r.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    add_common_flags(r)
    r.set_defaults(func=_cli_resize)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _cli_train(args) -> int:
    r = train(args.corpus, args.vocab_size, args.output, text_field=args.text_field,
              split_on_blank_lines=args.split_on_blank_lines, character_coverage=args.character_coverage,
              normalization=args.normalization, overwrite=args.overwrite)
    emit(args, r, f"wrote {r['output']}: {r['vocab_size']} pieces ({r['byte_pieces']} byte fallback) from "
                  f"{r['n_documents']} documents in {r['train_seconds']} s; lossless round trip "
                  f"{r['roundtrip_ok']}/{r['roundtrip_checked']}" + "".join(f"\n  warning: {w}" for w in r["warnings"]))
    return 0


def _cli_compare(args) -> int:
    r = compare(args.a, args.b, args.texts, a_impl=args.a_impl, b_impl=args.b_impl, max_examples=args.max_examples)
    emit(args, r, format_compare(r))
    return 0 if r["aligned"] else 1


def _cli_resize(args) -> int:
    r = resize_embeddings(args.model, args.vocab_size, args.output, allow_shrink=args.allow_shrink,
                          overwrite=args.overwrite)
    emit(args, r, f"wrote {r['output']}: vocab {r['old_vocab_size']} -> {r['new_vocab_size']} "
                  f"({', '.join(r['params'])}; new rows = {r['init']})")
    return 0
