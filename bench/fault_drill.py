"""Fault drill: SIGKILL `labkit convert`, `labkit data build` and a training-checkpoint save at moments drawn by a
seeded random generator, then look for half-written output.

Each drill first writes a complete output (the "previous" one) and times an uninterrupted run. Every kill point then
re-runs the command over that output (`--overwrite`, or the next checkpoint steps), waits until the command starts
writing (its `.tmp-*` folder appears), sleeps a random share (0 to 110%) of the shortest write time seen so far
(`.tmp-*` appearing to its rename into place; for the checkpoint loop, to the process exit; the machine's load
changes it) and sends SIGKILL to the whole process group. Afterwards the output path must hold a complete, verified output (the previous one or
the new one), and nothing else may look complete:
  convert   <dst>/conversion.json present, every tensor of model.ckpt with the crc32 the record lists
  data      labkit.data.dataset.read_stats(<dst>) passes (stats.json, every file at its recorded size)
  ckpt      every checkpoint folder with a state.json loads (labkit.training.checkpoint.load_full checks the recorded
            size and sha256 of state.ckpt), and the newest is at least the previous run's newest
A "half-written output" is any kill point after which one of these fails. The goal is zero. "killed" counts the runs
still alive at the kill, "mid-write" those that had a `.tmp-*` folder open at that moment.

    python bench/fault_drill.py --points 20 [--only convert data ckpt] [--seed 0] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRILLS = ("convert", "data", "ckpt")
SAVE_STEPS = """
import numpy as np, mindspore as ms
from labkit.training import checkpoint
def save_steps(out, first, last):
    rng = np.random.default_rng(first)
    params = [(f"w{i}", ms.Parameter(ms.Tensor(rng.standard_normal((1024, 1024)).astype(np.float32)), name=f"w{i}"))
              for i in range(8)]
    for step in range(first, last + 1):
        checkpoint.save(out, step, params, {"note": "fault drill"}, keep=2)
"""
SAVE_SCRIPT = SAVE_STEPS + "import sys\nsave_steps(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))\n"


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "GLOG_v": "3", "TQDM_DISABLE": "1"}


def labkit(*argv) -> list[str]:
    return [sys.executable, "-m", "labkit", *map(str, argv)]


# ---------------------------------------------------------------------------------------- the drills


class Drill:
    name = ""

    def __init__(self, work: Path):
        self.work = work
        work.mkdir(parents=True, exist_ok=True)

    def setup(self) -> None: ...
    def argv(self, k: int) -> list[str]: ...
    def watch(self) -> Path: ...  # the folder where a `.tmp-*` entry means writing has started
    def check(self) -> list[str]: ...

    ignore: frozenset = frozenset()  # .tmp-* folders that were there before the current run

    def started(self) -> bool:
        return _writing(self.watch(), self.ignore)


class ConvertDrill(Drill):
    name = "convert"

    def setup(self):
        from labkit.weights import parity
        from labkit.weights.convert import hf2ms

        parity.make_hf_llama(self.work / "hf", seed=1, vocab_size=4000, hidden_size=256, intermediate_size=704,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        hf2ms(self.work / "hf", self.dst)  # the previous output, written in this process: what the CLI calls

    @property
    def dst(self) -> Path:
        return self.work / "out" / "converted"

    def argv(self, k):
        return labkit("convert", "hf2ms", "--src", self.work / "hf", "--dst", self.dst, "--overwrite")

    def watch(self):
        return self.dst.parent

    def check(self):
        from labkit.weights.formats import ckpt_index, read_ckpt_tensor

        rec_path = self.dst / "conversion.json"
        if not rec_path.is_file():
            return [f"{self.dst}: no conversion.json (previous output lost)"]
        rec = json.loads(rec_path.read_text(encoding="utf-8"))
        index = ckpt_index(self.dst / "model.ckpt")
        problems = []
        for step in rec["tensors"]:
            if step["role"] != "param":
                continue
            e = index.get(step["ms_name"])
            if e is None:
                problems.append(f"{step['ms_name']} missing from model.ckpt")
            elif zlib.crc32(read_ckpt_tensor(self.dst / "model.ckpt", e).tobytes()) != step["crc32"]:
                problems.append(f"{step['ms_name']}: crc32 differs from conversion.json")
        return problems


class DataDrill(Drill):
    name = "data"
    seq_len = 64
    tokenizer = ROOT / "data/tokenizer"

    @property
    def corpus(self) -> Path:
        return self.work / "corpus.jsonl"

    def setup(self):
        from labkit.data.corpus import iter_documents
        from labkit.config import DataConfig
        from labkit.data.dataset import build_dataset

        docs = [d.text for _, d in zip(range(3000), iter_documents())]
        self.corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
        # the previous output, written in this process (the function `labkit data build` calls; the command's own
        # process start, ~10 s of imports, is timed and killed below)
        build_dataset(DataConfig(corpus=[self.corpus], tokenizer=self.tokenizer, seq_len=self.seq_len),
                      self.dst, progress=False, overwrite=True)

    @property
    def dst(self) -> Path:
        return self.work / "out" / "dataset"

    def argv(self, k):
        return labkit("data", "build", "--corpus", self.corpus, "--tokenizer", self.tokenizer, "--seq-len",
                      self.seq_len, "--output", self.dst, "--overwrite")

    def watch(self):
        return self.dst.parent

    def check(self):
        from labkit.data.dataset import read_stats
        from labkit.errors import LabkitError

        try:
            read_stats(self.dst)
        except LabkitError as e:
            return [e.what]
        return []


class CkptDrill(Drill):
    name = "ckpt"
    per_run = 4

    def setup(self):
        # the previous output, written in this process by the code the killed commands run (a process of its own
        # would spend seconds importing MindSpore before its first save)
        code = {}
        exec(SAVE_STEPS, code)
        code["save_steps"](str(self.out), 1, self.per_run)
        self.newest = self.per_run

    @property
    def out(self) -> Path:
        return self.work / "run"

    def argv(self, k):
        first = self.newest + 1
        return [sys.executable, "-c", SAVE_SCRIPT, str(self.out), str(first), str(first + self.per_run - 1)]

    def watch(self):
        return self.out / "checkpoints"

    def started(self) -> bool:  # a save is short: a finished new step also means writing began
        return _writing(self.watch(), self.ignore) or any(int(p.name.split("_")[1]) > self.newest
                                             for p in self.watch().glob("step_*"))

    def check(self):
        from labkit.errors import LabkitError
        from labkit.training import checkpoint

        problems, steps = [], []
        for ck in checkpoint.candidates(self.out):
            if not (ck / "state.json").is_file():
                continue  # not complete-looking: nothing lists it
            try:
                checkpoint.load_full(ck)
                steps.append(int(ck.name.split("_")[1]))
            except LabkitError as e:
                problems.append(e.what)
        if not steps or max(steps) < self.newest:
            problems.append(f"newest good checkpoint {max(steps, default=None)} < previous newest {self.newest}")
        self.newest = max(steps, default=self.newest)
        return problems


CLASSES = {"convert": ConvertDrill, "data": DataDrill, "ckpt": CkptDrill}


# ---------------------------------------------------------------------------------------- running


def _writing(folder: Path, ignore: frozenset = frozenset()) -> bool:
    """A new `.tmp-*` folder is open in `folder` (those left by earlier killed runs are in `ignore`)."""
    return folder.is_dir() and any(p.name.startswith(".tmp-") and p.name not in ignore for p in folder.iterdir())


def _watch_writes(drill: Drill, p, delay: float | None, timeout: float = 600) -> dict:
    """Follow a started process: when writing began and ended (the `.tmp-*` folder gone again, or for a loop of
    checkpoint saves, the process exit); with `delay`, SIGKILL the process group that long after writing began."""
    t0 = time.perf_counter()
    while p.poll() is None and not drill.started() and time.perf_counter() - t0 < timeout:
        time.sleep(0.002)
    began, ended, mid_write = time.perf_counter(), None, False
    while p.poll() is None:
        now = time.perf_counter()
        if ended is None and drill.name != "ckpt" and not _writing(drill.watch(), drill.ignore):
            ended = now
        if delay is not None and now - began >= delay:
            mid_write = _writing(drill.watch(), drill.ignore)  # a .tmp-* folder open at the moment of the kill
            os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    killed = p.poll() is None or p.wait() == -signal.SIGKILL
    p.wait()
    ended = ended or time.perf_counter()
    return {"killed": bool(killed and delay is not None), "mid_write": mid_write, "returncode": p.returncode,
            "startup_s": began - t0, "wrote_s": None if mid_write else round(ended - began, 3)}


def timed_run(drill: Drill, argv: list[str]) -> tuple[float, float]:
    """(seconds until writing started, seconds writing) of an uninterrupted run."""
    drill.ignore = frozenset(_leftovers(drill))
    p = subprocess.Popen(argv, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = _watch_writes(drill, p, None)
    if p.returncode != 0:
        raise RuntimeError(f"{drill.name}: the uninterrupted run failed ({p.returncode}): {' '.join(argv)}")
    return r["startup_s"], max(r["wrote_s"] or 0.0, 0.01)


def kill_run(drill: Drill, argv: list[str], delay: float) -> dict:
    """Start argv, wait for writing to begin, SIGKILL the process group `delay` s later. What happened."""
    drill.ignore = frozenset(_leftovers(drill))
    p = subprocess.Popen(argv, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    r = _watch_writes(drill, p, delay)
    r.pop("startup_s")
    return r


def run_drill(name: str, points: int, seed: int, work: Path, log=print) -> dict:
    drill = CLASSES[name](work)
    drill.setup()
    before = drill.check()
    if before:
        raise RuntimeError(f"{name}: the first output is already bad: {before}")
    warm, write = timed_run(drill, drill.argv(0))
    if name == "ckpt":
        drill.check()  # advance the newest step past the timed run
    rng = random.Random(f"{seed}-{name}")
    rows, seen = [], [write]
    for k in range(points):
        # the write time varies with the machine's load: aim within the shortest one seen so far (plus 10%)
        delay = rng.uniform(0, 1.1 * min(seen))
        r = kill_run(drill, drill.argv(k + 1), delay)
        if r["wrote_s"] and not r["killed"]:
            seen.append(r["wrote_s"])
        problems = drill.check()
        rows.append({"point": k, "delay_ms": round(delay * 1000, 1), **r, "problems": problems})
        log(f"  {name} #{k}: kill {delay * 1000:7.1f} ms into writing -> "
            f"{'killed' if r['killed'] else 'finished'}, {'OK' if not problems else problems}")
    return {"drill": name, "points": points, "killed": sum(r["killed"] for r in rows),
            "killed_mid_write": sum(r["mid_write"] for r in rows),
            "half_written": sum(bool(r["problems"]) for r in rows), "startup_s": round(warm, 2),
            "write_s": round(min(seen), 3), "leftover_tmp": len(_leftovers(drill)), "rows": rows}


def _leftovers(drill: Drill) -> list[str]:
    folder = drill.watch()
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((".tmp-", ".old-", ".del-"))) \
        if folder.is_dir() else []


def format_table(results: list[dict]) -> str:
    head = (f"{'command':<10}{'kill points':>12}{'killed':>8}{'mid-write':>11}{'half-written':>14}{'write time':>12}"
            f"{'tmp left':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['drill']:<10}{r['points']:>12}{r['killed']:>8}{r['killed_mid_write']:>11}"
                     f"{r['half_written']:>14}{r['write_s']:>11.2f}s{r['leftover_tmp']:>10}")
    total = sum(r["half_written"] for r in results)
    lines.append(f"half-written outputs found: {total} (goal: 0); 'tmp left' = hidden .tmp-*/.old-*/.del-* folders "
                 "left by killed writers (nothing reads them)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=20, help="kill points per command")
    ap.add_argument("--only", nargs="+", choices=DRILLS, default=list(DRILLS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    work = Path(tempfile.mkdtemp(prefix="fault_drill-"))
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    try:
        t0 = time.perf_counter()
        results = [run_drill(n, args.points, args.seed, work / n, log) for n in args.only]
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(r["half_written"] == 0 for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "seed": args.seed, "seconds": round(seconds, 1), "cpu": _cpu(),
                          "results": results}))
    else:
        print(format_table(results))
        print(f"{seconds:.0f} s on {_cpu()}")
    return 0 if ok else 1


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


if __name__ == "__main__":
    from labkit.runtime import prepare_process

    prepare_process("CPU")  # before anything imports MindSpore
    sys.exit(main())
