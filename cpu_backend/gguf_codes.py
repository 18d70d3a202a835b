"""The codes of a GGUF file's K-quant tensors (Q4_K, Q5_K, Q6_K), matched to the weights of the model loaded from it.

transformers loads a GGUF checkpoint by dequantizing every tensor to float32. For Q4_1, Q8_0, Q5_0 and Q4_0 tensors
the kernels read the codes back from the float32 values themselves (`kernels.q4_1_codes`, `q8_0_codes`): a group's
one float16 scale can be recovered from its values. A K-quant scale is a float16 times a 6- or 8-bit integer (exact
in float32, but not a float16), and a Q4_K group need not hold its least code, so their codes are read from the file
instead. Each super-block of 256 values holds a float16 d (and dmin), the integer scales of its sub-blocks and the
codes; for every 16 consecutive values w = fl(fl(D q) + m), with D = d sc and m = -dmin mc exact in float32 (m = 0
for Q6_K) and q a small integer: the form `kernels.pack_kq` lays out (1.5 bytes a weight instead of 4).

A weight is matched to a file tensor by the values of its rows, not by names (transformers renames tensors and
reorders the rows of some, as Llama's q / k projections): every row must equal a decoded row of the tensor bit for
bit (zeros of either sign alike), else the weight gets no codes. The block layouts are ggml's (its `block_q4_K`,
`block_q5_K`, `block_q6_K`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from cpu_backend.weight_layouts import layouts

QK = 256  # values of a super-block
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
TYPE_IDS = {12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}  # ggml's type numbers
# sizes of GGUF metadata values by type number (8: string, 9: array)
VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _tensors(path: str | Path) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, sizes innermost first, ggml type number, byte offset in the file) of every tensor of a GGUF file,
    read from its header; the metadata (a tokenizer's whole vocabulary) is stepped over, not parsed."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    at = 0

    def u(n: int) -> int:
        nonlocal at
        at += n
        return int.from_bytes(buf[at - n: at].tobytes(), "little")

    def text() -> str:
        nonlocal at
        n = u(8)
        at += n
        return buf[at - n: at].tobytes().decode()

    def skip(kind: int) -> None:
        nonlocal at
        if kind == 8:
            n = u(8)
            at += n
        elif kind == 9:
            item, count = u(4), u(8)
            if item in VALUE_BYTES:
                at += VALUE_BYTES[item] * count
            else:
                for _ in range(count):
                    skip(item)
        else:
            at += VALUE_BYTES[kind]

    if buf[:4].tobytes() != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    at = 8  # magic and version
    n_tensors, n_kv = u(8), u(8)
    align = 32
    for _ in range(n_kv):
        key, kind = text(), u(4)
        if key == "general.alignment" and kind == 4:
            align = u(4)
        else:
            skip(kind)
    infos = []
    for _ in range(n_tensors):
        name = text()
        dims = tuple(u(8) for _ in range(u(4)))
        infos.append((name, dims, u(4), u(8)))
    start = -(-at // align) * align
    return [(name, dims, kind, start + off) for name, dims, kind, off in infos]


def _half(raw: np.ndarray) -> np.ndarray:
    """Two bytes a row as float16 values, widened to float32 (exactly): [n, 2] uint8 -> [n, 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of Q4_K / Q5_K super-blocks from their 12 packed bytes [n, 12]: sub-blocks
    0-3 in the low six bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11 with
    their two high bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    s = s.astype(np.int32)
    low_sc, low_mn = s[:, 0:4] & 63, s[:, 4:8] & 63
    high_sc = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    high_mn = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return np.concatenate([low_sc, high_sc], 1), np.concatenate([low_mn, high_mn], 1)


def decode_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [n, 256] int8, D [n, 16], m [n, 16] float32) of n super-blocks [n, BLOCK_BYTES[kind]] uint8: value i of a
    super-block is fl(fl(D[i // 16] q[i]) + m[i // 16])."""
    n = raw.shape[0]
    if kind == "Q6_K":  # ql[128] (low four bits), qh[64] (high two), int8 scales[16], float16 d
        ql, qh = raw[:, :128].astype(np.int16), raw[:, 128:192].astype(np.int16)
        q = np.empty((n, QK), dtype=np.int16)
        for h in range(2):  # each half of 128 values: four runs of 32
            lo, hi, base = ql[:, 64 * h: 64 * h + 64], qh[:, 32 * h: 32 * h + 32], 128 * h
            for r, (part, shift) in enumerate(((lo[:, :32] & 15, 0), (lo[:, 32:] & 15, 2), (lo[:, :32] >> 4, 4),
                                                (lo[:, 32:] >> 4, 6))):
                q[:, base + 32 * r: base + 32 * r + 32] = part | (((hi >> shift) & 3) << 4)
        q -= 32
        sc = raw[:, 192:208].view(np.int8).astype(np.float32)
        d = (_half(raw[:, 208:210]) * sc).astype(np.float32)
        return q.astype(np.int8), d, np.zeros_like(d)
    # Q4_K / Q5_K: float16 d and dmin, 12 bytes of scales, (Q5_K: qh[32], the fifth bits), qs[128] (nibbles)
    d, dmin = _half(raw[:, 0:2]), _half(raw[:, 2:4])
    sc, mn = _scales_mins(raw[:, 4:16])
    qs = raw[:, 16:144] if kind == "Q4_K" else raw[:, 48:176]
    qh = raw[:, 16:48].astype(np.int16) if kind == "Q5_K" else None
    q = np.empty((n, QK), dtype=np.int16)
    for c in range(4):  # each 64 values: the low nibbles of 32 bytes, then their high nibbles
        b = qs[:, 32 * c: 32 * c + 32].astype(np.int16)
        q[:, 64 * c: 64 * c + 32], q[:, 64 * c + 32: 64 * c + 64] = b & 15, b >> 4
        if qh is not None:
            q[:, 64 * c: 64 * c + 32] |= ((qh >> (2 * c)) & 1) << 4
            q[:, 64 * c + 32: 64 * c + 64] |= ((qh >> (2 * c + 1)) & 1) << 4
    big = (d * sc.astype(np.float32)).astype(np.float32)  # per sub-block of 32, exact
    low = -(dmin * mn.astype(np.float32)).astype(np.float32)
    return q.astype(np.int8), np.repeat(big, 2, axis=1), np.repeat(low, 2, axis=1)


def decode(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float32 values of codes q [..., k] with D, m [..., k / 16]: fl(fl(D q) + m), as the kernels decode them."""
    return d.repeat_interleave(16, -1) * q.float() + m.repeat_interleave(16, -1)


def tensor_codes(path: str | Path, dims: tuple[int, ...], kind: str, offset: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [rows, cols] int8, D, m [rows, cols / 16] float32) of a 2-D K-quant tensor of a GGUF file (its sizes
    innermost first, [cols, rows], as GGUF lists them)."""
    cols, rows = dims
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(rows * cols // QK, BLOCK_BYTES[kind]))
    q, d, m = decode_blocks(np.asarray(raw), kind)
    return (torch.from_numpy(q).reshape(rows, cols), torch.from_numpy(d).reshape(rows, cols // 16),
            torch.from_numpy(m).reshape(rows, cols // 16))


CHUNK = 4096  # rows decoded, keyed or compared at a time: a tensor's float32 values are never made whole


def _row_keys(rows: int, row_values) -> torch.Tensor:
    """A 64-bit key per row from its values' bits (zeros of either sign alike); `row_values(a, b)` gives rows a..b-1."""
    keys, mult = [], None
    for a in range(0, rows, CHUNK):
        w = row_values(a, min(a + CHUNK, rows)) + 0.0
        if mult is None:  # the same odd multipliers for every row of every call
            mult = torch.randint(1, 1 << 62, (w.shape[1],), generator=torch.Generator().manual_seed(0)) | 1
        keys.append((w.view(torch.int32).to(torch.int64) * mult).sum(-1))
    return torch.cat(keys)


def attach(model: nn.Module, path: str | Path) -> int:
    """Give each float32 weight of `model` that a K-quant tensor of the GGUF file at `path` dequantizes to its codes
    (`weight_layouts.layouts(weight).kquant = (q, D, m)`, read by `kernels.kquant_codes`); returns how many weights got
    them."""

    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.dim() == 2 and p.dtype == torch.float32:
            by_shape.setdefault(tuple(p.shape), []).append(p)
    found = 0
    for _, dims, kind, offset in _tensors(path):
        if kind not in TYPE_IDS or len(dims) != 2 or dims[0] % QK:
            continue
        cands = [p for p in by_shape.get((dims[1], dims[0]), ()) if layouts(p).kquant is None]
        if not cands:
            continue
        q, d, m = tensor_codes(path, dims, TYPE_IDS[kind], offset)
        index = {k: i for i, k in enumerate(_row_keys(dims[1], lambda a, b: decode(q[a:b], d[a:b], m[a:b])).tolist())}
        for p in cands:
            w = p.detach()
            rows = [index.get(k) for k in _row_keys(dims[1], lambda a, b: w[a:b]).tolist()]
            if None in rows:
                continue
            rows = torch.tensor(rows)
            codes = q[rows], d[rows], m[rows]
            if all(torch.equal(decode(*(c[a:a + CHUNK] for c in codes)), w[a:a + CHUNK])
                   for a in range(0, dims[1], CHUNK)):
                layouts(p).kquant = codes
                found += 1
                break
    return found
