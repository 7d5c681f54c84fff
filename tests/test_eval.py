"""Did it learn: the validation split, evaluation during training, the CPU sampler and the way back to HF.

That the validation loss sharded over data-parallel ranks equals the single worker's is asserted by
notebooks/05_data_parallel.ipynb (section 4), on the launches it makes anyway; `make test` runs it under nbval."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from labkit.cli import main
from labkit.config import DataConfig, load_run_config
from labkit.data import dataset as D
from labkit.data.corpus import read_documents
from labkit.data.tokenizer import SHIPPED_TOKENIZER, load
from labkit.errors import LabkitError
from labkit.training.evaluate import Evaluator, rank_batches, spread
from labkit.training.generate import pick_token

pytestmark = pytest.mark.slow  # its fixtures train runs: `make check` leaves this file out

SEQ = 16
GOLDEN = Path(__file__).parent / "golden" / "tiny_10min_val.json"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 short Song ci and 2 Austen chapters, one document a line."""
    d = tmp_path_factory.mktemp("corpus")
    docs = read_documents()
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                                          for t in docs[:2] + docs[-60:]), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def split(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("split") / "ds"
    return D.build_dataset(DataConfig(corpus=[corpus], tokenizer=SHIPPED_TOKENIZER, seq_len=SEQ, val_fraction=0.1,
                                      val_seed=3),
                           out, progress=False), out


def _stream(tok, docs):
    return np.concatenate([tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in docs])


# ------------------------------------------------------------------------------------------ the split


def test_validation_holds_whole_documents_the_training_set_never_sees(split, corpus):
    stats, out = split
    docs = read_documents([corpus])
    held = D.split_documents(len(docs), 0.1, 3)
    assert len(held) == round(0.1 * len(docs)) and stats["val"]["n_documents"] == len(held)
    assert stats["n_documents"] == len(docs) - len(held) and stats["n_val_documents"] == len(held)
    tok = load(SHIPPED_TOKENIZER, "hf")
    train_docs = [d for i, d in enumerate(docs) if i not in set(held)]
    val = D.read_samples(D.val_dir(out))
    train = D.read_samples(out)
    # each set is its own documents, packed: the first tokens of each stream, cut into samples
    np.testing.assert_array_equal(val.ravel(), _stream(tok, [docs[i] for i in held])[: val.size])
    np.testing.assert_array_equal(train.ravel(), _stream(tok, train_docs)[: train.size])
    assert D.read_stats(D.val_dir(out))["n_samples"] == len(val) == stats["val_samples"] > 0
    # seeded: the same seed holds out the same documents, another seed others
    assert list(D.split_documents(len(docs), 0.1, 3)) == list(held)
    assert list(D.split_documents(len(docs), 0.1, 4)) != list(held)


def test_no_split_builds_what_it_always_built(split, corpus, tmp_path):
    s0 = D.build_dataset(DataConfig(corpus=[corpus], tokenizer=SHIPPED_TOKENIZER, seq_len=SEQ),
                         tmp_path / "plain", progress=False)
    assert s0["val"] is None and D.val_dir(tmp_path / "plain") is None
    assert s0["n_documents"] == len(read_documents([corpus])) and s0["n_val_documents"] == 0
    tok = load(SHIPPED_TOKENIZER, "hf")
    got = D.read_samples(tmp_path / "plain")
    np.testing.assert_array_equal(got.ravel(), _stream(tok, read_documents([corpus]))[: got.size])


def test_a_split_too_small_for_one_sample_says_so(tmp_path):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": f"短句{i}。"}, ensure_ascii=False) + "\n"
                                              for i in range(30)), encoding="utf-8")
    with pytest.raises(LabkitError, match=r"validation share \(1 document\(s\), \d+ tokens\) fills no sample"):
        D.build_dataset(DataConfig(corpus=[tmp_path / "c.jsonl"], tokenizer=SHIPPED_TOKENIZER, seq_len=8,
                                   val_fraction=0.02),
                        tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()
    with pytest.raises(LabkitError, match="must be in"):
        D.split_documents(10, 1.0)


def test_cli_build_with_val_fraction(tmp_path, corpus, capfd):
    code = main(["data", "build", "--corpus", str(corpus), "--tokenizer", str(SHIPPED_TOKENIZER), "--seq-len", "16",
                 "--output", str(tmp_path / "o"), "--val-fraction", "0.1", "--json"])
    r = json.loads(capfd.readouterr().out)
    assert code == 0 and r["val"]["n_samples"] > 0 and r["val_fraction"] == 0.1


def test_eval_every_without_a_validation_set_is_refused_by_name(tmp_path):
    from labkit.training.trainer import Trainer

    cfg = load_run_config("configs/tiny_cpu.yaml", [f"output_dir={tmp_path}", "train.eval_every=2"])
    with pytest.raises(LabkitError, match="no validation set") as e:
        Trainer(cfg)
    assert "data.val_fraction" in e.value.fix


# ----------------------------------------------------------------------------------- pure functions


def test_rank_batches_cover_the_single_card_batches_once():
    single = rank_batches(37, 4)
    assert len(single) == 9 and single[-1] == slice(32, 36)  # the tail of one sample is left out
    shards = [rank_batches(37, 4, 2, r) for r in range(2)]
    assert sorted((s.start for sh in shards for s in sh)) == [s.start for s in single]


def test_eval_samples_spread_over_the_whole_set_and_are_named_when_too_few():
    samples = np.arange(320)[:, None]
    picked = spread(samples, 128)[:, 0]
    assert len(set(picked)) == 128 and picked[0] == 0 and picked[-1] == 319  # first to last, no repeats
    gaps = np.diff(picked)
    assert gaps.min() == 2 and gaps.max() == 3, "evenly spaced: (320 - 1) / (128 - 1) = 2.5 apart"
    assert spread(samples, 0) is samples and spread(samples, 500) is samples  # 0, or more than there are: all
    with pytest.raises(LabkitError) as e:
        Evaluator(None, samples, micro_batch=8, dp_size=2, eval_samples=12)
    assert "train.eval_samples 12" in str(e.value) and "train.eval_samples" in e.value.fix
    with pytest.raises(LabkitError, match="eval_samples must be >= 0"):
        load_run_config("configs/tiny_cpu.yaml", ["train.eval_samples=-1"])


def test_pick_token_greedy_topk_and_seeded():
    logits = np.array([0.0, 3.0, 2.9, -1.0, 1.0])
    assert pick_token(logits, 0.0, 0, np.random.default_rng(0)) == 1
    draws = [pick_token(logits, 1.0, 2, np.random.default_rng(s)) for s in range(200)]
    assert set(draws) == {1, 2}, "top-k 2 draws only the two most likely tokens"
    hot = [pick_token(logits, 100.0, 0, np.random.default_rng(s)) for s in range(400)]
    assert len(set(hot)) == 5, "a high temperature flattens the distribution"
    a = [pick_token(logits, 0.8, 0, np.random.default_rng(7)) for _ in range(3)]
    assert len(set(a)) == 1, "the same seed draws the same token"


# ------------------------------------------------------------------------------ training with evaluation


def _cfg(out, *sets, config="configs/tiny_10min.yaml"):
    """The first 4 steps of the ten-minute config (its 2% validation split)."""
    return load_run_config(config, [f"output_dir={out}", "train.peak_tflops=0.1", "train.steps=4",
                                    "data.val_fraction=0.02", "train.eval_every=0", "train.sample_prompts=[]", *sets])


def _rows(out, name="metrics.jsonl"):
    return [json.loads(x) for x in (out / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """4 steps of configs/tiny_10min.yaml with evaluation every 2 steps and samples."""
    from labkit.training.trainer import train

    out = tmp_path_factory.mktemp("evaluated")
    summary = train(_cfg(out, "train.eval_every=2", "train.sample_prompts=[\"CHAPTER I\\n\\n\"]",
                         "train.sample_tokens=6"))
    return out, summary


def test_evaluation_does_not_change_training(tmp_path, evaluated):
    from labkit.training.trainer import train

    train(_cfg(tmp_path / "plain"))
    with_eval, plain = _rows(evaluated[0]), _rows(tmp_path / "plain")
    assert [r["loss"] for r in with_eval] == [r["loss"] for r in plain], "evaluation changed the training losses"
    assert [r["step"] for r in with_eval if "val_loss" in r] == [2, 4]
    assert all("val_loss" not in r for r in plain)
    last = with_eval[-1]
    assert last["val_ppl"] == pytest.approx(math.exp(last["val_loss"]))
    assert last["val_loss"] < with_eval[1]["val_loss"], "two more steps lower the validation loss"
    samples = _rows(evaluated[0], "samples.jsonl")
    assert [s["step"] for s in samples] == [2, 4] and all(len(s["tokens"]) == 6 for s in samples)
    assert evaluated[1]["val_loss"] == last["val_loss"]
    golden = json.loads(GOLDEN.read_text())
    assert golden["steps"][:2] == [2, 4]
    assert [r["val_loss"] for r in with_eval if "val_loss" in r] == pytest.approx(golden["val_loss"][:2], abs=2e-4), \
        "the ten-minute run's first validation losses changed (regenerate: see tests/golden/make_tiny_10min_val.py)"


def test_ms2hf_of_a_training_checkpoint_loads_in_transformers_with_the_same_loss_and_tokens(tmp_path, evaluated,
                                                                                           capfd):
    """The HF copy computes the trainer's validation loss on the validation set, and greedy `generate()` gives
    the tokens `labkit generate` gives."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from labkit.training.generate import load_checkpoint

    out, _ = evaluated
    code = main(["convert", "ms2hf", "--src", str(out), "--dst", str(tmp_path / "hf"), "--json"])
    r = json.loads(capfd.readouterr().out)
    assert code == 0 and r["step"] == 4 and "tokenizer.model" in r["copied_files"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    run = load_checkpoint(out)["run"]
    val = spread(D.read_samples(D.val_dir(D.ensure_dataset(run.data.seq_len, val_fraction=run.data.val_fraction))),
                 run.train.eval_samples)  # the samples the trainer's evaluation read
    mb = run.train.micro_batch
    with torch.no_grad():
        losses = [float(model(torch.tensor(val[b], dtype=torch.long), labels=torch.tensor(val[b], dtype=torch.long))
                        .loss) for b in rank_batches(len(val), mb)]
    assert float(np.mean(losses)) == pytest.approx(_rows(out)[-1]["val_loss"], abs=1e-4)

    code = main(["generate", "--checkpoint", str(out), "--prompt", "CHAPTER I\n\nIt was", "--max-new-tokens", "12",
                 "--json"])
    g = json.loads(capfd.readouterr().out)
    assert code == 0 and len(g["tokens"]) == 12
    # greedy decoding agrees when every token labkit chose is HF's argmax given the same context: teacher-forced, one
    # forward over prompt + generated tokens. A model 4 steps from its init has nearly flat logits, so a choice within
    # float32 noise (1e-5 of the logit scale) of the maximum counts as the argmax.
    with torch.no_grad():
        logits = model(torch.tensor([g["prompt_ids"] + g["tokens"]])).logits[0]
    n, scale = len(g["prompt_ids"]), float(logits.abs().max())
    gaps = [float(logits[n - 1 + k].max() - logits[n - 1 + k, t]) for k, t in enumerate(g["tokens"])]
    assert max(gaps) <= 1e-5 * max(scale, 1.0), f"labkit's greedy token is not HF's argmax: gaps {gaps}"
    assert sum(int(logits[n - 1 + k].argmax()) == t for k, t in enumerate(g["tokens"])) >= 6
    assert g["text"] == tok.decode(g["tokens"])
