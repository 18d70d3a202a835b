"""Small C kernels for decoding on CPU, where a step is a few rows through every weight of the model.

- `rows_linear`: `x @ W.T` for a few rows. At batch 1 a decoder step multiplies every weight by 1-16 rows: bound by
  reading the weights for one row, by arithmetic for 16. The BLAS paths behind `F.linear` read the weights at a
  fraction of this machine's bandwidth for one row and use half its vector width (BENCHMARKS.md). The kernel
  reads each weight in a packed layout (`pack`: blocks of 32 outputs, their weights for each input side by side,
  made once per weight and kept beside it), so a tile of up to 12 input rows multiplies each loaded weight vector
  with every row, with no horizontal sums; blocks are split over the threads `torch.get_num_threads()` names.
  A weight dequantized from GGUF Q4_1 (as transformers loads a `.gguf` file: `d * q + m` in float32 with float16
  d, m per 32 inputs of an output and 4-bit q) is kept as those codes instead (`q4_1_codes`, `pack_q4`: 0.625 bytes
  a weight, 4 before) and decoded in registers to the same float32 values, so every product keeps its bits while a
  one-token step reads a sixth of the bytes (SmolLM2: all 210 decoder weights; BENCHMARKS.md). Where the CPU has
  AMX tiles (Sapphire Rapids and later) those codes are multiplied on them instead (`amx_on`; `EAGLE_NO_AMX=1`
  keeps the FMA path): bfloat16 tile products of the exact codes and of each input split exactly into three
  bfloat16 parts, so float32 accuracy, other bits than the float32 path's, and 16 rows at about twice the cost of
  one instead of four times. Without AMX, where the CPU has AVX512-VNNI and VBMI (Zen 4, Ice Lake and later), calls
  of up to 64 rows multiply the codes (Q4_1, the Q8_0 form's, K-quants') by byte products instead (`vq_linear`;
  `vnni_on`; `EAGLE_NO_VNNI=1` keeps the FMA path): each input split exactly enough into three bytes a value for float32
  accuracy, the integer sums exact. Decoding the codes to float32 had bound the FMA path by arithmetic on Zen 4: a
  SmolLM2 pass of 1-16 tokens 1.17-1.35x faster (BENCHMARKS.md).
- `rows_gated`: a gated MLP's `silu(x @ G.T) * (x @ U.T)` in one pass over both weights (or GELU's tanh form,
  Gemma's, for silu).
- `rms_norm`: an RMS norm of each row in one call (the stock module is eight small torch ops).
- `attend`: attention of a few query rows over the KV cache, grouped-query heads read in place.
- `rope_`: the rotary embedding in place.
- `attention_block` and `decoder_layer`: a whole Llama-style attention module (products, q / k norms if any,
  rotary embedding, cache write, attention) or decoder layer (norms, attention, gated MLP, residual sums; Gemma-3's
  norms of the attention's and the MLP's outputs) in one call, made of the functions above: on this CPU each
  Python-level step around a C call costs microseconds, and these calls took about a quarter off a one-token pass
  (BENCHMARKS.md).
- `screen_argmax`: the argmax of `rows_linear`'s logits, bit for bit, for greedy tokens: the weight read in int8
  (`screen_tables`), a proven bound per output on how far the int8 estimate can lie from the float32 logit, and
  float32 sums only for the outputs whose bound reaches the largest lower bound (a few of SmolLM2's 49,152).
  With AVX512-VNNI the int8 estimate is integer arithmetic on x rounded to int16 (its rounding in the bound too).

Every output row is computed alone, in the same order whatever the number of rows (each product summed over the
inputs in order, one FMA each, or on AMX tiles or in byte products group by group; a fixed reduction elsewhere;
masked keys adding exact zeros), so a verification pass over M tokens (up to 64 with byte products) gives each
token exactly the bits a single-token step gives it (tests/test_attention.py checks a
whole model).

The C lives in `cpu_backend/csrc/` (kernels.c includes the parts, one per concern). It is compiled once per machine
and source with the system C compiler (`toolchain.FLAGS`: `-O3 -march=native -fopenmp`, warnings on) into
`$EAGLE_CACHE/kernels/`, a folder only its owner may write, with the library's sha256 beside it: a library whose
bytes differ is built again, never loaded. Without a compiler, or on a CPU the build fails on, `available()` is
False (the compiler's error printed once) and callers keep the stock torch ops; with EAGLE_REQUIRE_KERNEL=1 that is
an error instead. `EAGLE_NO_KERNEL=1` turns the kernels off. These and the other switches are read into one object
when the backend is enabled (`cpu_backend.switches`).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

import torch

from cpu_backend import gguf_codes, switches, toolchain
from cpu_backend.weight_layouts import layouts, version
from cpu_backend.toolchain import KernelError

BLOCK = 32  # input features consumed per inner iteration: in_features must be a multiple

_lib: ctypes.CDLL | None = None
_tried = False
_error = ""  # why there is no kernel, once `library` has tried


def path_key() -> str:
    """Names every setting that changes which code computes a product here: the kernel library in use (the sha256 of
    its file, or none) and the switches in force (`switches.Switches.product_key`: from the `EAGLE_NO_*` variables
    or chosen by a caller). A timing plan measured under one key is not reused under another."""
    lib = _lib or library()
    kernel = "none" if lib is None else lib.eagle_digest[:16]  # the library in use, as built (`load`)
    return f"{kernel}|{switches.current().product_key()}"


def load(path: Path) -> ctypes.CDLL:
    """A compiled kernel library with the argument types of its functions declared. Only a library whose bytes
    match the sha256 recorded beside it when it was built, in a folder only its owner can write
    (`toolchain.private_dir`)."""
    toolchain.private_dir(path.parent)
    recorded = path.with_name(path.name + ".sha256")
    digest = toolchain.digest(path)
    if not recorded.exists() or recorded.read_text().strip() != digest:
        raise KernelError(f"kernel {str(path)!r} does not match the sha256 recorded when it was built")
    lib = ctypes.CDLL(str(path))
    lib.eagle_digest = digest
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rows_linear.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_int]
    lib.rows_gated.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.rms_norm.argtypes = [vp, vp, vp, i64, i64, ctypes.c_float]
    lib.rope.argtypes = [vp, vp, vp, i64, i64, i64, i64, i64]
    lib.attend.argtypes = [vp, i64, i64, i64, vp, vp, i64, i64, i64, vp, ctypes.c_int, i64, i64,
                           vp, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    layer = [vp, i64, i64, vp, i64, i64, i64, vp, vp, i64, vp, ctypes.c_int, i64, ctypes.c_float, vp, vp, ctypes.c_int]
    lib.attention_block.argtypes = layer  # (x, M, hidden, &LayerArgs, heads, kv heads, head size, cos, sin, past,
    lib.decoder_layer.argtypes = layer    #  mask, mask kind, mask row stride, scale, work, y, threads)
    lib.decoder_stack.argtypes = [vp, i64, i64, i64, vp, i64, i64, i64, vp, vp, i64, vp, ctypes.c_int, i64,
                                  ctypes.c_float, vp, vp, vp, vp, ctypes.c_int]
    lib.layer_args_layout.argtypes, lib.layer_args_layout.restype = [vp], i64
    lib.layer_args_fields.argtypes, lib.layer_args_fields.restype = [], ctypes.c_char_p
    lib.screen_argmax.argtypes = [vp, vp, vp, ctypes.c_double, ctypes.c_double, vp, vp, i64, i64, i64, vp, vp,
                                  vp, vp, vp, vp, ctypes.c_int]
    lib.screen_argmax.restype = i64
    lib.kv_compact.argtypes = [vp, i64, i64, vp, i64]
    lib.screen_pairs.argtypes, lib.screen_pairs.restype = [], ctypes.c_int
    lib.screen_tiles.argtypes, lib.screen_tiles.restype = [], ctypes.c_int
    lib.q4_supported.argtypes, lib.q4_supported.restype = [], ctypes.c_int
    lib.vq_supported.argtypes, lib.vq_supported.restype = [], ctypes.c_int
    lib.int8_products.argtypes, lib.int8_products.restype = [], ctypes.c_int
    lib.amx_enable.argtypes, lib.amx_enable.restype = [], ctypes.c_int
    for fn in (lib.rows_linear, lib.rows_gated, lib.rms_norm, lib.rope, lib.attend, lib.attention_block,
               lib.decoder_layer, lib.decoder_stack, lib.kv_compact):
        fn.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use (and built again where the file found does not match its recorded
    sha256); None where it cannot be built here (then callers use F.linear), after printing why once. With
    EAGLE_REQUIRE_KERNEL=1 a kernel that cannot be had is an error (KernelError) instead."""
    global _lib, _tried, _error
    required = switches.current().require_kernel
    if _tried:
        if _lib is None and required and _error:
            raise KernelError(_error)
        return _lib
    _tried = True
    if not switches.current().kernel:
        if required:
            _error = "EAGLE_REQUIRE_KERNEL=1 and EAGLE_NO_KERNEL=1 ask for opposite things"
            raise KernelError(_error)
        return None
    path = toolchain.library_path()
    try:
        toolchain.private_dir(path.parent)
        if path.exists():
            try:
                _lib = load(path)
            except OSError as e:  # not the bytes recorded when it was built (KernelError), or unloadable
                print(f"eagle: {e}; building it again", file=sys.stderr)
        if _lib is None:
            toolchain.compile_library(path)
            _lib = load(path)
    except (OSError, AttributeError) as e:  # AttributeError: a library without a function
        _lib, _error = None, str(e) if isinstance(e, KernelError) else f"the CPU kernel could not be loaded ({e})"
        if required:
            raise KernelError(_error) from None
        print(f"eagle: {_error}\neagle: the CPU backend is off; stock torch ops run", file=sys.stderr)
    return _lib


def available() -> bool:
    return library() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel handles this weight: float32, contiguous, on the CPU, in_features a multiple of 32."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.dim() == 2 and weight.shape[1] % BLOCK == 0)


PACK = 32  # outputs per packed block (NB in the C source)


def pack(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """The product kernels' layout of a weight [out, in]: [ceil(out / PACK), in, PACK], block b holding outputs
    b * PACK .. b * PACK + PACK - 1 side by side for each input, zero rows padding the last block. With `pairs`
    (the VNNI screen's int8 weights): [ceil(out / PACK), in / 2, PACK, 2], each output's two inputs of a pair side
    by side."""
    w = weight.detach()
    out_f, in_f = w.shape
    padded = -(-out_f // PACK) * PACK
    if padded != out_f:
        w = torch.cat([w, w.new_zeros(padded - out_f, in_f)])
    if pairs:
        return w.reshape(padded // PACK, PACK, in_f // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.reshape(padded // PACK, PACK, in_f).transpose(1, 2).contiguous()  # reshape: w may be a transpose


def kept(weight: torch.Tensor, name: str, make, *key):
    """`make(weight)`, made on first use and kept in the weight's WeightLayouts under `name` until the weight
    changes in place (an optimizer step) or moves, or `key` or the kernel library changes."""
    full = (version(weight), weight.data_ptr(), id(_lib), *key)
    made = layouts(weight).made
    hit = made.get(name)
    if hit is None or hit[0] != full:
        hit = made[name] = (full, make(weight))
    return hit[1]


def q4_1_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [out, in] uint8, d, m [out, in / 32] float32) with weight[o, i] == fl(fl(d q) + m) bit for bit, d and m of
    the 32-input group of i and q in 0..15: the form of a GGUF Q4_1 tensor dequantized to float32 (as transformers
    loads one: `d * q + m` in float32, two roundings); None for any other weight. Found per group: m is its least
    value, d the float16 nearest (max - m) / 15 or one of its neighbours, q = round((w - m) / d), and every value
    is then checked bit for bit, so the codes always decode to the weight itself."""
    w = weight.detach()
    out_f, in_f = w.shape
    if in_f % 32 or w.dtype != torch.float32:
        return None
    g = w.reshape(out_f, in_f // 32, 32)
    lo = g.amin(-1, keepdim=True)
    if not torch.equal(lo.half().float(), lo):  # m is a float16 (also false for NaN)
        return None
    bits = g.view(torch.int32)
    d16 = ((g.amax(-1, keepdim=True) - lo) / 15).half()
    d_out, q_out = torch.zeros_like(lo), torch.zeros(g.shape, dtype=torch.uint8)
    done = torch.zeros_like(lo, dtype=torch.bool)
    for step in (0, -1, 1, -2, 2):
        d = (d16.view(torch.int16) + step).view(torch.float16).float() if step else d16.float()
        d = torch.where(d > 0, d, 0.0)  # a step below the float16 zero; 0 stands for groups of one value
        q = torch.where(d > 0, ((g - lo) / d).round().clamp(0, 15), 0.0)
        prod = d * q
        ok = ((prod + lo).view(torch.int32) == bits).all(-1, keepdim=True) & ~done
        d_out = torch.where(ok, d, d_out)
        q_out = torch.where(ok, q.to(torch.uint8), q_out)
        done |= ok
        if done.all():
            return q_out.reshape(out_f, in_f), d_out.squeeze(-1), lo.squeeze(-1)
    return None


def q4_1_weight(out_f: int, in_f: int, generator: torch.Generator) -> torch.Tensor:
    """A random weight in the form `q4_1_codes` finds (for tests and benchmarks): float16 d in [0, 0.02) and m in
    (-0.2, 0] per 32 inputs of an output, codes q in 0..15 with 0 and 15 in every group (ggml's quantizer gives a
    group's least value code 0 and its largest 15), then `d * q + m` in float32 as transformers computes it."""
    d = (torch.rand(out_f, in_f // 32, 1, generator=generator) * 0.02).half().float()
    m = (-torch.rand(out_f, in_f // 32, 1, generator=generator) * 0.2).half().float()
    q = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=generator)
    q[..., 0], q[..., 1] = 0, 15
    return (d * q.float() + m).reshape(out_f, in_f)


def q8_0_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [out, in] int8, d [out, in / 32] float32) with weight[o, i] == fl(d q) bit for bit, d a float16 value per
    group of 32 inputs: the form of a GGUF Q8_0 tensor dequantized to float32 (SmolLM2's embedding, tied to its
    lm_head), and of Q5_0 and Q4_0 ones (codes q - 16 and q - 8: Gemma-3's projections); None for any other weight.
    d is the float16 nearest max |w| / 127 (Q8_0; / 16 for Q5_0, / 8 for Q4_0, whose quantizers give the largest
    value the extreme code) or one of its neighbours, q = w / d rounded, and every value is checked; a weight whose
    first row is not in that form is turned down at once. (A Q5_0 or Q4_0 d can be negative: its -0.0 weights come
    back as 0.0, which gives every sum the same bits, the sums starting from 0.0.)"""
    w = weight.detach()
    out_f, in_f = w.shape
    if in_f % 32 or w.dtype != torch.float32 or not out_f:
        return None
    for rows in (w[:1], w):  # the first row alone first: most weights are not in this form
        g = rows.reshape(rows.shape[0], in_f // 32, 32)
        d_out, q_out = torch.zeros_like(g[..., :1]), torch.zeros(g.shape, dtype=torch.int8)
        done = torch.zeros_like(d_out, dtype=torch.bool)
        for top in (127, 16, 8):
            d16 = (g.abs().amax(-1, keepdim=True) / top).half()
            for step in (0, -1, 1, -2, 2):
                d = (d16.view(torch.int16) + step).view(torch.float16).float() if step else d16.float()
                d = torch.where(d > 0, d, 0.0)  # a step below the float16 zero; 0 stands for all-zero groups
                q = torch.where(d > 0, (g / d).round(), 0.0)
                ok = (q.abs() <= 127).all(-1, keepdim=True) & (
                    (d * q).view(torch.int32) == g.view(torch.int32)).all(-1, keepdim=True) & ~done
                d_out, q_out = torch.where(ok, d, d_out), torch.where(ok, q.to(torch.int8), q_out)
                done |= ok
            if bool(done.all()):
                break
        if not bool(done.all()):
            return None
    return q_out.reshape(out_f, in_f), d_out.squeeze(-1)


def q8_0_weight(out_f: int, in_f: int, generator: torch.Generator) -> torch.Tensor:
    """A random weight in the form `q8_0_codes` finds (for tests): float16 d in [0, 0.02) per 32 inputs of an
    output, codes in -127..127 with 127 and -127 in every group (ggml's quantizer gives a group's largest magnitude
    the code 127), then `d * q` in float32 as transformers computes it."""
    d = (torch.rand(out_f, in_f // 32, 1, generator=generator) * 0.02).half().float()
    q = torch.randint(-127, 128, (out_f, in_f // 32, 32), generator=generator)
    q[..., 0], q[..., 1] = 127, -127
    return (d * q.float()).reshape(out_f, in_f)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The FMA kernels' Q8_0 layout (see the C source) of codes q [out, in] (int8) with d [out, in / 32] (float16
    values): [ceil(out / PACK), in / 32, 1088] bytes, for each block of 32 outputs and group of 32 inputs the 32 d
    as float16, then each input's 32 codes; padding outputs decode to zero."""
    out_f, in_f = q.shape
    pad = -out_f % PACK
    q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    d = torch.nn.functional.pad(d.half(), (0, 0, 0, pad))
    nb, ng = q.shape[0] // PACK, in_f // 32
    codes = q.reshape(nb, PACK, ng, 32).permute(0, 2, 3, 1).reshape(nb, ng, 32 * PACK).view(torch.uint8)
    scales = d.reshape(nb, PACK, ng).permute(0, 2, 1).contiguous().view(torch.uint8)  # [nb, ng, 2 * PACK]
    return torch.cat([scales, codes], dim=-1).contiguous()


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, amx: bool = False) -> torch.Tensor:
    """The product kernels' Q4_1 layout (see the C source) of codes q [out, in] with d, m [out, in / 32] (float16
    values, as in a GGUF Q4_1 tensor): [ceil(out / PACK), in / 32, 640] bytes, d and m kept as float16; padding
    outputs decode to zero. With `amx`, the code bytes are ordered for the AMX tiles (`amx_decode` in the C
    source)."""
    out_f, in_f = q.shape
    pad = -out_f % PACK
    if pad:
        q, d, m = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (q, d, m))
    nb, ng = (out_f + pad) // PACK, in_f // 32
    dm = torch.stack([d, m]).reshape(2, nb, PACK, ng).permute(1, 3, 0, 2).contiguous()  # [nb, ng, 2, 32] floats
    if not torch.equal(dm.half().float(), dm):
        raise ValueError("pack_q4: d and m must hold float16 values (as a GGUF Q4_1 tensor's do)")
    if amx:  # word w of tile row t (half t // 16): output 16 (t // 16) + w // 2, input 2 (t % 16) + w % 2
        t, w = torch.arange(32).view(32, 1), torch.arange(32).view(1, 32)
        words = q.reshape(nb, PACK, ng, 32).permute(0, 2, 1, 3)[:, :, 16 * (t // 16) + w // 2, 2 * (t % 16) + w % 2]
        rows = words.reshape(nb, ng, 8, 4, 4, 8)  # [nb, ng, four rows s, row 4 s + r, j, e]: word 8 j + e
        low = torch.stack([rows[:, :, :, 0], rows[:, :, :, 1]], dim=4)  # byte 16 j + 8 h + e: row 4 s + h
        codes = low | (torch.stack([rows[:, :, :, 2], rows[:, :, :, 3]], dim=4) << 4)  # high bits: rows + 2
    else:
        q = q.reshape(nb, 2, PACK // 2, ng, 32).permute(0, 3, 4, 1, 2)  # [nb, ng, input, half, j]
        codes = q[..., 0, :] | (q[..., 1, :] << 4)  # byte j: output j's code low, output 16 + j's high
    dm = dm.half().view(torch.uint8).reshape(nb, ng, 128)
    return torch.cat([dm, codes.reshape(nb, ng, 512)], dim=-1).contiguous()


def kquant_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [out, in] int8, D, m [out, in / 16] float32) that `gguf_codes.attach` found for a weight dequantized from
    a GGUF K-quant tensor, if they still decode to it (fl(fl(D q) + m); zeros of either sign alike, which gives every
    sum the same bits), else None."""
    entry = layouts(weight, make=False)
    codes = None if entry is None else entry.kquant
    if codes is None or codes[0].shape != weight.shape or weight.dtype != torch.float32:
        return None
    return codes if torch.equal(gguf_codes.decode(*codes), weight.detach()) else None


def pack_kq(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The FMA kernels' K-quant layout (see the C source) of codes q [out, in] (int8) with D and m [out, in / 16]
    (float32): [ceil(out / PACK), in / 32, 1536] bytes, for each block of 32 outputs and group of 32 inputs the 32 D
    of the group's first 16 inputs, of its last 16, the same two for m, then each input's 32 codes; padding outputs
    decode to zero."""
    out_f, in_f = q.shape
    pad = -out_f % PACK
    q, d, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, d.float(), m.float()))
    nb, ng = q.shape[0] // PACK, in_f // 32
    codes = q.reshape(nb, PACK, ng, 32).permute(0, 2, 3, 1).reshape(nb, ng, 32 * PACK).view(torch.uint8)
    dm = torch.stack([d, m]).reshape(2, nb, PACK, ng, 2).permute(1, 3, 0, 4, 2).contiguous()  # [nb, ng, 2, 2, 32]
    return torch.cat([dm.view(torch.uint8).reshape(nb, ng, 16 * PACK), codes], dim=-1).contiguous()


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """The tiles' bfloat16 layout of a weight [out, in] (`bf16_block` in the C source): [ceil(out / PACK), in / 32,
    2, 16, 16, 2] bfloat16, for each block of 32 outputs and group of 32 inputs two tiles (outputs 0-15 and 16-31),
    row t holding inputs 2 t and 2 t + 1 of each output side by side; padding outputs are zero."""
    w = weight.detach().to(torch.bfloat16)
    out_f, in_f = w.shape
    if out_f % PACK:
        w = torch.cat([w, w.new_zeros(-out_f % PACK, in_f)])
    nb, ng = w.shape[0] // PACK, in_f // 32
    return w.reshape(nb, 2, 16, ng, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def draft_precision(weights: list[torch.Tensor], on: bool = True) -> None:
    """Mark (or unmark) `weights` to be multiplied in low precision where `packed` can (the `low_precision_drafts`
    switch) and no gradient is being recorded: an EAGLE head's while it drafts. In int8 with a scale per output where
    the CPU has AMX-INT8 or AVX512-VNNI (`int8_drafts`), else on AMX tiles in bfloat16. A draft only has to be
    likely, not exact (the target checks every token), and this reads a quarter (a half) of float32's bytes;
    measured, the acceptance stays (BENCHMARKS.md)."""
    for w in weights:
        entry = layouts(w)
        entry.draft = on
        entry.made.pop("address", None)  # `packed` answers again


def in_draft_precision(weight: torch.Tensor) -> bool:
    """Whether `packed` gives `weight` in low precision now (`draft_precision`)."""
    entry = layouts(weight, make=False)
    if entry is None or not entry.draft:
        return False
    on = switches.current()
    return (on.low_precision_drafts and not torch.is_grad_enabled() and supports(weight)
            and (amx_on() or (on.int8_drafts and bool((_lib or library()).int8_products()))))


def _pack_bf16(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    layout = pack_bf16(weight)
    return layout, layout.data_ptr() | 3


def pack_i8(weight: torch.Tensor) -> torch.Tensor:
    """The int8 draft layout of a weight [out, in] (`i8_linear` in the C source): q = round(w / s) with s = max |w| /
    127 per output, laid out as `pack_screen_tiles` lays the screen's, each block of 32 outputs followed by its 32
    scales (float32): [ceil(out / PACK), in_p * 32 + 128] bytes."""
    w = weight.detach().float()
    s = w.abs().amax(1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    tiles = pack_screen_tiles(q)
    nb = tiles.shape[0]
    scales = torch.nn.functional.pad(s, (0, nb * PACK - s.shape[0]), value=1.0).view(nb, PACK)
    return torch.cat([tiles.view(nb, -1), scales.view(torch.int8)], dim=1).contiguous()


def _pack_i8(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    layout = pack_i8(weight)
    return layout, layout.data_ptr() | 4


def _pack_any(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the kept layout, the address the kernels take): Q4_1 codes where the weight has that form and the kernel
    decodes it (the address tagged 2 for AMX tiles, else 1), Q8_0 codes where it has that one (tagged 5: the FMA
    path, the float32 layout's bits), K-quant codes found in its GGUF file (tagged 6: the same), else `pack`'s
    float32 layout."""
    if switches.current().q4_1 and _q4_ok():
        form = q4_1_codes(weight)
        if form is not None:
            amx = amx_on()
            layout = pack_q4(*form, amx=amx)
            return layout, layout.data_ptr() | (2 if amx else 1)
        form8 = q8_0_codes(weight)
        if form8 is not None:
            layout = pack_q8(*form8)
            return layout, layout.data_ptr() | 5
        formk = kquant_codes(weight)
        if formk is not None:
            layout = pack_kq(*formk)
            return layout, layout.data_ptr() | 6
    layout = pack(weight)
    return layout, layout.data_ptr()


def _q4_ok() -> bool:
    lib = _lib or library()
    return bool(lib is not None and lib.q4_supported())


_amx: bool | None = None


def amx_possible() -> bool:
    """Whether this kernel build and the OS allow AMX tiles (the OS's leave asked once per process), whatever the
    `amx` switch says."""
    global _amx
    if _amx is None:
        lib = _lib or library()
        _amx = bool(lib is not None and lib.amx_enable())
    return _amx


def amx_on() -> bool:
    """Whether Q4_1 codes are multiplied on AMX tiles: the `amx` switch and `amx_possible`."""
    return switches.current().amx and amx_possible()


def vnni_possible() -> bool:
    """Whether this kernel build has byte products (`vq_linear`: AVX512-VNNI and VBMI), whatever the switches say."""
    lib = _lib or library()
    return bool(lib is not None and lib.vq_supported())


def vnni_on() -> bool:
    """Whether GGUF codes are multiplied by byte products (`vq_linear`): the `vnni` switch, no AMX tiles in use
    (`amx_on`), a kernel built with them."""
    return switches.current().vnni and not amx_on() and vnni_possible()


def packed(weight: torch.Tensor) -> int:
    """Address of `weight` in the kernels' layout, made on first use and kept in its WeightLayouts until the weight
    changes in place (an optimizer step) or moves: Q4_1 codes for a weight dequantized from GGUF Q4_1 (0.625 bytes a
    weight; on the FMA path decoded to the same float32 values, so every product keeps its bits; on AMX tiles
    (`amx_on`) summed in another order with float32 accuracy, and so without them in byte products where `vnni_on` and
    the kernel allow: the same layout, bit 3 of the address set, as for Q8_0-form codes, except for a weight the
    greedy screen reads), else `pack`'s float32 copy (twice the weight's memory). Each setting of the switches
    keeps its own copy, so a benchmark can switch between them. A weight `draft_precision` marked is read in int8
    (`pack_i8`, tag 4) or bfloat16 (`pack_bf16`, tag 3) instead where `in_draft_precision` says so. The answer is
    kept there with every setting it depends on, so a decoding step's ~100 calls cost a dictionary lookup
    each."""
    return kept(weight, "address", _packed_address, switches.current(), torch.is_grad_enabled())


def _packed_address(weight: torch.Tensor) -> int:
    if in_draft_precision(weight):
        if switches.current().int8_drafts and (_lib or library()).int8_products():
            return kept(weight, "i8", _pack_i8)[1]
        return kept(weight, "bf16", _pack_bf16)[1]
    amx = amx_on()
    q4_1 = switches.current().q4_1
    name = ("amx" if amx else "q4") if q4_1 else "float32"
    address = kept(weight, name, _pack_any, q4_1, amx)[1]
    # bit 3: byte products; not for a weight the greedy screen reads, whose argmax is the float32 products' bit for
    # bit (the lm_head: its logits and greedy tokens agree)
    if address & 7 in (1, 5, 6) and not layouts(weight).screened and vnni_on():
        assert address & 8 == 0, "a layout's address not 16-byte aligned"
        return address | 8
    return address


# what the low bits of a layout's address (`packed`) say the kernels read; bit 3 on top: by byte products (VNNI)
ADDRESS_TAGS = {0: "float32 copy", 1: "Q4_1 codes", 2: "Q4_1 codes on AMX tiles", 3: "bfloat16 on AMX tiles",
                4: "int8 draft copy", 5: "Q8_0 codes", 6: "K-quant codes"}


def read_as(weight: torch.Tensor) -> str:
    """How the kernels read `weight` in the last product they made (`packed`'s address tag, `ADDRESS_TAGS`), or ""
    where they made none yet."""
    entry = layouts(weight, make=False)
    hit = entry.made.get("address") if entry is not None else None
    if hit is None:
        return ""
    tag = hit[1] & 15
    return ADDRESS_TAGS.get(tag & 7, "?") + (", byte products" if tag & 8 else "")


def unpack(weight: torch.Tensor) -> None:
    """Drop the copies the kernels keep for `weight` (`packed`, `screen_tables`, a norm's 1 + weight), and their
    memory; the K-quant codes read for it and its draft mark stay (they are facts about the weight, not copies)."""
    entry = layouts(weight, make=False)
    if entry is not None:
        entry.made.clear()
        entry.screened = False


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a few rows x [..., in] through the kernel (the caller checked
    `supports(weight)` and that x is float32). Lean on purpose: a decoding step makes ~150 of these calls, and on
    this machine each torch or Python operation around the C call costs about as much as a small product."""
    if not x.is_contiguous():
        x = x.contiguous()
    out_f, in_f = weight.shape
    y = x.new_empty(*x.shape[:-1], out_f)
    b = None if bias is None else bias.contiguous().data_ptr()
    (_lib or library()).rows_linear(packed(weight), x.data_ptr(), b, y.data_ptr(), out_f, in_f, x.numel() // in_f,
                                    torch.get_num_threads())
    return y


class _Linear(torch.autograd.Function):
    """`F.linear` with its gradients, every product through `rows_linear`: y = x W^T, and in the backward pass
    dx = dy W (W^T packed) and dW = dy^T x (x^T packed as the "weight"): the three products of a training step."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return rows_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = rows_linear(gy2, weight.t(), None).view(x.shape)
        if ctx.needs_input_grad[1]:
            gw = rows_linear(gy2.t(), x.reshape(-1, x.shape[-1]).t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy2.sum(0)
        return gx, gw, gb


def linear_with_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for training: forward and backward products through the packed kernel (float32
    on the CPU; the caller checked). About twice MKL's speed at a training batch's thousands of rows here."""
    if x.is_inference():  # features computed under inference_mode (online training): autograd may not keep those
        x = x.clone()
    return _Linear.apply(x, weight, bias)


GELU_TANH = 1  # `rows_gated`'s act for GELU's tanh form (Gemma's gelu_pytorch_tanh); 0: SiLU


def rows_gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int = 0) -> torch.Tensor:
    """`silu(x @ gate.T) * (x @ up.T)` for a few rows x [..., in], the first half of a gated MLP, in one pass over
    both weights (the caller checked `supports` for both and that x is float32); `act` GELU_TANH for GELU's tanh
    form instead of SiLU (as g sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)), within a few float32 ulps of torch's)."""
    if not x.is_contiguous():
        x = x.contiguous()
    out_f, in_f = gate.shape
    y = x.new_empty(*x.shape[:-1], out_f)
    (_lib or library()).rows_gated(packed(gate), packed(up), x.data_ptr(), y.data_ptr(), out_f, in_f,
                                   x.numel() // in_f, torch.get_num_threads(), act)
    return y


def screen_tables(weight: torch.Tensor, rows: int = 16
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None:
    """`screen_argmax`'s tables for weight [out, in] (float32, `supports`): the int8 weights q = round(w / s),
    packed as `pack` packs or, where the kernel multiplies input pairs (AVX512-VNNI), as [ceil(out / 32)][in / 2]
    [32][2]; the scales s [out] (float32); the bounds C [out]: |L - A| <= |x| C for any x, L the kernel's float32
    logit w . x and A = s (q . x) in float32; and the largest |s q| and |w| of a row. By Cauchy-Schwarz
    |w . x - s q . x| <= |x| |w - s q|, and a float32 sum of n products lies within gamma_n = n u / (1 - n u)
    (u = 2^-24) of the exact one, relative to sum |w_i x_i| <= |w| |x| (Higham, Accuracy and Stability of
    Numerical Algorithms, 3.1; underflow is the C code's absolute term). C is that sum, from float64, times 1.001
    for the float32 arithmetic of the test itself, rounded up to float32. None for a weight with a NaN or an
    infinity. Made on first use and kept beside the weight like `packed`'s copy (a quarter of its memory more). With
    AMX tiles (`amx_on` and a kernel with AMX-INT8) q is laid out for them instead (`pack_screen_tiles`): the same
    integer sums, at about one row's cost for up to 16 rows; for fewer than `screen_tile_rows` `rows` a second copy
    in the pairs layout, kept beside it."""
    lib = _lib or library()
    tiles = bool(lib.screen_tiles()) and amx_on()
    few = rows < switches.current().screen_tile_rows
    form = "tiles" if tiles and not few else "pairs" if lib.screen_pairs() else "rows"
    return kept(weight, "screen_few" if tiles and form != "tiles" else "screen",
                 lambda w: _screened(w, form), form)


def _screened(weight: torch.Tensor, form: str) -> tuple | None:
    """`screen_tables`' tables, made once; the weight marked so that its products keep the float32 path's bits
    (`_packed_address`: the screen's argmax is theirs)."""
    entry = layouts(weight)
    if not entry.screened:
        entry.screened = True
        entry.made.pop("address", None)
    return _screen_tables(weight.detach(), form) if bool(torch.isfinite(weight).all()) else None


def pack_screen_tiles(q8: torch.Tensor) -> torch.Tensor:
    """The AMX screen's layout of int8 weights [out, in] (C `screen_tile`): [ceil(out / PACK), in_p / 64, 2, 16, 16, 4]
    with in_p = in rounded up to 64: for each block of 32 outputs and 64 inputs two tiles (outputs 0-15 and 16-31),
    row t holding inputs 4 t .. 4 t + 3 of each output side by side; zeros pad outputs and inputs."""
    out_f, in_f = q8.shape
    q8 = torch.nn.functional.pad(q8, (0, -in_f % 64, 0, -out_f % PACK))
    nb, nc = q8.shape[0] // PACK, q8.shape[1] // 64
    return q8.reshape(nb, 2, 16, nc, 16, 4).permute(0, 3, 1, 4, 2, 5).contiguous()


def _screen_tables(weight: torch.Tensor, form: str) -> tuple:
    out_f, in_f = weight.shape
    n = in_f + 2
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    q8 = torch.empty(out_f, in_f, dtype=torch.int8)
    s, c = torch.empty(out_f), torch.empty(out_f)
    n_max = w_max = 0.0
    for lo in range(0, out_f, 4096):  # float64 in slices: the whole of a large lm_head would take GBs
        w = weight[lo:lo + 4096].double()
        sl = (w.abs().amax(1) / 127).float()
        sl = torch.where(sl > 0, sl, torch.ones_like(sl))  # a zero row: q = 0, A = 0 = L exactly
        q = torch.round(w / sl.double()[:, None]).clamp(-127, 127)
        sq = sl.double()[:, None] * q
        cl = ((w - sq).norm(dim=1) + gamma * (sq.norm(dim=1) + w.norm(dim=1))) * 1.001
        c32 = cl.float()
        c[lo:lo + 4096] = torch.where(c32.double() < cl, torch.nextafter(c32, torch.tensor(float("inf"))), c32)
        s[lo:lo + 4096], q8[lo:lo + 4096] = sl, q.to(torch.int8)
        n_max, w_max = max(n_max, float(sq.norm(dim=1).max())), max(w_max, float(w.norm(dim=1).max()))
    return pack_screen_tiles(q8) if form == "tiles" else pack(q8, form == "pairs"), s, c, n_max, w_max


def screen_weight_args(tables: tuple) -> tuple:
    """C `screen_argmax`'s first five arguments for `screen_tables`' answer: the int8 weights' address (tagged 2 for
    `pack_screen_tiles`'s layout), the scales', the bounds', the largest |s q| and |w|."""
    q, s, c, n_max, w_max = tables
    return q.data_ptr() | (2 if q.dim() == 6 else 0), s.data_ptr(), c.data_ptr(), n_max, w_max


def screen_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows_linear(x, weight, None).argmax(-1)` for rows x [..., in] (float32), bit for bit, reading the weight
    as int8 and only the few rows whose logit may be the largest in float32 (C `screen_argmax`): a quarter of the
    bytes for a greedy token. Rows the screen cannot settle (non-finite values) take the whole product. The caller
    checked `supports(weight)`."""
    if not x.is_contiguous():
        x = x.contiguous()
    out_f, in_f = weight.shape
    m = x.numel() // in_f
    tables = screen_tables(weight, m)
    if tables is None:
        return rows_linear(x, weight, None).argmax(-1)
    threads = torch.get_num_threads()
    a = _scratch(m * out_f + 2 * threads * m + 3 * m)
    at = torch.empty(threads * m, dtype=torch.int64)
    xq = torch.empty(m * in_f, dtype=torch.int16)
    y = torch.empty(m, dtype=torch.int64)
    lo = a[m * out_f:]
    left = (_lib or library()).screen_argmax(*screen_weight_args(tables),
                                             weight.data_ptr(), x.data_ptr(), out_f, in_f, m, a.data_ptr(),
                                             lo.data_ptr(), lo[threads * m:].data_ptr(), at.data_ptr(),
                                             xq.data_ptr(), y.data_ptr(), threads)
    if left:  # rows the screen left: their whole product, argmax as torch orders NaNs
        bad = (y < 0).nonzero().view(-1)
        y[bad] = rows_linear(x.reshape(m, in_f)[bad], weight, None).argmax(-1)
    return y.view(x.shape[:-1])


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """transformers' rotary embedding `x * cos + rotate_half(x) * sin`, bit for bit, in place on x [B, M, H *
    head_dim] (contiguous float32, head_dim even and at most 1024) with cos / sin [B or 1, M, head_dim]; returns x."""
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    (_lib or library()).rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1],
                             x.shape[-1] // head_dim, head_dim, cos.stride(0) if cos.shape[0] > 1 else 0)
    return x


def kv_compact(table: torch.Tensor, start: int, keep: torch.Tensor) -> None:
    """In each buffer of `table` ([n, 5] int64: a float32 buffer [heads, capacity, D] of one sequence, as its address,
    heads, head stride, row stride and D, in floats), row start + keep[i] of every head moved to row start + i, in
    place; keep: ascending int64 offsets with keep[i] >= i (contiguous, on the CPU)."""
    (_lib or library()).kv_compact(table.data_ptr(), table.shape[0], start, keep.data_ptr(), keep.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / sqrt(mean(x^2, -1) + eps))` over the last axis, whose size is a multiple of 32."""
    lib = library()
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), weight.contiguous().data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                 eps)
    return y


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Scaled dot-product attention for a few query rows, grouped-query heads read in place.

    query [B, H, M, D], key / value [B, H_kv, L, D] (any strides with D contiguous, key and value alike, D a multiple
    of 8), mask None or [B or 1, 1, M, L], bool (True = attend) or additive float. Returns [B, M, H, D]
    (transformers' attention functions' layout). A query row's result does not depend on the other rows."""
    lib = library()
    B, H, M, D = query.shape
    L = key.shape[2]
    kind, mask_sb, mask_sm, mptr = 0, 0, 0, None
    if mask is not None:
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
        kind = 1 if mask.dtype == torch.bool else 2
        mask_sb = mask.stride(0) if mask.shape[0] > 1 else 0
        mask_sm, mptr = mask.stride(2), mask.data_ptr()
    out = query.new_empty(B, M, H, D)
    lib.attend(query.data_ptr(), query.stride(0), query.stride(1), query.stride(2),
               key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), key.stride(2),
               mptr, kind, mask_sb, mask_sm, out.data_ptr(), B, H, H // key.shape[1], M, L, D, scale,
               torch.get_num_threads())
    return out



def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _projection_ptrs(projs: tuple) -> list:
    """(packed q weight, q bias, packed k weight, ...) addresses of an attention module's products."""
    return [packed(t) if i % 2 == 0 else _ptr(t) for i, t in enumerate(projs)]


def _mask_rows(mask: torch.Tensor | None) -> tuple[int, int]:
    """(mask kind, row stride) of a [1, 1, M, L] attention mask for the C calls: 0 none, 1 bool, 2 additive."""
    return (0, 0) if mask is None else (1 if mask.dtype == torch.bool else 2, mask.stride(2))


_local = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """A float32 buffer of at least n floats for the C calls' intermediate rows, kept per thread and reused."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.shape[0] < n:
        buf = _local.buf = torch.empty(max(n, 1 << 16))
    return buf


class LayerArgs(ctypes.Structure):
    """The C `layer_args` (csrc/kernels.h): one decoder layer's (or attention module's) weights in the kernels'
    layouts, sizes, epsilons and cache buffers, passed by pointer to `attention_block`, `decoder_layer` and, an array
    of them, `decoder_stack`. Its fields mirror the header's list in order; tests/test_backend_modules.py checks
    names, offsets and size against the compiled library (`layer_args_layout`)."""

    _fields_ = [*((name, ctypes.c_void_p) for name in (
                    "norm1", "norm2", "out_norm1", "out_norm2", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo",
                    "q_norm", "k_norm", "gate", "up", "down", "k_cache", "v_cache")),
                ("kv_sh", ctypes.c_int64), ("inter", ctypes.c_int64),
                *((name, ctypes.c_float) for name in ("eps1", "eps2", "eps_out1", "eps_out2", "eps_qk")),
                ("act", ctypes.c_int32)]


def layer_args(projs: tuple = (), norms: tuple | None = None, mlp: tuple | None = None,
               qk_norms: tuple | None = None, out_norms: tuple | None = None, act: int = 0,
               k_buf: torch.Tensor | None = None, v_buf: torch.Tensor | None = None) -> LayerArgs:
    """A LayerArgs of tensors: projs = (q weight, q bias, k weight, k bias, v weight, v bias, o weight, o bias), biases
    None or contiguous; norms = (input norm weight or None for no input norm, eps, the MLP's input norm weight, eps);
    mlp = (gate, up, down weights); qk_norms None or (q norm weight, k norm weight, eps): each head's query and key
    normed before the rotation (Qwen3, Gemma-3); out_norms None or Gemma-3's (attention output norm weight, eps,
    MLP output norm weight, eps); act: `rows_gated`'s; the cache buffers [1, kv_heads, capacity, head_dim]. Weights
    are given as their `packed` addresses."""
    a = LayerArgs()
    if projs:
        a.wq, a.bq, a.wk, a.bk, a.wv, a.bv, a.wo, a.bo = _projection_ptrs(projs)
    if norms is not None:
        a.norm1, a.eps1, a.norm2, a.eps2 = _ptr(norms[0]), norms[1], norms[2].data_ptr(), norms[3]
    if mlp is not None:
        a.gate, a.up, a.down = (packed(w) for w in mlp)
        a.inter = mlp[0].shape[0]
    if qk_norms is not None:
        a.q_norm, a.k_norm, a.eps_qk = qk_norms[0].data_ptr(), qk_norms[1].data_ptr(), qk_norms[2]
    if out_norms is not None:
        a.out_norm1, a.eps_out1, a.out_norm2, a.eps_out2 = (out_norms[0].data_ptr(), out_norms[1],
                                                            out_norms[2].data_ptr(), out_norms[3])
    a.act = act
    if k_buf is not None:
        a.k_cache, a.v_cache, a.kv_sh = k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(1)
    return a


def attention_block(x: torch.Tensor, projs: tuple, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                    sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, past: int,
                    mask: torch.Tensor | None, scale: float, qk_norms: tuple | None = None) -> torch.Tensor:
    """A Llama-style attention module's forward for x [1, M, hidden] in one C call, with the results of
    `rows_linear`, `rms_norm`, `rope_` and `attend` bit for bit; projs and qk_norms as `layer_args`'. The new keys
    and values are written into the cache buffers k_buf / v_buf [1, kv_heads, capacity >= past + M, head_dim]
    (contiguous) at positions past .. past + M - 1; mask is None (M = 1) or [1, 1, M, >= past + M] with its last
    axis contiguous, bool or additive float32; cos / sin [1, M, head_dim] contiguous. The caller checked all of it.
    Returns [1, M, hidden]."""
    m, hid = x.shape[1], x.shape[2]
    y = x.new_empty(1, m, projs[6].shape[0])
    work = _scratch(m * (2 * heads + 2 * kv_heads) * head_dim)
    kind, mask_sm = _mask_rows(mask)
    args = layer_args(projs, qk_norms=qk_norms, k_buf=k_buf, v_buf=v_buf)
    (_lib or library()).attention_block(
        x.data_ptr(), m, hid, ctypes.addressof(args), heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        past, _ptr(mask), kind, mask_sm, scale, work.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def decoder_layer(x: torch.Tensor, norms: tuple, projs: tuple, mlp: tuple, heads: int, kv_heads: int,
                  head_dim: int, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  past: int, mask: torch.Tensor | None, scale: float, qk_norms: tuple | None = None,
                  out_norms: tuple | None = None, act: int = 0) -> torch.Tensor:
    """A Llama-style decoder layer's forward for x [1, M, hidden] in one C call: `rms_norm`, `attention_block`,
    the residual sum, `rms_norm`, `rows_gated`, `rows_linear`, the residual sum, bit for bit; the layer's parts as
    `layer_args`' (Gemma-3's layers: out_norms, each applied before its residual sum, and act = GELU_TANH), the
    rest as `attention_block`'s."""
    m, hid = x.shape[1], x.shape[2]
    y = x.new_empty(1, m, hid)
    work = _scratch(m * (3 * hid + mlp[0].shape[0] + (2 * heads + 2 * kv_heads) * head_dim))
    kind, mask_sm = _mask_rows(mask)
    args = layer_args(projs, norms, mlp, qk_norms, out_norms, act, k_buf, v_buf)
    (_lib or library()).decoder_layer(
        x.data_ptr(), m, hid, ctypes.addressof(args), heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        past, _ptr(mask), kind, mask_sm, scale, work.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def stack_layers(layers: list[LayerArgs]) -> ctypes.Array:
    """`decoder_stack`'s table: the layers' LayerArgs (weights and cache buffers set) as one C array."""
    return (LayerArgs * len(layers))(*layers)


def decoder_stack(x: torch.Tensor, table: ctypes.Array, heads: int, kv_heads: int, head_dim: int, inter: int,
                  cos: torch.Tensor, sin: torch.Tensor, past: int, mask: torch.Tensor | None, scale: float,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
    """Every layer of a Llama-style decoder in one C call: `decoder_layer` on each in turn, bit for bit. table: the
    layers' LayerArgs (`stack_layers`), inter the largest intermediate size; keep: None or [L - 1, M, hidden], which
    receives every layer's output but the last; the rest as `decoder_layer`. Returns the last layer's output
    [1, M, hidden]."""
    m, hid = x.shape[1], x.shape[2]
    y, spare = x.new_empty(1, m, hid), x.new_empty(1, m, hid)
    work = _scratch(m * (3 * hid + inter + (2 * heads + 2 * kv_heads) * head_dim))
    kind, mask_sm = _mask_rows(mask)
    (_lib or library()).decoder_stack(
        x.data_ptr(), m, hid, len(table), ctypes.addressof(table), heads, kv_heads, head_dim, cos.data_ptr(),
        sin.data_ptr(), past, _ptr(mask), kind, mask_sm, scale, work.data_ptr(), spare.data_ptr(), y.data_ptr(),
        _ptr(keep), torch.get_num_threads())
    return y
