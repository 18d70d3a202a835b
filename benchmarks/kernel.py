"""The C product kernel (cpu_backend.kernels.rows_linear) against F.linear and, optionally, against the kernel of
another git revision, on SmolLM2-135M's weight shapes at the row counts a decoding pass multiplies.

    .venv/bin/python benchmarks/kernel.py --against HEAD~1 /tmp/variant --rows 1 2 4 8 12 16
    .venv/bin/python benchmarks/kernel.py --peak     # the machine's ceilings: FMAs, BLAS products, memory reads
    .venv/bin/python benchmarks/kernel.py --attention 256 512 --rows 1 4 8 16 32   # attention alone
    .venv/bin/python benchmarks/kernel.py --attention 256 --rows 8 16 --against 817d914   # and another revision's
    .venv/bin/python benchmarks/kernel.py --screen --rows 1 4 8 16 32 64   # greedy tokens: int8 screen vs lm_head
    .venv/bin/python benchmarks/kernel.py --q4 --shapes 1536x576 576x1536 --rows 1 2 4 8 16 64   # Q4_1 codes
    .venv/bin/python benchmarks/kernel.py --q4 --rows 1 3 4 16 --against HEAD   # and HEAD's codes (AMX / VNNI)

Each shape gets enough distinct random weights to fill 64 MB (more than the last-level cache), so every sweep
reads them from memory as a decoding pass does. The layouts are interleaved within each repeat in a new random order
(a product that runs right after `F.linear` is measurably slower: torch's threads still spin), and the median
and the minimum over repeats are printed, in ms per 100 MB of weights (a pass of SmolLM2 reads ~540 MB). The
last line is a JSON object: {shape: {rows: {layout: median ms}}}.

--against takes git revisions (their cpu_backend/csrc/; from before the C moved there, the `SOURCE` string of their
eagle/cpukernel.py), copies of a csrc folder (`cp -r cpu_backend/csrc /tmp/variant` to try a change), or copies of
such an old eagle/cpukernel.py: each compiled with this tree's flags and called with this tree's argument types.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cpu_backend import kernels, switches, toolchain
from speed import bandwidth_gb_s  # benchmarks/speed.py: GB/s of summing a 256 MB tensor

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = tempfile.TemporaryDirectory(prefix="eagle-bench-")  # other versions' files and libraries, removed at exit
SHAPES = ("576x576", "192x576", "1536x576", "576x1536", "49152x576")

# --peak: twelve independent chains of 8-wide FMAs on registers, no memory: the arithmetic ceiling of a core (the
# same with 16-wide AVX-512 FMAs where the CPU has them)
PEAK_SOURCE = (Path(__file__).resolve().parent / "peak.c").read_text()


def peak_fma(threads: int, iters: int = 50_000_000, width: int = 8) -> float:
    """Billions of `width`-wide FMAs (8: AVX2, 16: AVX-512) per second per thread, best of 5, with `threads`
    threads."""
    path = Path(tempfile.mkdtemp()) / "peak.so"
    source = PEAK_SOURCE if width == 8 else PEAK_SOURCE.replace("__m256", "__m512").replace("_mm256_", "_mm512_")
    toolchain.compile_library(path, source)
    lib = ctypes.CDLL(str(path))
    lib.fma_chains.argtypes, lib.fma_chains.restype = [ctypes.c_long, ctypes.c_int], ctypes.c_float
    best = min(_timed(lambda: lib.fma_chains(iters, threads)) for _ in range(5))
    return 12 * iters / best / 1e9


def blas_gflops(threads: int, rows: int = 4096, out_f: int = 1536, in_f: int = 576) -> float:
    """GFLOP/s of torch's own product (BLAS) on a large [rows, in] x [in, out] matmul, best of 5: what the matmuls
    of a training batch or a long prefill can reach here."""
    torch.set_num_threads(threads)
    a, b = torch.randn(rows, in_f), torch.randn(in_f, out_f)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * rows * in_f * out_f / best / 1e9


def weight_count() -> int:
    """SmolLM2-135M's weights in its products: 30 layers of SHAPES[:4] (q and o, k and v, gate and up, down) and the
    lm_head."""
    sizes = {s: int(s.split("x")[0]) * int(s.split("x")[1]) for s in SHAPES}
    return 30 * (2 * sizes["576x576"] + 2 * sizes["192x576"] + 2 * sizes["1536x576"] + sizes["576x1536"]) \
        + sizes["49152x576"]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def files_at(rev: str, *paths: str) -> Path:
    """Those of `paths` (files or folders of this repository) that git revision `rev` has, written under their own
    paths into a new temporary directory, which is returned."""
    present = [p for p in paths if subprocess.run(["git", "cat-file", "-e", f"{rev}:{p}"], cwd=ROOT,
                                                  capture_output=True).returncode == 0]
    if not present:
        raise SystemExit(f"git revision {rev!r} has none of {', '.join(paths)}")
    tar = subprocess.run(["git", "archive", "--format=tar", rev, "--", *present], check=True, capture_output=True,
                         cwd=ROOT).stdout
    folder = Path(tempfile.mkdtemp(dir=SCRATCH.name))
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(folder, filter="data")
    return folder


def source_folder(cpukernel_text: str) -> Path:
    """The C of an eagle/cpukernel.py from before the C moved into cpu_backend/csrc/ (its `SOURCE` string) as the
    kernels.c of a new temporary folder."""
    if 'SOURCE = r"""' not in cpukernel_text:
        raise SystemExit("this cpukernel.py holds no SOURCE string: pass its revision or a copy of its csrc folder")
    folder = Path(tempfile.mkdtemp(dir=SCRATCH.name))
    (folder / "kernels.c").write_text(cpukernel_text.split('SOURCE = r"""', 1)[1].split('"""', 1)[0])
    return folder


def compiled(csrc: Path) -> ctypes.CDLL:
    """kernels.c of the folder `csrc` (with the parts it includes) compiled as this tree's kernels are (its compiler
    and `toolchain.FLAGS`) into a new temporary directory, and loaded with this tree's argument types (`kernels.load`,
    which wants the library's sha256 beside it)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc / gcc, or $CC) on PATH")
    lib = Path(tempfile.mkdtemp(dir=SCRATCH.name)) / "kernels.so"
    done = subprocess.run([cc, *toolchain.FLAGS, str(csrc / "kernels.c"), "-o", str(lib), "-lm"], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{csrc / 'kernels.c'} did not build ({cc} exited {done.returncode}):\n{done.stderr[-4000:]}")
    lib.with_name(lib.name + ".sha256").write_text(hashlib.sha256(lib.read_bytes()).hexdigest() + "\n")
    return kernels.load(lib)


def kernel_at(rev: str) -> ctypes.CDLL:
    """The kernel library of another version (see --against), compiled into a temporary directory: a folder (a copy
    of a csrc folder, or of a cpu_backend folder holding one), a file (a copy of an eagle/cpukernel.py holding the C in
    its SOURCE string), or else a git revision."""
    path, packed = Path(rev), True  # every kernel whose C is in files reads weights in this tree's packed layout
    if path.is_dir():
        csrc = path / "csrc" if (path / "csrc").is_dir() else path
    elif path.is_file():
        text = path.read_text()
        csrc, packed = source_folder(text), "def pack(" in text
    else:
        tree = files_at(rev, "cpu_backend/csrc", "eagle/cpukernel.py")
        csrc = tree / "cpu_backend" / "csrc"
        if not csrc.is_dir():  # before the C moved into cpu_backend/csrc/
            text = (tree / "eagle" / "cpukernel.py").read_text()
            csrc, packed = source_folder(text), "def pack(" in text
    lib = compiled(csrc)
    lib.packed_weights = packed  # its products read weights in this tree's packed layout
    return lib


def call(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x.new_empty(x.shape[0], w.shape[0])
    lib.rows_linear(kernels.packed(w) if lib.packed_weights else w.data_ptr(), x.data_ptr(), None, y.data_ptr(),
                    w.shape[0], w.shape[1], x.shape[0], torch.get_num_threads())
    return y


def call_attend(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """kernels.attend through another build's library (bool mask)"""
    B, H, M, D = q.shape
    out = q.new_empty(B, M, H, D)
    lib.attend(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(), k.stride(0),
               k.stride(1), k.stride(2), mask.data_ptr(), 1, mask.stride(0) if mask.shape[0] > 1 else 0,
               mask.stride(2), out.data_ptr(), B, H, H // k.shape[1], M, k.shape[2], D, scale,
               torch.get_num_threads())
    return out


def time_attention(contexts: list[int], rows_list: list[int], repeats: int, against: list[str],
                   layers: int = 30) -> None:
    """ms per pass (SmolLM2's 30 layers, each with its own keys and values: 9 query heads on 3 key/value heads of
    64) of the attention alone for M new tokens after `context` cached ones, tree-like causal mask; with `against`,
    the attention kernels of those revisions too."""
    others = {Path(rev).stem[-16:]: kernel_at(rev) for rev in against}
    print(f"threads {torch.get_num_threads()}; ms for {layers} layers, median of {repeats}")
    for context in contexts:
        for m in rows_list:
            n = context + m
            qs = [torch.randn(1, 9, m, 64) for _ in range(layers)]
            kvs = [(torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64)) for _ in range(layers)]
            mask = torch.ones(1, 1, m, n, dtype=torch.bool).tril(context)

            def folded(q, k, v):
                return F.scaled_dot_product_attention(q.reshape(1, 3, 3 * m, 64), k, v,
                                                      attn_mask=mask.repeat(1, 1, 3, 1), scale=0.125)

            fns = {"kernel": lambda q, k, v: kernels.attend(q, k, v, mask, 0.125), "folded sdpa": folded}
            for name, lib in others.items():
                fns[name] = lambda q, k, v, lib=lib: call_attend(lib, q, k, v, mask, 0.125)
                torch.testing.assert_close(fns[name](qs[0], *kvs[0]), fns["kernel"](qs[0], *kvs[0]), msg=name)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for r in range(repeats):
                for name, fn in (fns.items() if r % 2 else reversed(fns.items())):
                    t0 = time.perf_counter()
                    for q, (k, v) in zip(qs, kvs):
                        fn(q, k, v)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            print(f"context {context:>5} M {m:>3}: " + "  ".join(
                f"{name} {statistics.median(t):6.2f}" for name, t in times.items()), flush=True)


def time_screen(rows_list: list[int], repeats: int) -> None:
    """Greedy tokens from SmolLM2's lm_head: `kernels.screen_argmax` against the whole float32 lm_head through
    the kernel and its argmax, on the target's own last features (3 MT-bench first turns and 48 greedy tokens
    after each), interleaved; and how many outputs the screen recomputes in float32 per row (the same bound as
    the C code, in float64 here)."""
    from eagle import load_target
    from infer import SpeculativeDecoder
    from infer.evaluate import load_prompts

    target = load_target("smollm2-135m")
    dec = SpeculativeDecoder(target, None)
    feats = []
    for p in load_prompts("../shared/evaldata/mt_bench.jsonl", 3):
        ids = dec.encode(p["prompt"])
        ids += dec.generate(ids, 48, speculative=False).token_ids
        with torch.inference_mode():
            f, _ = target.hidden(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None])
        feats.append(f[0, -48:])
    x_all = torch.cat(feats).contiguous()
    w = target.lm_head.weight
    _, s, c, n_max, _ = kernels.screen_tables(w)
    wq = torch.round(w.double() / s.double()[:, None]).clamp(-127, 127) * s.double()[:, None]
    x64 = x_all.double()
    extra = torch.zeros(len(x64), dtype=torch.float64)
    if kernels.library().screen_pairs():  # x rounded to int16 as the VNNI path does
        lim = min((2 ** 31 - 1) // 127 // w.shape[1], 16383)
        sx = x64.abs().amax(1, keepdim=True) / lim
        extra = (x64 - torch.round(x64 / sx) * sx).norm(dim=1) * n_max
    a = x64 @ wq.T
    b = x64.norm(dim=1, keepdim=True) * c.double()[None] + extra[:, None]
    n = ((a + b) >= (a - b).amax(1, keepdim=True)).sum(1).double()
    print(f"outputs recomputed in float32 per row ({len(n)} rows): mean {n.mean():.1f}, median {n.median():.0f}, "
          f"max {n.max():.0f} of {w.shape[0]}")
    print(f"threads {torch.get_num_threads()}; ms per call, median of {repeats}, interleaved")
    for m in rows_list:
        x = x_all[:m].contiguous()
        assert torch.equal(kernels.screen_argmax(x, w), kernels.rows_linear(x, w, None).argmax(-1))
        times: dict[str, list[float]] = {"whole lm_head": [], "screen": []}
        for r in range(repeats):
            for name in (times if r % 2 else reversed(list(times))):
                t0 = time.perf_counter()
                if name == "screen":
                    kernels.screen_argmax(x, w)
                else:
                    kernels.rows_linear(x, w, None).argmax(-1)
                times[name].append((time.perf_counter() - t0) * 1e3)
        whole, screen = statistics.median(times["whole lm_head"]), statistics.median(times["screen"])
        print(f"M {m:>3}: whole lm_head {whole:6.2f}  screen {screen:6.2f}  ratio {screen / whole:.2f}", flush=True)


def time_q4(shapes: list[str], rows_list: list[int], repeats: int, against: list[str], total_mb: int = 400) -> None:
    """Products of weights in GGUF Q4_1 form: their float32 copies, their codes on the FMA path (the switch `q4_1`;
    the same bits checked) and their codes on AMX tiles or in VNNI byte products where the CPU has them
    (the switches `amx`, `vnni`, the defaults; their largest errors against float64 printed beside the FMA
    path's), on enough distinct weights of each shape to hold
    `total_mb` MB in float32 (more than this machine's last-level cache reaches), interleaved; with `against`, the
    codes on AMX tiles or VNNI through those revisions' kernels too."""
    g = torch.Generator().manual_seed(0)
    before = switches.current()
    layouts = {"float32": (False, False, False), "codes, FMA": (True, False, False)}  # (q4_1, amx, vnni)
    if kernels.amx_on():
        layouts["codes, AMX"] = (True, True, False)
    elif kernels.library().vq_supported():
        layouts["codes, VNNI"] = (True, False, True)
    base, fast = list(layouts.items())[-1]
    libs = {name: None for name in layouts}
    for rev in against:
        name = f"{base} at {Path(rev).stem[-12:]}"
        layouts[name], libs[name] = fast, kernel_at(rev)
    print(f"threads {torch.get_num_threads()}; us per weight, median of {repeats}, {total_mb} MB of float32 weights")
    for shape in shapes:
        out_f, in_f = map(int, shape.split("x"))
        count = max(1, total_mb * 2 ** 20 // (4 * out_f * in_f))
        ws = [kernels.q4_1_weight(out_f, in_f, g) for _ in range(count)]
        for q4_1, amx, vnni in layouts.values():  # every layout made before timing
            switches.use(dataclasses.replace(before, q4_1=q4_1, amx=amx, vnni=vnni))
            for w in ws:
                kernels.packed(w)
        for m in rows_list:
            x = torch.randn(m, in_f, generator=g)
            outs, times = {}, {name: [] for name in layouts}
            for _ in range(repeats):
                for name in random.sample(list(layouts), len(layouts)):
                    q4_1, amx, vnni = layouts[name]
                    switches.use(dataclasses.replace(before, q4_1=q4_1, amx=amx, vnni=vnni))
                    lib = libs[name]
                    t0 = time.perf_counter()
                    for w in ws:
                        y = kernels.rows_linear(x, w, None) if lib is None else call(lib, x, w)
                    times[name].append((time.perf_counter() - t0) / len(ws) * 1e6)
                    outs[name] = y
            assert torch.equal(outs["float32"], outs["codes, FMA"]), (shape, m)
            exact = x.double() @ ws[-1].double().T
            err = {name: ((y.double() - exact).abs().max() / exact.abs().max()).item() for name, y in outs.items()}
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = [f"{name} {t:7.1f} ({med['float32'] / t:.2f}x, error {err[name]:.1e})" for name, t in med.items()]
            print(f"{shape} M {m:>3}: " + "  ".join(cells), flush=True)
    switches.use(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="out x in, e.g. 576x1536")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--against", nargs="*", default=[],
                    help="also time the kernels of these git revisions, copies of a csrc folder, or copies of an "
                         "old eagle/cpukernel.py that holds SOURCE")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--peak", action="store_true", help="only measure the arithmetic ceiling (FMAs per second)")
    ap.add_argument("--attention", nargs="*", type=int, metavar="KEYS",
                    help="only time attention (kernels.attend against sdpa with the query heads folded, "
                         "eagle.attention's gqa_sdpa, which cpu_backend.attention falls back to) at these cached "
                         "lengths, for --rows query rows")
    ap.add_argument("--screen", action="store_true",
                    help="only time greedy tokens from SmolLM2's lm_head: the int8 screen against the whole lm_head")
    ap.add_argument("--q4", action="store_true",
                    help="only time weights in GGUF Q4_1 form: their codes (FMA path; AMX tiles or VNNI byte "
                         "products) against their float32 copies; with --against, those revisions' codes too")
    args = ap.parse_args()
    if args.q4:
        time_q4(args.shapes, args.rows, args.repeats, args.against)
        return
    if args.screen:
        time_screen(args.rows, args.repeats)
        return
    if args.peak:
        widths = [8, 16] if "avx512f" in Path("/proc/cpuinfo").read_text() else [8]
        for w in widths:
            for n in sorted({1, torch.get_num_threads()}):
                g = peak_fma(n, width=w)
                print(f"{w}-wide, {n} thread(s): {g:.2f} G FMAs per second per thread, "
                      f"{g * n * w * 2:.0f} GFLOP/s in all")
        threads = torch.get_num_threads()
        for n in sorted({1, threads}):
            gflops = blas_gflops(n)  # sets the thread count for the read too
            gb_s = bandwidth_gb_s()
            print(f"{n} thread(s): torch's product [4096, 576] x [576, 1536] {gflops:.0f} GFLOP/s, "
                  f"reading memory {gb_s:.1f} GB/s")
        # a target pass over M new tokens reads every weight once and multiplies it M times: it takes at least
        # max(read time, product time) even if the two overlap perfectly (all threads, the last ones measured)
        params = weight_count()
        step_ms = params * 4 / gb_s / 1e6
        fits = max((m for m in range(1, 257) if 2 * params * m / gflops / 1e6 <= 1.3 * step_ms), default=0)
        print(f"SmolLM2-135M: {params / 1e6:.1f}M weights, a one-token pass >= {step_ms:.1f} ms (memory); at "
              f"{gflops:.0f} GFLOP/s the products of M tokens fit in 1.3x that up to M = {fits}")
        return
    if args.attention is not None:
        time_attention(args.attention or [256, 512], args.rows, args.repeats, args.against)
        return
    torch.manual_seed(0)
    layouts = {"F.linear": lambda x, w: F.linear(x, w), "kernel": lambda x, w: kernels.rows_linear(x, w, None)}
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
            order = random.Random(rows)
            for _ in range(args.repeats):
                # a new order every repeat: what runs right after F.linear is measurably slower (torch's threads
                # still spin), so no layout may follow it more often than the others
                names = list(layouts)
                order.shuffle(names)
                for name in names:
                    fn = layouts[name]
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
