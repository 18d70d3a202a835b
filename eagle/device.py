"""Where and in what precision models run: one place that reads `--device` and `--dtype`.

    device = resolve_device("auto")       # cuda when a CUDA device is present, else cpu
    dtype = resolve_dtype("bfloat16")     # torch.bfloat16; "auto": bfloat16 on CUDA, float32 elsewhere

Devices: auto, cpu, cuda, cuda:N (and mps where torch has it). Precisions: float32, bfloat16, float16. In float32 on
CUDA the matmuls keep full float32 (TF32 off), so greedy tokens match a float32 reference; bf16 and fp16 round
differently from one row count to another, so there a near-tie can go either way (`eagle eval --reference hf`
reports the exact-match rate and the margin at each mismatch).
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(ValueError):
    """A device or precision that cannot be used here; the message names it."""


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto`: the first CUDA device when there is one, else the CPU; else the device named, checked to exist."""
    if isinstance(device, torch.device):
        return device
    name = (device or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {device!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r}: no CUDA device here (torch {torch.__version__}, "
                              f"CUDA build: {torch.version.cuda or 'none'})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {device!r}: MPS is not available here")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"device {device!r}: expected auto, cpu, cuda or cuda:N")
    return dev


def resolve_dtype(dtype: str | torch.dtype = "float32", device: str | torch.device | None = None) -> torch.dtype:
    """The dtype named; `auto` is the target's usual one on `device`: bfloat16 on CUDA (half the memory, the GPU's
    fast products), float32 elsewhere (the CPU backend's kernels are float32). One rule for prep, training and
    `eagle plan`, so that the features prep writes are the ones training looks for."""
    if isinstance(dtype, torch.dtype):  # from Python: any floating type (tests compare in float64)
        if not dtype.is_floating_point:
            raise DeviceError(f"dtype {dtype}: expected a floating-point type ({', '.join(DTYPES)})")
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key == "auto":
        return auto_dtype(resolve_device(device or "auto").type)
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(key, key)
    if key not in DTYPES:
        raise DeviceError(f"dtype {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[key]


def auto_dtype(kind: str) -> torch.dtype:
    """The dtype `auto` names on a device of this kind ("cuda", "cpu", ...)."""
    return torch.bfloat16 if kind == "cuda" else torch.float32


def full_float32_matmuls(device: torch.device) -> None:
    """Keep float32 matmuls in float32 on CUDA (no TF32), so that float32 greedy decoding gives the tokens a float32
    reference gives."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 natively (so a bfloat16 pass is faster than a float32 one): a GPU, or a CPU
    with AMX tiles or AVX-512 BF16 (oneDNN's bfloat16 products); an AVX2-only CPU only emulates them."""
    if device.type != "cpu":
        return device.type == "cuda"
    checks = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(check is not None and check() for check in checks)
