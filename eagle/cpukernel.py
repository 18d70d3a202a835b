"""A small C kernel for the products of decoding on CPU: `x @ W.T` for a few rows, reading each weight row once.

At batch 1 a decoder step multiplies every weight by 1-16 rows, so it is bound by reading the weights. The BLAS
paths behind `F.linear` read them at a fraction of this machine's bandwidth for one row (BENCHMARKS.md: single-row
products). This kernel streams each weight row once and multiplies it with every input row while it sits in L1,
splitting the output rows over the threads `torch.get_num_threads()` names.

Every output value is summed in the same order whatever the number of rows (four 8-wide accumulators over the
input, then a fixed reduction), so a verification pass over M tokens gives each token exactly the logits a
single-token step gives it.

The source is compiled once per machine with the system C compiler (`cc -O3 -march=native -fopenmp`) into
`$EAGLE_CACHE/kernels/`. Without a compiler, or on a CPU the build fails on, `available()` is False and callers
keep the stock product.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from eagle.target import cache_root

BLOCK = 32  # input features consumed per inner iteration: in_features must be a multiple

SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

/* Lane l of accumulator j summed the products i = 32 t + 8 j + l in order; the lanes are added in a fixed order. */
static inline float reduce(v8 a0, v8 a1, v8 a2, v8 a3) {
    v8 s = (a0 + a1) + (a2 + a3);
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* Y[m, o] = sum_i W[o, i] X[m, i] (+ B[o]) for m < M; in_f % 32 == 0. Output rows are split over the threads;
   each weight row is read from memory once and reused from L1 for every pair of input rows. */
void rows_linear(const float *W, const float *X, const float *B, float *Y,
                 int64_t out_f, int64_t in_f, int64_t M, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < out_f; o++) {
        const float *w = W + o * in_f;
        const float bias = B ? B[o] : 0.0f;
        int64_t m = 0;
        for (; m + 1 < M; m += 2) {
            const float *x0 = X + m * in_f, *x1 = x0 + in_f;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            for (int64_t i = 0; i < in_f; i += 32) {
                v8 w0 = load8(w + i), w1 = load8(w + i + 8), w2 = load8(w + i + 16), w3 = load8(w + i + 24);
                a0 += w0 * load8(x0 + i); a1 += w1 * load8(x0 + i + 8);
                a2 += w2 * load8(x0 + i + 16); a3 += w3 * load8(x0 + i + 24);
                b0 += w0 * load8(x1 + i); b1 += w1 * load8(x1 + i + 8);
                b2 += w2 * load8(x1 + i + 16); b3 += w3 * load8(x1 + i + 24);
            }
            Y[m * out_f + o] = reduce(a0, a1, a2, a3) + bias;
            Y[(m + 1) * out_f + o] = reduce(b0, b1, b2, b3) + bias;
        }
        if (m < M) {
            const float *x0 = X + m * in_f;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t i = 0; i < in_f; i += 32) {
                a0 += load8(w + i) * load8(x0 + i); a1 += load8(w + i + 8) * load8(x0 + i + 8);
                a2 += load8(w + i + 16) * load8(x0 + i + 16); a3 += load8(w + i + 24) * load8(x0 + i + 24);
            }
            Y[m * out_f + o] = reduce(a0, a1, a2, a3) + bias;
        }
    }
}
"""

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]

_lib: ctypes.CDLL | None = None
_tried = False


def _library_path() -> Path:
    key = hashlib.sha1("|".join([SOURCE, *FLAGS, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:12]
    return cache_root() / "kernels" / f"rows_linear-{key}.so"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(path: Path) -> None:
    """Compile SOURCE into `path`, whole or not at all (a temporary directory, then a rename)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc / gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "rows_linear.c", Path(tmp) / "rows_linear.so"
        src.write_text(SOURCE)
        subprocess.run([cc, *FLAGS, str(src), "-o", str(lib)], check=True, capture_output=True, timeout=120)
        os.replace(lib, path)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be built here (then callers use F.linear)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("EAGLE_NO_KERNEL"):
        return None
    path = _library_path()
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rows_linear.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_int]
    lib.rows_linear.restype = None
    _lib = lib
    return _lib


def available() -> bool:
    return library() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel handles this weight: float32, contiguous, on the CPU, in_features a multiple of 32."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.dim() == 2 and weight.shape[1] % BLOCK == 0)


def rows_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x2, weight, bias)` for x2 [M, in] through the kernel (the caller checked `supports(weight)`)."""
    lib = library()
    x2 = x2.contiguous()
    y = x2.new_empty(x2.shape[0], weight.shape[0])
    lib.rows_linear(weight.data_ptr(), x2.data_ptr(), None if bias is None else bias.contiguous().data_ptr(),
                    y.data_ptr(), weight.shape[0], weight.shape[1], x2.shape[0], torch.get_num_threads())
    return y
