"""llama.cpp, the CPU peer: built once from the source the `llama-cpp-python` sdist vendors, then run as programs.

    .venv/bin/python benchmarks/llamacpp.py            # build (cached) and print where the programs are

The sdist comes from the package index (`pip download --no-binary`), is unpacked under `$EAGLE_CACHE/llama.cpp/`
and built there with cmake, only the programs the benchmarks run. Build options: Release, `GGML_NATIVE=ON` (the
host's instruction set, AMX included where the CPU has it), no curl, static libraries. llama.cpp's AMX path needs
`--repack 0` on the machines seen so far (its repacked AMX matmul crashed on the first batch), so `run` passes it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
PROGRAMS = ("llama-bench", "llama-speculative-simple", "llama-completion", "llama-lookup")
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF")


class BuildError(RuntimeError):
    pass


def root() -> Path:
    return Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle")) / "llama.cpp" / VERSION


def source() -> Path:
    """The vendored llama.cpp folder, downloading and unpacking the sdist the first time."""
    src = root() / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    root().mkdir(parents=True, exist_ok=True)
    archive = root() / f"llama_cpp_python-{VERSION}.tar.gz"
    if not archive.exists():
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                              f"llama-cpp-python=={VERSION}", "-d", str(root())], capture_output=True, text=True)
        if got.returncode or not archive.exists():
            raise BuildError(f"could not download the llama-cpp-python {VERSION} sdist: {got.stderr.strip()[-300:]}")
    partial = root() / "unpacking"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(partial, filter="data")
    os.replace(partial / f"llama_cpp_python-{VERSION}", root() / f"llama_cpp_python-{VERSION}")
    shutil.rmtree(partial, ignore_errors=True)
    return src


def build(jobs: int | None = None) -> Path:
    """The folder holding the built programs; builds what is missing."""
    bin_dir = root() / "build" / "bin"
    if all((bin_dir / p).exists() for p in PROGRAMS):
        return bin_dir
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildError(f"building llama.cpp needs `{tool}` on PATH (e.g. apt install cmake g++)")
    src = source()
    build_dir = root() / "build"
    log = root() / "build.log"
    with open(log, "w") as out:
        steps = [["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_OPTIONS],
                 ["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 1), "--target", *PROGRAMS]]
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode:
                tail = log.read_text().strip().splitlines()[-5:]
                raise BuildError(f"building llama.cpp failed (log {log}):\n" + "\n".join(tail))
    return bin_dir


def run(program: str, *args: str, timeout: float = 1800) -> str:
    """A built program's stdout and stderr together; raises with its last lines on a non-zero exit."""
    got = subprocess.run([str(build() / program), *args], capture_output=True, text=True, timeout=timeout)
    if got.returncode:
        tail = (got.stdout + got.stderr).strip().splitlines()[-5:]
        raise BuildError(f"{program} exited {got.returncode}:\n" + "\n".join(tail))
    return got.stdout + got.stderr


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None)
    print(build(parser.parse_args().jobs))
