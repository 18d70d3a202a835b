"""The CPU backend's paths, for the tests that depend on one (the `kernel_path` fixture in conftest.py)."""

from __future__ import annotations

# A product on the CPU takes one of these paths (cpu_backend.kernels): "fma", the float32 path of the native build
# (AVX-512 or AVX2, whatever this CPU has); "avx2", the same path from a build for AVX2 alone (x86-64-v3), which an
# AVX-512 machine runs too; "vnni", GGUF codes multiplied by AVX512-VNNI byte products; "amx", Q4_1 codes on AMX
# tiles. A test that depends on the path takes the `kernel_path` fixture: it runs once per path, forced by the
# backend's switches, and a path this host cannot run is skipped with the reason. A switch set in the environment
# (EAGLE_NO_AMX=1, EAGLE_NO_VNNI=1) skips its path, so the suite can be run as on a machine without it.
KERNEL_PATHS = ("fma", "avx2", "vnni", "amx")


def kernel_path_missing(path: str) -> str | None:
    """Why this host cannot run `path`, or None."""
    import platform

    from cpu_backend import kernels, switches, toolchain

    if not kernels.available():
        return "the C kernel does not build here"
    if path == "avx2" and (platform.machine() not in ("x86_64", "AMD64")
                           or "avx2" not in toolchain.cpu_flags().split()):
        return "not an x86-64 CPU with AVX2"
    on = switches.current()
    if path == "vnni" and not (on.vnni and kernels.vnni_possible()):
        return "EAGLE_NO_VNNI=1" if not on.vnni else "no AVX512-VNNI byte products in the native build"
    if path == "amx" and not (on.amx and kernels.amx_possible()):
        return "EAGLE_NO_AMX=1" if not on.amx else "no AMX tiles here (CPU, compiler or OS)"
    return None


def force_switches(monkeypatch, **changes) -> None:
    """The backend's switches in force with `changes` (e.g. amx=False) for this test: chosen by code, so enabling
    the backend keeps them (`cpu_backend.switches.use`); the previous ones back after the test."""
    import dataclasses

    from cpu_backend import switches

    monkeypatch.setattr(switches, "_current", dataclasses.replace(switches.current(), **changes))
    monkeypatch.setattr(switches, "_chosen", True)
