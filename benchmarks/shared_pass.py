"""The feature pass shared by several processes (issue 62's check): demo-sized rows without cached features, one
training step after the pass, by 1 process of 1 thread and by 2 processes of 1 thread each (`torchrun`, gloo), each
on its own copy of the rows; wall times, and whether the two stores hold the same features bit for bit.

    python benchmarks/shared_pass.py --data runs/shared_pass/data     # made first if missing: eagle prep, 2,400
                                                                      # ShareGPT rows as the demo reads them
Prints one JSON line; BENCHMARKS.md keeps the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def eagle(*args) -> list[str]:
    return [str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else sys.executable,
            str(ROOT / "eagle_cli.py"), *map(str, args)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="runs/shared_pass/data")
    ap.add_argument("--target", default="smollm2-135m")
    args = ap.parse_args()
    data = Path(args.data)
    if not (data / "train.jsonl").exists():  # the demo's ShareGPT rows, its lengths, without regeneration
        subprocess.run(eagle("prep", "--target", args.target, "--data", "sharegpt", "--out", data, "--max-rows",
                             2400, "--max-turns", 1, "--max-length", 448, "--no-save-features"), check=True)
    work = data.parent
    result = {}
    for name, processes in (("one", 1), ("two", 2)):
        copy = work / f"copy-{name}"
        shutil.rmtree(copy, ignore_errors=True)
        copy.mkdir()
        for f in ("train.jsonl", "val.jsonl"):
            shutil.copy(data / f, copy / f)
        run = work / f"run-{name}"
        shutil.rmtree(run, ignore_errors=True)
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] if processes > 1
                    else [sys.executable])
        argv = [*launcher, *eagle("train", "--config", ROOT / "configs/smollm2-135m-eagle1.yaml",
                                  f"model.target={args.target}", f"data.prepared={copy}", f"run_dir={run}",
                                  f"out={run}/head", "budget.max_steps=1", "budget.minutes=0", "eval.num_prompts=0",
                                  "eval.every_minutes=0", "num_threads=1", "device=cpu", "tensorboard=false",
                                  "model.vocab_counts=")[1:]]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        t0 = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"})
        result[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
        if done.returncode != 0:
            raise SystemExit(f"{name}: {done.stderr[-3000:]}")
        print(name, result[f"{name}_seconds"], "s", file=sys.stderr, flush=True)
    result["ratio"] = round(result["two_seconds"] / result["one_seconds"], 3)

    from eagle.features import FeatureStore, features_dir
    from eagle.target import load_target
    from train.config import TrainConfig
    from train.data import load_rows

    target = load_target(args.target, layers=False)
    lengths = [len(r[0]) for r in load_rows(TrainConfig(), "train", str(work / "copy-one"))]
    one, two = (FeatureStore.open(features_dir(work / f"copy-{n}", "train", target), lengths) for n in ("one", "two"))
    import torch

    result["rows"], result["tokens"] = len(lengths), sum(lengths)
    result["same_store"] = bool(one is not None and two is not None
                                and all(torch.equal(one[i], two[i]) for i in range(len(lengths))))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
