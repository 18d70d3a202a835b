"""What `cpu_backend.enable` does to a model, checked: the backend's own module classes, nothing hung on torch's.

    .venv/bin/python benchmarks/backend_modules.py [--target smollm2-135m] [--head HEAD] [--routes]

Loads the target, records its module types, state_dict keys and the logits of a prompt, then calls
`cpu_backend.enable(model, gguf=...)` (and with `--head`, enables an attached EAGLE head with `drafts=True`) and
checks that no module has an instance-level `forward`, no parameter or buffer carries an attribute it did not
have before, every parameter is the same object under the same name, the backend's classes are in the model
(counted by class) and the logits stay close; then `cpu_backend.disable` gives back every stock class, no `cpu_plan` left, and the stock logits bit
for bit. Prints one line per check and, last, one JSON object; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_backend  # noqa: E402
from cpu_backend.modules import BackendModule  # noqa: E402
from eagle import EagleHead, load_target  # noqa: E402

PROMPT = "Explain in two sentences why the sky is blue."


def snapshot(model: torch.nn.Module) -> dict:
    """Module classes by name, parameter objects by name."""
    return {"types": {name: type(m) for name, m in model.named_modules()},
            "params": dict(model.named_parameters(remove_duplicate=False)), "keys": list(model.state_dict())}


def instance_forwards(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def tensor_attributes(model: torch.nn.Module) -> dict[str, list[str]]:
    """The attributes in each parameter's and buffer's own `__dict__` (transformers marks some buffers itself:
    `_is_buffer`, `persistent`; the checks compare with what the model had before the backend)."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: sorted(t.__dict__) for name, t in tensors}


def check(target_name: str = "smollm2-135m", head_dir: str | None = None, routes: bool = False) -> dict:
    """Run the checks; returns {check: bool, ..., "backend_modules": {class: count}, "max_logit_diff": float}. With
    `routes`, prints what runs where in the enabled models (`cpu_backend.routes`) after their first pass."""
    target = load_target(target_name)
    model = target.model
    ids = torch.tensor([target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                             add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)])
    head = EagleHead.from_pretrained(head_dir).attach(target) if head_dir else None
    with torch.no_grad():
        stock_logits = model(ids).logits
    before = snapshot(model)
    models = [model] + ([head] if head is not None else [])
    attributes = [tensor_attributes(m) for m in models]
    cpu_backend.enable(model, gguf=target.source)
    if head is not None:
        cpu_backend.enable(head, drafts=True)
    with torch.no_grad():
        fast_logits = model(ids).logits
    during = snapshot(model)
    if routes:
        for m in models:
            print(cpu_backend.Route.table(cpu_backend.routes(m)))
    kinds = Counter(f"{type(m).__name__}({m.stock.__name__})" for mod in models for m in mod.modules()
                    if isinstance(m, BackendModule))
    result = {
        "no_instance_forward": not any(instance_forwards(m) for m in models),
        "no_tensor_attributes": [tensor_attributes(m) for m in models] == attributes,
        "same_parameters": during["keys"] == before["keys"] and all(
            during["params"][k] is p for k, p in before["params"].items()),
        "backend_modules_present": bool(kinds),
        "logits_close": bool(torch.allclose(fast_logits, stock_logits, rtol=1e-3, atol=1e-3)),
        "max_logit_diff": float((fast_logits - stock_logits).abs().max()),
        "same_greedy_tokens": bool(torch.equal(fast_logits.argmax(-1), stock_logits.argmax(-1))),
        "backend_modules": dict(sorted(kinds.items())),
    }
    if head is not None:
        cpu_backend.disable(head)
    cpu_backend.disable(model)
    with torch.no_grad():
        after_logits = model(ids).logits
    after = snapshot(model)
    result["stock_types_back"] = after["types"] == before["types"] and not any(
        "cpu_plan" in m.__dict__ for mod in models for m in mod.modules())
    result["stock_logits_bitwise"] = bool(torch.equal(after_logits, stock_logits))
    result["no_tensor_attributes_after"] = [tensor_attributes(m) for m in models] == attributes
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head", help="an EAGLE head directory to enable beside the target")
    ap.add_argument("--routes", action="store_true", help="print what runs where (`cpu_backend.routes`) first")
    args = ap.parse_args()
    result = check(args.target, args.head, args.routes)
    failed = [k for k, v in result.items() if v is False]
    for k, v in result.items():
        print(f"{k}: {v}")
    print(json.dumps(result))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
