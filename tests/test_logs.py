"""labkit.logs: importing mindformers through labkit leaves PyTorch out of a MindSpore process, and PyTorch still
imports afterwards in the same process."""
import json
import subprocess
import sys


def test_mindformers_imports_without_torch_and_torch_still_imports_after(tmp_path):
    code = f"""
import json, sys
from labkit.logs import quiet_mindformers
quiet_mindformers()
from mindformers.models.llama import LlamaForCausalLM  # noqa: F401
without = "torch" not in sys.modules
import tensorboardX  # mindformers' writer, with its torch check answered 'no'
w = tensorboardX.SummaryWriter({str(tmp_path)!r}); w.add_scalar("loss", 1.0, 1); w.close()
import scipy.stats
import torch
print(json.dumps({{"without": without, "torch": float(torch.ones(3).sum()), "cdf": float(scipy.stats.norm.cdf(0.0)),
                  "events": len(list(__import__("pathlib").Path({str(tmp_path)!r}).glob("events.out.tfevents.*")))}}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"without": True, "torch": 3.0, "cdf": 0.5, "events": 1}
