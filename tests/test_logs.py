"""labkit.logs: importing mindformers through labkit leaves PyTorch, HF datasets and nltk out of a MindSpore process,
and all three still import afterwards in the same process."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_mindformers_imports_without_torch_datasets_nltk_and_they_still_import_after(tmp_path):
    code = f"""
import json, sys
from labkit.logs import quiet_mindformers
quiet_mindformers()
from mindformers.models.llama import LlamaForCausalLM  # noqa: F401
without = not {{"torch", "datasets", "nltk", "scipy.stats"}} & set(sys.modules)
from mindformers.dataset.dataloader import hf_dataloader  # its `datasets` is a stand-in that says why it refuses
try:
    hf_dataloader.split_dataset_by_node(None, 0, 1)
    refused = ""
except RuntimeError as e:
    refused = str(e)
import tensorboardX  # mindformers' writer, with its torch check answered 'no'
w = tensorboardX.SummaryWriter({str(tmp_path)!r}); w.add_scalar("loss", 1.0, 1); w.close()
import scipy.stats
import torch
import datasets
from nltk.translate.bleu_score import sentence_bleu
print(json.dumps({{"without": without, "torch": float(torch.ones(3).sum()), "cdf": float(scipy.stats.norm.cdf(0.0)),
                  "refused": "labkit defers" in refused and "split_dataset_by_node" in refused,
                  "datasets": hasattr(datasets, "Dataset"), "bleu": sentence_bleu([list("abcd")], list("abcd")),
                  "events": len(list(__import__("pathlib").Path({str(tmp_path)!r}).glob("events.out.tfevents.*")))}}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"without": True, "torch": 3.0, "cdf": 0.5, "refused": True,
                                                              "datasets": True, "bleu": 1.0, "events": 1}
