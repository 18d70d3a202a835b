"""The C product kernel (eagle.cpukernel.rows_linear) against F.linear and, optionally, against the kernel of
another git revision, on SmolLM2-135M's weight shapes at the row counts a decoding pass multiplies.

    .venv/bin/python benchmarks/kernel.py --against HEAD~1 /tmp/variant.py --rows 1 2 4 8 12 16

Each shape gets enough distinct random weights to fill 64 MB (more than the last-level cache), so every sweep
reads them from memory as a decoding pass does. The layouts are interleaved within each repeat and the median
and the minimum over repeats are printed, in ms per 100 MB of weights (a pass of SmolLM2 reads ~540 MB). The
last line is a JSON object: {shape: {rows: {layout: median ms}}}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle import cpukernel

SHAPES = ("576x576", "192x576", "1536x576", "576x1536", "49152x576")


def kernel_at(rev: str) -> ctypes.CDLL:
    """The kernel library of a copy of eagle/cpukernel.py (a path), or as it was at git revision `rev`, compiled
    into a temporary directory."""
    if Path(rev).is_file():
        text = Path(rev).read_text()
    else:
        text = subprocess.run(["git", "show", f"{rev}:eagle/cpukernel.py"], check=True, capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent.parent).stdout
    source = text.split('SOURCE = r"""', 1)[1].split('"""', 1)[0]
    path = Path(tempfile.mkdtemp()) / "k.so"
    cpukernel.build(path, source)
    return cpukernel.load(path)


def call(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x.new_empty(x.shape[0], w.shape[0])
    lib.rows_linear(w.data_ptr(), x.data_ptr(), None, y.data_ptr(), w.shape[0], w.shape[1], x.shape[0],
                    torch.get_num_threads())
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="out x in, e.g. 576x1536")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--against", nargs="*", default=[],
                    help="also time the kernel of these git revisions or copies of eagle/cpukernel.py")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.manual_seed(0)
    layouts = {"F.linear": lambda x, w: F.linear(x, w), "kernel": lambda x, w: cpukernel.rows_linear(x, w, None)}
    for rev in args.against:
        layouts[Path(rev).stem[-16:]] = lambda x, w, lib=kernel_at(rev): call(lib, x, w)
    result: dict = {}
    print(f"threads {torch.get_num_threads()}; ms per 100 MB of weights, median (min) of {args.repeats}")
    print(f"{'shape':>10} {'rows':>4} " + " ".join(f"{name:>16}" for name in layouts))
    for shape in args.shapes:
        out_f, in_f = map(int, shape.split("x"))
        per = out_f * in_f * 4
        weights = [torch.randn(out_f, in_f) / in_f ** 0.5 for _ in range(max(1, (64 << 20) // per))]
        scale = 100e6 / (per * len(weights)) * 1e3
        result[shape] = {}
        for rows in args.rows:
            x = torch.randn(rows, in_f)
            want = F.linear(x, weights[0])
            for name, fn in layouts.items():
                torch.testing.assert_close(fn(x, weights[0]), want, rtol=1e-4, atol=1e-4, msg=name)
            times: dict[str, list[float]] = {name: [] for name in layouts}
            for _ in range(args.repeats):
                for name, fn in layouts.items():
                    t0 = time.perf_counter()
                    for w in weights:
                        fn(x, w)
                    times[name].append((time.perf_counter() - t0) * scale)
            result[shape][rows] = {name: round(statistics.median(t), 2) for name, t in times.items()}
            print(f"{shape:>10} {rows:>4} " + " ".join(
                f"{statistics.median(t):>9.2f} ({min(t):5.2f})" for t in times.values()), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
