"""labkit.data.tokenizer: the shipped tokenizer is aligned across HF fast, HF slow and mindformers; drift is caught;
vocabulary growth is a command."""
import json

import numpy as np
import pytest
import yaml

from labkit.data import tokenizer as T
from labkit.cli import main
from labkit.data.corpus import read_documents
from labkit.errors import LabkitError

EDGE = ["Hello world", " leading space", "two  spaces", "trailing ", "", "\n", "a\nb\n\nc", "Hello</s> there",
        "<s>Hi", "数字 12345 and ２０２４", "naïve café ﬁ 🙂", "关关雎鸠，在河之洲。", "Mr. Bennet replied."]


@pytest.fixture(scope="module")
def sample_texts():
    lines = [line for doc in read_documents() for line in doc.split("\n")]
    return lines[::150] + EDGE


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = read_documents()
    (d / "small.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                                           for t in docs[:8] + docs[-4:]), encoding="utf-8")
    return d / "small.jsonl"


@pytest.mark.slow
@pytest.mark.parametrize("impl_b", ["hf-slow", "mindformers"])
def test_shipped_tokenizer_is_aligned(sample_texts, impl_b):
    r = T.compare(T.SHIPPED_TOKENIZER, T.SHIPPED_TOKENIZER, sample_texts, a_impl="hf", b_impl=impl_b)
    assert r["aligned"], r["examples"][:2]
    assert r["vocab_size_a"] == r["vocab_size_b"] == 4096
    assert {n: s["a"] for n, s in r["special_tokens"].items()} == {
        "bos": ["<s>", 1], "eos": ["</s>", 2], "pad": ["<unk>", 0], "unk": ["<unk>", 0]}


def test_mindformers_len_overcounts(sample_texts):
    tok = T.load(T.SHIPPED_TOKENIZER, "mindformers")
    assert T.vocab_size(tok) == 4096 and len(tok) == 4099  # mindformers 1.9.0 counts <unk> <s> </s> twice


@pytest.mark.slow
def test_shipped_corpus_round_trips():
    """decode(encode(text)) == text for every shipped document: byte fallback, identity normaliser."""
    tok = T.load(T.SHIPPED_TOKENIZER, "hf")
    docs = read_documents()
    ids = tok(docs, add_special_tokens=False)["input_ids"]
    assert tok.batch_decode(ids) == docs
    assert sum(i.count(tok.unk_token_id) for i in ids) == 0


def test_byte_fallback_for_unseen_characters():
    tok = T.load(T.SHIPPED_TOKENIZER, "hf")
    text = "emoji 🙂 and a rare character 龘"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert "<0xF0>" in pieces and tok.unk_token_id not in ids
    assert tok.decode(ids) == text


@pytest.mark.slow
def test_shipped_tokenizer_is_reproducible(tmp_path):
    """The recipe in data/README.md rebuilds the shipped pieces exactly."""
    r = T.train([T.SHIPPED_TOKENIZER.parent / "corpus"], 4096, tmp_path / "tok")
    assert r["roundtrip_ok"] == r["roundtrip_checked"]
    import sentencepiece as spm

    a = spm.SentencePieceProcessor(model_file=str(T.SHIPPED_TOKENIZER / "tokenizer.model"))
    b = spm.SentencePieceProcessor(model_file=str(tmp_path / "tok" / "tokenizer.model"))
    assert [(a.id_to_piece(i), a.get_score(i)) for i in range(4096)] == \
           [(b.id_to_piece(i), b.get_score(i)) for i in range(4096)]
    assert (tmp_path / "tok" / "tokenizer.json").read_text() == (T.SHIPPED_TOKENIZER / "tokenizer.json").read_text()


def test_train_small_loads_everywhere_and_is_deterministic(tmp_path, small_corpus):
    r1 = T.train([small_corpus], 400, tmp_path / "a", character_coverage=0.98)
    T.train([small_corpus], 400, tmp_path / "b", character_coverage=0.98)
    assert r1["vocab_size"] == 400 and r1["byte_pieces"] == 256
    assert (tmp_path / "a" / "tokenizer.model").read_bytes() == (tmp_path / "b" / "tokenizer.model").read_bytes()
    texts = read_documents([small_corpus])[:20]
    for impl in ("hf-slow", "mindformers"):
        assert T.compare(tmp_path / "a", tmp_path / "a", texts, a_impl="hf", b_impl=impl)["aligned"]
    with pytest.raises(LabkitError, match="already exists"):
        T.train([small_corpus], 400, tmp_path / "a", character_coverage=0.98)


def test_train_errors(tmp_path, small_corpus):
    with pytest.raises(LabkitError, match="too small"):
        T.train([small_corpus], 100, tmp_path / "x")
    with pytest.raises(LabkitError, match="raise --vocab-size"):
        T.train([small_corpus], 300, tmp_path / "x", character_coverage=1.0)
    with pytest.raises(LabkitError, match="lower --vocab-size"):
        T.train([small_corpus], 60000, tmp_path / "x", character_coverage=0.98)
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(LabkitError, match="holds no text"):
        T.train([tmp_path / "empty.txt"], 400, tmp_path / "x", character_coverage=0.98)
    assert not (tmp_path / "x").exists()
    with pytest.raises(LabkitError, match="not found"):
        T.load(tmp_path / "missing", "hf")


def test_added_token_is_caught(tmp_path):
    b = T.make_variant(T.SHIPPED_TOKENIZER, tmp_path / "added", add_tokens=("<|im_start|>",))
    texts = ["plain text", "hello <|im_start|> world"]
    r = T.compare(T.SHIPPED_TOKENIZER, b, texts)
    assert not r["aligned"] and r["vocab_size_b"] == 4097 and r["n_mismatched"] == 1
    assert r["examples"][0]["line"] == 2 and r["examples"][0]["tokens_b"][0] == "<|im_start|>"
    # and HF slow (legacy) puts a lone "▁" around the added token where fast does not
    assert not T.compare(b, b, texts[1:], a_impl="hf", b_impl="hf-slow")["aligned"]


def test_add_prefix_space_false_splits_fast_from_slow(tmp_path):
    b = T.make_variant(T.SHIPPED_TOKENIZER, tmp_path / "nopfx", set_config={"add_prefix_space": False})
    r = T.compare(b, b, ["Hello world"], a_impl="hf", b_impl="hf-slow")
    assert not r["aligned"] and r["examples"][0]["first_diff"] == 1


def test_missing_pad_differs_between_hf_and_mindformers(tmp_path):
    b = T.make_variant(T.SHIPPED_TOKENIZER, tmp_path / "nopad", drop_config=("pad_token",))
    assert "pad_token" not in json.loads((b / "special_tokens_map.json").read_text())
    r = T.compare(b, b, ["Hello"], a_impl="hf", b_impl="mindformers")
    assert r["n_mismatched"] == 0 and not r["aligned"]
    assert r["special_tokens"]["pad"] == {"a": [None, None], "b": ["<unk>", 0], "same": False}


def test_nfkc_normaliser_splits_fast_from_slow(tmp_path, small_corpus):
    T.train([small_corpus], 400, tmp_path / "nfkc", normalization="nmt_nfkc", character_coverage=0.98)
    r = T.compare(tmp_path / "nfkc", tmp_path / "nfkc", ["关关雎鸠，在河之洲。"], a_impl="hf", b_impl="hf-slow")
    assert not r["aligned"]  # slow applies NFKC ("，" -> ","); the fast converter ignores SentencePiece's normaliser


def test_cli_compare_json_and_exit_status(tmp_path, capfd):
    texts = tmp_path / "t.txt"
    texts.write_text("Hello world\n关关雎鸠\n", encoding="utf-8")
    b = T.make_variant(T.SHIPPED_TOKENIZER, tmp_path / "eos", set_config={"add_eos_token": True})
    code = main(["tokenizer", "compare", "--a", str(T.SHIPPED_TOKENIZER), "--a-impl", "hf", "--b", str(b),
                 "--b-impl", "hf", "--texts", str(texts), "--json"])
    out = capfd.readouterr().out
    r = json.loads(out)  # exactly one JSON object on stdout
    assert code == 1 and r["aligned"] is False and r["n_texts"] == 2 and r["n_mismatched"] == 2
    for key in ("vocab_size_a", "vocab_size_b", "special_tokens", "examples"):
        assert key in r
    assert r["examples"][0]["first_diff"] == len(r["examples"][0]["ids_a"])  # B only appends </s>
    code = main(["tokenizer", "compare", "--a", str(tmp_path / "nope"), "--b", str(b), "--texts", str(texts), "--json"])
    r = json.loads(capfd.readouterr().out)
    assert code == 2 and r["ok"] is False and "not found" in r["error"]


# --------------------------------------------------------------------------------------- resize


def _converted_dir(path, vocab=6, hidden=4, tied=False):
    import mindspore as ms

    path.mkdir()
    rng = np.random.default_rng(0)
    params = [{"name": T.EMBED, "data": ms.Tensor(rng.normal(size=(vocab, hidden)).astype(np.float32))},
              {"name": "model.norm_out.weight", "data": ms.Tensor(np.ones(hidden, np.float32))}]
    if not tied:
        params.append({"name": T.HEAD, "data": ms.Tensor(rng.normal(size=(vocab, hidden)).astype(np.float16))})
    ms.save_checkpoint(params, str(path / "model.ckpt"))
    (path / "model.yaml").write_text(yaml.safe_dump({"name": "t", "vocab_size": vocab, "hidden_size": hidden,
                                                     "tie_word_embeddings": tied}, sort_keys=False))
    (path / "mindformers_model.yaml").write_text("# header comment\n" + yaml.safe_dump(
        {"model": {"model_config": {"type": "LlamaConfig", "vocab_size": vocab}, "arch": {"type": "LlamaForCausalLM"}}}))
    (path / "conversion.json").write_text(json.dumps({"format": "labkit-converted/1", "hf_config": {"vocab_size": vocab}}))
    (path / "tokenizer.model").write_bytes(b"copied as is")
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_resize_embeddings_mean_init(tmp_path, tied):
    import mindspore as ms

    src = _converted_dir(tmp_path / "m", tied=tied)
    r = T.resize_embeddings(src, 8, tmp_path / "out")
    assert r["rows_added"] == 2 and r["params"] == [T.EMBED] + ([] if tied else [T.HEAD])
    old, new = ms.load_checkpoint(str(src / "model.ckpt")), ms.load_checkpoint(str(tmp_path / "out" / "model.ckpt"))
    assert list(new) == list(old)  # same names, same order
    for n in r["params"]:
        a, b = old[n].astype(ms.float32).asnumpy(), new[n].astype(ms.float32).asnumpy()
        assert b.shape == (8, 4) and new[n].dtype == old[n].dtype
        np.testing.assert_array_equal(b[:6], a)
        np.testing.assert_allclose(b[6], a.mean(axis=0), rtol=1e-3, atol=1e-3)
    assert (T.HEAD in new) is (not tied)
    out = tmp_path / "out"
    assert yaml.safe_load((out / "model.yaml").read_text())["vocab_size"] == 8
    mf = (out / "mindformers_model.yaml").read_text()
    assert mf.startswith("# header comment") and yaml.safe_load(mf)["model"]["model_config"]["vocab_size"] == 8
    rec = json.loads((out / "conversion.json").read_text())
    assert rec["hf_config"]["vocab_size"] == 8 and rec["resized_embeddings"][0]["old_vocab_size"] == 6
    assert (out / "tokenizer.model").read_bytes() == b"copied as is"


def test_resize_refusals(tmp_path, capfd):
    src = _converted_dir(tmp_path / "m")
    with pytest.raises(LabkitError, match="allow-shrink"):
        T.resize_embeddings(src, 4, tmp_path / "o")
    assert T.resize_embeddings(src, 4, tmp_path / "o", allow_shrink=True)["rows_dropped"] == 2
    with pytest.raises(LabkitError, match="already exists"):
        T.resize_embeddings(src, 8, tmp_path / "o")
    with pytest.raises(LabkitError, match="not found"):
        T.resize_embeddings(tmp_path / "nope", 8, tmp_path / "p")
    (src / "model.yaml").write_text(yaml.safe_dump({"vocab_size": 7}))
    code = main(["tokenizer", "resize-embeddings", "--model", str(src), "--vocab-size", "9", "--output",
                 str(tmp_path / "q"), "--json"])
    r = json.loads(capfd.readouterr().out)
    assert code == 2 and "disagree" in r["fix"] and not (tmp_path / "q").exists()


def test_known_slow_vocabulary_files_match_transformers():
    """The table that lets a refusal skip importing transformers must say what transformers itself says."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    from labkit.data.tokenizer_files import KNOWN_SLOW

    for name, files in KNOWN_SLOW.items():
        cls = tokenizer_class_from_name(name)
        assert [f for k, f in cls.vocab_files_names.items() if k != "tokenizer_file"] == files, name


@pytest.mark.slow
def test_not_sentencepiece_is_named_without_breaking_mindspore(tmp_path):
    """A tokenizer.model that is an HTML error page is refused by name; the check must not import the Python
    protobuf module, whose presence breaks mindspore's later import of its own generated protos."""
    import subprocess
    import sys

    d = T.make_variant(T.SHIPPED_TOKENIZER, tmp_path / "bad")
    (d / "tokenizer.model").write_bytes(b"<html>404</html>")
    code = ("import sys; from labkit.data import tokenizer as T\n"
            "try:\n    T.load(sys.argv[1], 'mindformers')\nexcept T.LabkitError as e:\n    print(e.what)\n"
            "import mindspore  # must still import\nprint('mindspore ok')")
    p = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=600)
    assert "tokenizer.model is not a SentencePiece model" in p.stdout and "<html>404" in p.stdout, p.stderr[-2000:]
    assert "mindspore ok" in p.stdout, p.stderr[-2000:]
