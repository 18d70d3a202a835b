"""The backend's module classes: how `cpu_backend.enable` puts its own code into a model without touching its weights.

Each backend class is made for a stock class as a subclass of it (`PackedLinear` of `nn.Linear`, `FusedLayer` of
`LlamaDecoderLayer`, ...): `from_stock(module, plan)` gives the module that class (the same object, so its
parameters, their names and every reference to it stay as they were: a head's borrowed lm_head, an optimizer's
parameters, a state_dict) and its plan, one typed attribute (`cpu_plan`); `to_stock()` gives back the stock class and
drops the plan. The backend's forward runs the kernels where its plan says they apply and the stock class's forward
everywhere else (`stock_forward`). Printing a model shows which modules the backend runs:

    (self_attn): FusedAttention(LlamaAttention)(
      (q_proj): PackedLinear(Linear)(in_features=576, out_features=576, bias=False; kernel at 1-256 rows)

The kernels' copies of a weight (packed layouts, GGUF codes, screens) are not attributes of anything torch owns
either: `weight_layouts.layouts(weight)` keeps them beside the weight, for as long as it lives.
"""

from __future__ import annotations

import copy
import inspect
import types
from typing import ClassVar

from torch import nn


class BackendModule(nn.Module):
    """Base of the backend's module classes. Subclasses define `forward` (with `stock_forward` as the way out) and
    a `cpu_plan` dataclass; `of(stock_class)` makes (once) the class that runs them on a stock class's modules."""

    stock: ClassVar[type]  # the stock class the made class derives from
    _made: ClassVar[dict] = {}

    @classmethod
    def of(cls, stock: type) -> type:
        """The class `cls` made for modules of class `stock` (`stock` itself when it already is one of cls's)."""
        if issubclass(stock, BackendModule):
            stock = stock.stock
        made = BackendModule._made.get((cls, stock))
        if made is None:
            # named cls's name, but with the stock class's module and qualified name, so `str(type(module))` stays
            # the stock one: transformers keys what a model's forward records (`output_hidden_states`: its
            # `_CAN_RECORD_REGISTRY`) by that string, and the stock forward must keep finding it
            names = {"stock": stock, "__module__": stock.__module__, "__qualname__": stock.__qualname__}
            if "forward" in cls.__dict__:  # a class that runs its own forward (DraftingHead keeps the stock one)
                names["forward"] = _with_signature(cls.forward, stock.forward)
            made = BackendModule._made[(cls, stock)] = type(cls.__name__, (cls, stock), names)
        return made

    @classmethod
    def from_stock(cls, module: nn.Module, plan) -> nn.Module:
        """`module` (this object) as a module of this backend class with `plan`; a backend module of another class
        goes back to its stock class first."""
        if isinstance(module, BackendModule) and not isinstance(module, cls):
            module.to_stock()
        module.__class__ = cls.of(type(module))
        module.cpu_plan = plan
        return module

    def to_stock(self) -> nn.Module:
        """This module (the same object) with its stock class again and no plan."""
        self.__dict__.pop("cpu_plan", None)
        self.__class__ = self.stock
        return self

    def __deepcopy__(self, memo) -> nn.Module:
        """A copy of this backend module, of the same class (an enabled model's copy stays enabled: train's feature
        pass makes a bfloat16 one); its plan copied as its fields define (StackPlan drops its C tables)."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __copy__(self) -> nn.Module:
        """A shallow copy of the same class (pickling, below, gives the stock one)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __reduce_ex__(self, protocol):
        """Pickled (`torch.save` of a whole model) as its stock module, without the plan: the backend's classes are
        this process's arrangement of the model (`cpu_backend.enable` makes it again after loading), and theirs are
        not names pickle can find."""
        state = {k: v for k, v in self.__getstate__().items() if k != "cpu_plan"}
        return object.__new__, (self.stock,), state

    def stock_forward(self, *args, **kwargs):
        return self.stock.forward(self, *args, **kwargs)

    def _get_name(self) -> str:
        return f"{type(self).__name__}({self.stock.__name__})"

    def extra_repr(self) -> str:
        stock, mine = self.stock.extra_repr(self), self.plan_repr()
        return f"{stock}; {mine}" if stock and mine else stock or mine

    def plan_repr(self) -> str:
        return ""


def _with_signature(fn, stock_fn):
    """`fn` (the same code, no extra call) reporting `stock_fn`'s signature: callers inspect a forward's parameters
    to choose their keywords (`cache` or `past_key_values`, ...), and the backend's forward takes what the stock one
    takes."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__doc__ = fn.__kwdefaults__, fn.__doc__
    try:
        copy.__signature__ = inspect.signature(stock_fn)
    except (TypeError, ValueError):
        pass
    return copy


def backend_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, BackendModule)]


def row_spans(flags: list) -> str:
    """"1-16, 64" for the row counts (1 ..) where flags[rows] holds."""
    spans, start = [], None
    for rows in range(1, len(flags) + 1):
        on = rows < len(flags) and bool(flags[rows])
        if on and start is None:
            start = rows
        elif not on and start is not None:
            spans.append(f"{start}" if start == rows - 1 else f"{start}-{rows - 1}")
            start = None
    return ", ".join(spans) or "none"
