"""The CPU kernels' build step: their C (`csrc/`) compiled once per machine and source with the system C compiler into
`$EAGLE_CACHE/kernels/`, a folder only its owner may write, the library's sha256 recorded beside it. The binding
(`kernels.load`: the functions' signatures, in one place) and the calls are `cpu_backend.kernels`'.

    compile_library(library_path())    # kernels.c and the parts it includes, `FLAGS`, whole or not at all
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from eagle.target import cache_root

CSRC = Path(__file__).resolve().parent / "csrc"  # the C: kernels.c and the parts it includes

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra"]


class KernelError(OSError):
    """The kernel could not be built or loaded here; the message says why in one line (the compiler's own error
    follows on the next lines)."""


def sources() -> dict[str, bytes]:
    """The kernels' C files (CSRC: kernels.c, the parts it includes and their headers) by name, in name order; none
    where the folder is missing (then `compile_library` says so)."""
    try:
        return {f.name: f.read_bytes() for f in sorted(CSRC.iterdir()) if f.suffix in (".c", ".h")}
    except FileNotFoundError:
        return {}


def library_key() -> str:
    """Names this kernel build: its C files (each name and its bytes), flags and CPU (a change to any of them builds,
    and plans, anew)."""
    key = hashlib.sha1()
    for name, data in sources().items():
        key.update(f"{name}|{len(data)}|".encode())
        key.update(data)
    key.update("|".join([*FLAGS, platform.machine(), cpu_flags()]).encode())
    return key.hexdigest()[:12]


def library_path() -> Path:
    return cache_root() / "kernels" / f"rows_linear-{library_key()}.so"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def private_dir(path: Path) -> Path:
    """`path`, made if missing (mode 700), refused unless it is this user's and no one else may write to it: a
    compiled library is only loaded from such a folder."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        whose = "not yours" if st.st_uid != os.getuid() else "writable by others"
        raise KernelError(f"kernel folder {str(path)!r} is {whose} (mode {st.st_mode & 0o777:o}); chmod 700 it or set "
                          "EAGLE_CACHE to a folder of your own")
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compile_library(path: Path, source: str | None = None) -> None:
    """Compile the kernels' C (`sources`: kernels.c and what it includes), or `source`, one whole C text (another
    version of it, a benchmark's), into `path`, whole or not at all (the files copied into a temporary directory and
    compiled there, then a rename), with its sha256 recorded beside it (`path` + ".sha256"), which `kernels.load`
    checks."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelError("the CPU kernel needs a C compiler: none (cc / gcc, or $CC) is on PATH")
    main = "kernels.c" if source is None else "rows_linear.c"
    files = sources() if source is None else {main: source.encode()}
    if main not in files:
        raise KernelError(f"the CPU kernel's C is missing: no {str(CSRC / main)!r}")
    private_dir(path.parent)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        src, lib = Path(tmp) / main, Path(tmp) / "rows_linear.so"
        try:
            done = subprocess.run([cc, *FLAGS, str(src), "-o", str(lib), "-lm"], capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelError(f"the CPU kernel did not build: {cc} could not run ({e})") from None
        if done.returncode != 0:
            errors = "\n".join(done.stderr.strip().splitlines()[:30])
            raise KernelError(f"the CPU kernel did not build ({cc} exited {done.returncode}):\n{errors}")
        recorded = Path(tmp) / "rows_linear.so.sha256"
        recorded.write_text(digest(lib) + "\n")
        os.replace(lib, path)  # a library without its digest beside it is built again, never loaded
        os.replace(recorded, path.with_name(path.name + ".sha256"))
