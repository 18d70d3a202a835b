"""Caches that cannot be swapped under you: the compiled kernel is loaded only from a folder of the user's own and
only if its bytes are the ones recorded when it was built; a build that fails says why once; cached features are
keyed by the target's weights, not only its tokenizer."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_target

from eagle.features import features_dir

ROOT = Path(__file__).resolve().parents[1]
PROBE = "from cpu_backend import kernels; print('available', kernels.available())"


def _probe(cache: Path, **env) -> subprocess.CompletedProcess:
    """A fresh process asking for the kernel with EAGLE_CACHE=cache."""
    full = {k: v for k, v in os.environ.items() if k != "EAGLE_REQUIRE_KERNEL"}
    full.update(EAGLE_CACHE=str(cache), **env)
    return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=300)


def test_a_kernel_is_loaded_only_as_built_and_only_from_a_private_folder(tmp_path):
    from cpu_backend import kernels, toolchain

    if not kernels.available():
        pytest.skip("the C kernel does not build here")
    first = _probe(tmp_path)
    assert "available True" in first.stdout, first.stderr
    folder = tmp_path / "kernels"
    (lib,) = folder.glob("rows_linear-*.so")
    assert (folder / (lib.name + ".sha256")).read_text().strip() == toolchain.digest(lib)
    assert folder.stat().st_mode & 0o777 == 0o700
    with pytest.raises(kernels.KernelError, match="does not match the sha256"):
        lib.write_bytes(lib.read_bytes() + b"\0")  # changed after it was built
        kernels.load(lib)
    again = _probe(tmp_path)
    assert "available True" in again.stdout and "does not match" in again.stderr and "building it again" in again.stderr
    folder.chmod(0o777)
    try:
        shared = _probe(tmp_path)
        assert "available False" in shared.stdout and "writable by others" in shared.stderr
        required = _probe(tmp_path, EAGLE_REQUIRE_KERNEL="1")
        assert required.returncode != 0 and "KernelError" in required.stderr and "writable by others" in required.stderr
    finally:
        folder.chmod(0o700)


def test_a_kernel_that_fails_to_build_prints_the_compilers_error_once(tmp_path):
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'rows_linear.c:1:1: error: this compiler is broken' >&2\nexit 1\n")
    cc.chmod(0o755)
    quiet = _probe(tmp_path / "cache", CC=str(cc))
    assert "available False" in quiet.stdout
    assert quiet.stderr.count("error: this compiler is broken") == 1
    assert "the CPU kernel did not build" in quiet.stderr and "stock torch ops run" in quiet.stderr
    required = _probe(tmp_path / "cache", CC=str(cc), EAGLE_REQUIRE_KERNEL="1")
    assert required.returncode != 0 and "KernelError: the CPU kernel did not build" in required.stderr


def test_cached_features_are_keyed_by_the_targets_weights():
    base, same = tiny_target(dtype=torch.float32), tiny_target(dtype=torch.float32)
    tuned = tiny_target(dtype=torch.float32)
    with torch.no_grad():  # a fine-tune of the same base: the same tokenizer and sizes, other weights
        tuned.model.model.layers[1].mlp.up_proj.weight.add_(1e-3)
    assert base.fingerprint == tuned.fingerprint
    assert features_dir("d", "train", base) == features_dir("d", "train", same)
    assert features_dir("d", "train", base) != features_dir("d", "train", tuned)
