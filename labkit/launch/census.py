"""Take the state census (labkit.parallel.census) in msrun CPU workers: the mindformers run YAML of every amp
level with each wrapper the trainer picks, one launch for all of them.

    python -m labkit.launch.census [OUT] [--write]    # --write rewrites labkit/parallel/state_census.json"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import yaml

from labkit.config import AMP_LEVELS
from labkit.errors import LabkitError
from labkit.io import atomic_write_text
from labkit.launch.workers import run_workers
from labkit.parallel import census
from labkit.paths import RUNS


def take(out: Path, timeout: float = 600) -> dict:
    """The census of every amp level with each wrapper: {case: {amp_level, wrapper, roles, parallel_optimizer}}."""
    out = Path(out).resolve()  # the workers start in it
    shutil.rmtree(out, ignore_errors=True)
    (out / "yaml").mkdir(parents=True)
    cases = {f"{level}-{wrapper}": (level, wrapper) for level in AMP_LEVELS for wrapper in census.ACCUM}
    for name, (level, wrapper) in cases.items():
        atomic_write_text(out / "yaml" / f"{name}.yaml",
                          yaml.safe_dump(census.census_yaml(level, wrapper), sort_keys=False))
    run_workers(["python", "-m", census.__name__, "worker", str(out)], census.WORKERS, out, what="the state census",
                timeout=timeout, expect=lambda: all((out / f"{n}.json").exists() for n in cases))
    found = {}
    for name, (level, wrapper) in cases.items():
        data = json.loads((out / f"{name}.json").read_text())
        if data["wrapper"] != wrapper:
            raise LabkitError(f"census {name}: mindformers' trainer picked {data['wrapper']}, not {wrapper}",
                              "its _reset_wrapper rule changed: update labkit.parallel.census.ACCUM")
        found[name] = {"amp_level": level,
                       **{k: data[k] for k in ("wrapper", "roles", "parallel_optimizer", "weight_elements")}}
    return found


def state_file_text(found: dict) -> str:
    """What census.STATE_FILE holds for a census: the versions it was taken with, the recipe, the cases."""
    return json.dumps({"versions": census.versions(), "recipe": census.RECIPE, "cases": found}, indent=1,
                      sort_keys=True) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit.launch.census")
    ap.add_argument("out", nargs="?", default=str(RUNS / "census"))
    ap.add_argument("--write", action="store_true", help=f"rewrite {census.STATE_FILE.name} with the census")
    args = ap.parse_args(argv)
    text = state_file_text(take(Path(args.out)))
    if args.write:
        atomic_write_text(census.STATE_FILE, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
