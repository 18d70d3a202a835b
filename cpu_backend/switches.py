"""The CPU backend's switches: which of its code paths may run, in one object.

They come from the environment, read when the backend is enabled (`cpu_backend.enable`, and on first use before
that), not when the package is imported; code may choose them instead (`use`), and then the environment is not
read again until `use(None)`:

    | switch               | environment              | default | what it turns on                                  |
    | kernel               | EAGLE_NO_KERNEL=1: off   | on      | the C kernels at all (off: stock torch ops; read |
    |                      |                          |         | when the library is first loaded)                |
    | require_kernel       | EAGLE_REQUIRE_KERNEL=1   | off     | a kernel that cannot be built is an error        |
    | q4_1                 | EAGLE_NO_Q4=1: off       | on      | GGUF-form weights read as their codes            |
    | amx                  | EAGLE_NO_AMX=1: off      | on      | codes (and drafts) on AMX tiles where the CPU has |
    | vnni                 | EAGLE_NO_VNNI=1: off     | on      | codes by AVX512-VNNI byte products without AMX   |
    | int8_drafts          | EAGLE_BF16_DRAFTS=1: off | on      | a head's weights in int8 while drafting (off:    |
    |                      |                          |         | bfloat16 on AMX tiles)                           |
    | low_precision_drafts |                          | on      | a head's weights in low precision at all         |
    | screen_tile_rows     |                          | 5       | greedy screens of fewer rows read the VNNI pairs |
    |                      |                          |         | copy on AMX machines                             |
    | recalibrate          | EAGLE_RECALIBRATE=1      | off     | timing plans measured again, not read from cache |

Where the CPU or the build lacks a path (AMX, VNNI) its switch on changes nothing; `kernels.amx_on` and
`kernels.vnni_on` say what runs. Every switch but `require_kernel` and `recalibrate` can change which code computes
a product, so timing plans are cached per setting of them (`kernels.path_key`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Switches:
    kernel: bool = True
    require_kernel: bool = False
    q4_1: bool = True
    amx: bool = True
    vnni: bool = True
    int8_drafts: bool = True
    low_precision_drafts: bool = True
    screen_tile_rows: int = 5
    recalibrate: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Switches":
        """The switches the environment (`env`, else os.environ) sets: a variable set to anything but "" is on
        (EAGLE_NO_AMX=0 too, as always)."""
        env = os.environ if env is None else env

        def set_(name: str) -> bool:
            return bool(env.get(name))

        return cls(kernel=not set_("EAGLE_NO_KERNEL"), require_kernel=set_("EAGLE_REQUIRE_KERNEL"),
                   q4_1=not set_("EAGLE_NO_Q4"), amx=not set_("EAGLE_NO_AMX"), vnni=not set_("EAGLE_NO_VNNI"),
                   int8_drafts=not set_("EAGLE_BF16_DRAFTS"), recalibrate=set_("EAGLE_RECALIBRATE"))

    def product_key(self) -> str:
        """The settings that can change which code computes a product, as text (`kernels.path_key`)."""
        skip = ("require_kernel", "recalibrate")
        return "|".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name not in skip)


_current: Switches | None = None  # in force
_chosen = False  # put in force by code (`use`), not read from the environment


def current() -> Switches:
    """The switches in force (read from the environment on first use)."""
    return _current if _current is not None else refresh()


def refresh() -> Switches:
    """The environment read again into the switches in force, unless code chose them (`use`); returns them."""
    global _current
    if _current is None or not _chosen:
        _current = Switches.from_env()
    return _current


def use(switches: Switches | None) -> None:
    """Put `switches` in force until `use` is called again; None: the environment's again (read now)."""
    global _current, _chosen
    _current, _chosen = switches, switches is not None
    if switches is None:
        refresh()
