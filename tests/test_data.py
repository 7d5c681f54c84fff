"""labkit.data: packed MindRecord datasets, built atomically, and the loader order training relies on."""
import json
import threading

import numpy as np
import pytest

from labkit.config import DataConfig
from labkit.data import dataset as D
from labkit.data import bench as data_bench
from labkit.data import loader
from labkit.cli import main
from labkit.data.corpus import read_documents
from labkit.errors import LabkitError
from labkit.data.tokenizer import SHIPPED_TOKENIZER, load

SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = read_documents()
    (d / "en.txt").write_text(docs[0], encoding="utf-8")
    (d / "zh.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in docs[-40:]),
                                encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "ds"
    return D.build_dataset(DataConfig(corpus=[corpus], tokenizer=SHIPPED_TOKENIZER, seq_len=SEQ),
                           out, progress=False), out


@pytest.fixture(scope="module")
def samples(built):
    """Every sample, read back in file order."""
    import mindspore.dataset as ds

    _, out = built
    pipe = ds.MindDataset(str(out / D.RECORD), columns_list=["input_ids"], shuffle=False)
    return np.stack([x for (x,) in pipe.create_tuple_iterator(output_numpy=True, num_epochs=1)])


def test_build_packs_documents_with_eos(built, samples, corpus):
    stats, out = built
    tok = load(SHIPPED_TOKENIZER, "hf")
    docs = read_documents([corpus])
    stream = np.concatenate([tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in docs])
    L = SEQ + 1
    assert stats["n_documents"] == len(docs) and stats["n_tokens"] == stream.size
    assert stats["n_samples"] == stream.size // L and stats["n_dropped_tokens"] == stream.size % L
    assert samples.shape == (stats["n_samples"], L) and samples.dtype == np.int32
    np.testing.assert_array_equal(samples.ravel(), stream[: samples.size])  # read back == what was written
    assert stats["unk_rate"] == 0 and stats["verdict"] == "ok" and stats["warnings"] == []
    assert stats["vocab_size"] == 4096 and stats["seq_len"] == SEQ
    assert D.read_stats(out) == {k: v for k, v in stats.items() if k not in ("ok", "output", "val")}
    h = D.histograms(out)
    assert h["doc_lengths"].sum() == stats["n_tokens"] and h["token_counts"].sum() == stats["n_tokens"]


def test_build_with_workers_is_identical(built, corpus, tmp_path):
    stats, out = built
    s2 = D.build_dataset(DataConfig(corpus=[corpus], tokenizer=SHIPPED_TOKENIZER, seq_len=SEQ),
                         tmp_path / "w2", workers=2, progress=False)
    assert s2["n_samples"] == stats["n_samples"]
    assert (tmp_path / "w2" / D.RECORD).read_bytes() == (out / D.RECORD).read_bytes()


def test_bad_inputs_leave_nothing(tmp_path, corpus):
    out = tmp_path / "out"
    (tmp_path / "tiny.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(LabkitError, match="fewer than one sample"):
        D.build_dataset(DataConfig(corpus=[tmp_path / "tiny.txt"], tokenizer=SHIPPED_TOKENIZER, seq_len=SEQ),
                        out, progress=False)
    (tmp_path / "empty.txt").write_text("\n", encoding="utf-8")
    with pytest.raises(LabkitError, match="holds no text"):
        D.build_dataset(DataConfig(corpus=[tmp_path / "empty.txt"], tokenizer=SHIPPED_TOKENIZER, seq_len=SEQ),
                        out, progress=False)
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01\x02" * 50)
    with pytest.raises(LabkitError, match="binary"):
        D.build_dataset(DataConfig(corpus=[tmp_path / "bin.txt"], tokenizer=SHIPPED_TOKENIZER, seq_len=SEQ),
                        out, progress=False)
    with pytest.raises(LabkitError, match="tokenizer directory"):
        D.build_dataset(DataConfig(corpus=[corpus], tokenizer=tmp_path / "no-tokenizer", seq_len=SEQ),
                        out, progress=False)
    assert not out.exists() and list(tmp_path.glob(".tmp-*")) == []


def test_interrupted_build_leaves_no_dataset(tmp_path, corpus, monkeypatch):
    from mindspore.mindrecord import FileWriter

    def boom(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(FileWriter, "commit", boom)
    with pytest.raises(KeyboardInterrupt):
        D.build_dataset(DataConfig(corpus=[corpus], tokenizer=SHIPPED_TOKENIZER, seq_len=SEQ),
                        tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".tmp-*")) == []


def test_read_stats_refuses_incomplete(tmp_path, built):
    _, out = built
    with pytest.raises(LabkitError, match="not found"):
        D.read_stats(tmp_path / "missing")
    half = tmp_path / "half"
    half.mkdir()
    (half / D.RECORD).write_bytes(b"partial")
    with pytest.raises(LabkitError, match="incomplete"):
        D.read_stats(half)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / D.RECORD).write_bytes(b"truncated")
    with pytest.raises(LabkitError, match="data.mindrecord missing or changed"):
        D.read_stats(copy)


def test_verdict_fails_on_a_dominant_token(tmp_path):
    (tmp_path / "pad.txt").write_text("=" * 4000, encoding="utf-8")
    s = D.build_dataset(DataConfig(corpus=[tmp_path / "pad.txt"], tokenizer=SHIPPED_TOKENIZER, seq_len=SEQ),
                        tmp_path / "o", progress=False)
    assert s["verdict"] == "fail" and "of all tokens" in s["warnings"][0]


# ------------------------------------------------------------------------------------------ loader


def take(it, k):
    return [next(it) for _ in range(k)]


def test_epoch_order_and_content(built, samples):
    stats, out = built
    n = stats["n_samples"]
    mb = 4
    spe = n // mb
    got = take(loader.make_loader(out, mb, seed=7), spe + 2)  # crosses into epoch 1
    order0 = np.random.default_rng(7).permutation(n)
    order1 = np.random.default_rng(8).permutation(n)
    for t in range(spe):
        np.testing.assert_array_equal(got[t], samples[order0[t * mb:(t + 1) * mb]])
    np.testing.assert_array_equal(got[spe], samples[order1[:mb]])
    plain = take(loader.make_loader(out, mb, seed=7, data=DataConfig(shuffle=False)), 2)
    np.testing.assert_array_equal(np.concatenate(plain), samples[: 2 * mb])


def test_data_parallel_union_equals_single_worker(built):
    _, out = built
    b = 3
    single = take(loader.make_loader(out, 2 * b, seed=1), 20)
    r0 = take(loader.make_loader(out, b, seed=1, dp_size=2, dp_rank=0), 20)
    r1 = take(loader.make_loader(out, b, seed=1, dp_size=2, dp_rank=1), 20)
    for s, a, c in zip(single, r0, r1):
        np.testing.assert_array_equal(s, np.concatenate([a, c]))


def test_accumulation_sees_the_same_samples(built):
    _, out = built
    big = take(loader.make_loader(out, 8, seed=3, accum=1), 6)
    small = take(loader.make_loader(out, 2, seed=3, accum=4), 24)
    for t in range(6):
        np.testing.assert_array_equal(big[t], np.concatenate(small[4 * t:4 * t + 4]))


def test_resume_matches_uninterrupted_without_reading_skipped(built, monkeypatch):
    stats, out = built
    mb, dp, accum = 2, 2, 2
    spe = stats["n_samples"] // (mb * dp * accum)
    k = spe - 1  # resume one step before the epoch ends
    full = take(loader.make_loader(out, mb, seed=5, dp_size=dp, dp_rank=1, accum=accum), (k + 3) * accum)
    import mindspore.dataset as ds

    seen = []
    real = ds.SubsetSampler

    def spy(indices, *a, **kw):
        seen.append(list(indices))
        return real(indices, *a, **kw)

    monkeypatch.setattr(ds, "SubsetSampler", spy)
    resumed = take(loader.make_loader(out, mb, seed=5, dp_size=dp, dp_rank=1, accum=accum, start_step=k), 3 * accum)
    for a, b in zip(full[k * accum:], resumed):
        np.testing.assert_array_equal(a, b)
    skipped = loader.rank_indices(stats["n_samples"], mb, seed=5, epoch=0, dp_size=dp, dp_rank=1, accum=accum)[:k]
    assert len(seen[0]) == mb * accum and not set(seen[0]) & set(skipped.ravel().tolist())


def test_workers_and_prefetch_do_not_change_order(built):
    _, out = built
    a = take(loader.make_loader(out, 4, seed=2, data=DataConfig(num_parallel_workers=1, prefetch=16)), 30)
    b = take(loader.make_loader(out, 4, seed=2, data=DataConfig(num_parallel_workers=2, prefetch=64)), 30)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_loader_refuses_too_few_samples(built):
    stats, out = built
    with pytest.raises(LabkitError, match=f"fewer than one global batch of {stats['n_samples'] + 1}"):
        loader.make_loader(out, stats["n_samples"] + 1, seed=0)
    with pytest.raises(LabkitError, match="dp_rank"):
        loader.make_loader(out, 2, seed=0, dp_size=2, dp_rank=2)


def test_shard_balance_counts_the_arrays_each_rank_receives(built):
    stats, out = built
    mb, dp, accum, steps = 2, 2, 2, stats["n_samples"] // 8 + 5  # crosses an epoch boundary
    r = loader.check_shard_balance(out, micro_batch=mb, dp_size=dp, accum=accum, steps=steps, seed=0)
    assert r["tokens_per_rank"] == [steps * mb * accum * stats["sample_len"]] * dp and r["max_imbalance"] == 0
    assert r["shared_samples"] == 0 and r["steps_matching_single_card"] == steps
    # epoch 0 is covered: every sample but the remainder that does not fill a global batch (the rows are distinct)
    assert r["epoch_samples_covered"] == stats["n_samples"] - stats["n_samples"] % (mb * dp * accum)
    # document ends: the EOS counts the build recorded per sample, summed over the samples the order contract assigns
    sample_docs = np.load(out / "sample_docs.npy")
    spe = stats["n_samples"] // (mb * dp * accum)
    for rank in range(dp):
        plan = np.concatenate([loader.rank_indices(stats["n_samples"], mb, seed=0, epoch=e, dp_size=dp, dp_rank=rank,
                                                   accum=accum) for e in range(-(-steps // spe))])[:steps]
        assert r["documents_per_rank"][rank] == int(sample_docs[plan.ravel()].sum())
    assert sum(r["documents_per_rank"]) > 0


def test_shard_balance_sees_a_rank_that_receives_less(built, monkeypatch):
    stats, out = built
    real = loader.make_loader

    def short_rank1(*args, dp_rank=0, **kwargs):  # rank 1's arrays lose their last token
        for x in real(*args, dp_rank=dp_rank, **kwargs):
            yield x[:, :-1] if dp_rank == 1 else x

    monkeypatch.setattr(loader, "make_loader", short_rank1)
    r = loader.check_shard_balance(out, micro_batch=2, dp_size=2, accum=1, steps=5, seed=0)
    assert r["tokens_per_rank"] == [5 * 2 * stats["sample_len"], 5 * 2 * (stats["sample_len"] - 1)]
    assert r["max_imbalance"] > 0


def test_shard_balance_sees_ranks_that_read_the_same_samples(built, monkeypatch):
    real = loader.make_loader

    def rank1_reads_rank0(*args, dp_rank=0, **kwargs):  # a broken split: every rank gets rank 0's shard
        return real(*args, dp_rank=0, **kwargs)

    _, out = built
    monkeypatch.setattr(loader, "make_loader", rank1_reads_rank0)
    r = loader.check_shard_balance(out, micro_batch=2, dp_size=2, accum=1, steps=5, seed=0)
    assert r["max_imbalance"] == 0  # the token counts alone look balanced
    assert r["shared_samples"] == 5 * 2 and r["steps_matching_single_card"] == 0 and r["epoch_samples_covered"] is None


# --------------------------------------------------------------------------------- cache and CLI


def test_ensure_dataset_builds_once_even_when_racing(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(D, "CACHE", tmp_path / "cache")
    results, errors, builds = [], [], []
    build = D.build_dataset

    def counted(*a, **k):
        builds.append(a)
        return build(*a, **k)

    monkeypatch.setattr(D, "build_dataset", counted)

    def call():
        try:
            results.append(D.ensure_dataset(SEQ, corpus=[corpus], progress=False))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(builds) == 1  # the second call waited and reused it
    path = results[0]
    assert path.parent == tmp_path / "cache" and D.read_stats(path)["seq_len"] == SEQ
    # one build: no temporary leftovers, only the lock file the second call waited on
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([path.name, f".lock-{path.name}"])
    assert D.ensure_dataset(SEQ, corpus=[corpus]) == path  # reused
    assert D.ensure_dataset(SEQ + 1, corpus=[corpus], progress=False) != path


@pytest.mark.slow
def test_ensure_dataset_default_is_the_shipped_corpus():
    path = D.ensure_dataset(128)
    stats = D.read_stats(path)
    assert path.parent == D.CACHE and stats["n_documents"] == 5922 and stats["verdict"] == "ok"
    assert stats["corpus"][0].startswith("data/corpus/") and stats["tokenizer"] == "data/tokenizer"


def test_cli_build_json(tmp_path, corpus, capfd):
    code = main(["data", "build", "--corpus", str(corpus), "--tokenizer", str(SHIPPED_TOKENIZER), "--seq-len", "16",
                 "--output", str(tmp_path / "o"), "--json"])
    r = json.loads(capfd.readouterr().out)
    assert code == 0
    for key in ("n_documents", "n_tokens", "n_samples", "n_dropped_tokens", "unk_rate", "verdict", "warnings"):
        assert key in r
    code = main(["data", "build", "--corpus", str(tmp_path / "none"), "--tokenizer", str(SHIPPED_TOKENIZER),
                 "--seq-len", "16", "--output", str(tmp_path / "p"), "--json"])
    r = json.loads(capfd.readouterr().out)
    assert code == 2 and r["ok"] is False and "does not exist" in r["error"]


def test_bench_reports_both_pipelines(built, corpus):
    _, out = built
    r = data_bench.run_bench(corpus=[corpus], seq_len=SEQ, workers=(1, 64), prefetch=(16,), dataset_dir=out)
    assert {row["pipeline"] for row in r["rows"]} == {"on-the-fly", "MindRecord"}
    assert r["refused_workers"] == [64] and r["ratio_by_workers"][1] > 0
    assert "ratio MindRecord / on-the-fly" in data_bench.format_table(r)


@pytest.mark.slow
def test_a_data_build_process_leaves_torch_out_and_an_in_process_call_does_not(built, corpus, tmp_path):
    """`labkit data build` as a process sets USE_TORCH=0 before transformers imports (labkit/cli.py): the same
    dataset, without the ~6 s of torch. Called in-process (a notebook, a test) it leaves the environment alone."""
    import os
    import subprocess
    import sys

    from labkit.paths import ROOT

    code = ("import sys; from labkit.cli import main; sys.argv[0] = 'labkit'; code = main(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules, code)")
    argv = ["data", "build", "--corpus", str(corpus), "--tokenizer", str(SHIPPED_TOKENIZER), "--seq-len", str(SEQ),
            "--output", str(tmp_path / "ds")]
    env = {k: v for k, v in os.environ.items() if k != "USE_TORCH"}
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT,
                       env={**env, "PYTHONPATH": str(ROOT), "GLOG_v": "3"}, timeout=300)
    assert p.stdout.split()[-3:] == ["False", "True", "0"], p.stdout[-500:] + p.stderr[-2000:]
    np.testing.assert_array_equal(D.read_samples(tmp_path / "ds"), D.read_samples(built[1]))
    before = os.environ.get("USE_TORCH")
    assert main([*argv[:-1], str(tmp_path / "in_process")]) == 0 and os.environ.get("USE_TORCH") == before
