"""Seconds a machine's first decode spends making the CPU backend's timing plans (`cpu_backend.fastpath.calibrate`):
the target's by whole passes, the head's by sweeps, as `SpeculativeDecoder.use_fast_path` makes them.

    .venv/bin/python benchmarks/calibration_time.py --draft runs/demo/head

Runs against an empty plan folder (a fresh `$EAGLE_CACHE` in a temporary directory, with the converted targets and
the built kernel library linked in from the real one, so only the plans are new) and prints one JSON line: the
seconds, and the layout each weight shape got at each row bucket (one letter a bucket: k kernel, l linear, w wxt).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from eagle.target import cache_root
from infer import SpeculativeDecoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", required=True, help="an EAGLE head directory")
    args = ap.parse_args()
    real = cache_root()
    with tempfile.TemporaryDirectory() as tmp:
        for part in ("targets", "kernels"):  # reused: only the plans are measured anew
            if (real / part).exists():
                os.symlink(real / part, Path(tmp) / part)
        os.environ["EAGLE_CACHE"] = tmp  # read when a plan or library is looked up, so set before the first
        dec = SpeculativeDecoder.from_pretrained(args.target, args.draft)
        t0 = time.perf_counter()
        dec.use_fast_path(True)
        seconds = time.perf_counter() - t0
        plans = [json.loads(f.read_text()) for f in sorted((Path(tmp) / "fastpath").glob("*.json"))]
    layouts = [{shape: "".join(v[0] for v in by_bucket.values()) for shape, by_bucket in p["layouts"].items()}
               for p in plans if "layouts" in p]
    print(json.dumps({"seconds": round(seconds, 1), "plans": layouts}))


if __name__ == "__main__":
    main()
