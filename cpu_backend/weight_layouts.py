"""The kernels' copies of a weight, kept beside it rather than on it: one `WeightLayouts` per weight tensor, for as long
as the tensor lives (`layouts(weight)`), holding the layouts the kernels made from it (`kernels.kept`), its marks
(drafts in low precision, read by the greedy screen) and the GGUF K-quant codes read for it (`gguf_codes.attach`).
Nothing is set on the tensor itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


def version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter; -1 for an inference-mode tensor, which has none (it cannot change
    outside that mode)."""
    try:
        return t._version
    except RuntimeError:
        return -1


@dataclass(eq=False)
class WeightLayouts:
    """What the kernels keep for one weight tensor, beside it rather than on it: the layouts made from it (`made`:
    name -> (the weight's version, address and settings they were made for, the layout)), whether the head's drafts
    read it in low precision (`draft_precision`), whether the greedy screen reads it (`screen_tables`: its products
    then keep the float32 path's bits), and the GGUF K-quant codes read for it (`gguf_codes.attach`)."""

    made: dict[str, tuple] = field(default_factory=dict)
    draft: bool = False
    screened: bool = False
    kquant: tuple | None = None

    def nbytes(self) -> int:
        """Bytes of the tensors kept here."""
        return sum(t.numel() * t.element_size() for _, v in self.made.values()
                   for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor))


# weight id -> (a weak reference to the weight, its WeightLayouts): an entry lives as long as its weight, and a
# decoding step's ~100 lookups cost a dictionary read each (tensors compare by value, so they cannot be keys)
_table: dict[int, tuple[weakref.ref, WeightLayouts]] = {}


def layouts(weight: torch.Tensor, make: bool = True) -> WeightLayouts | None:
    """The kernels' WeightLayouts of `weight` (made empty on first use with `make`, else None where there is none)."""
    key = id(weight)
    hit = _table.get(key)
    if hit is not None and hit[0]() is weight:
        return hit[1]
    if not make:
        return None

    def forget(ref, key=key):
        if _table.get(key, (None,))[0] is ref:
            del _table[key]

    entry = WeightLayouts()
    _table[key] = (weakref.ref(weight, forget), entry)
    return entry
