"""How many lm_head rows a proven bound leaves for greedy tokens, by the bits of the screen's weights.

    .venv/bin/python benchmarks/screen_bounds.py --target smollm2-135m --num-prompts 6 --tokens 40

The greedy screen (`cpu_backend.kernels.screen_argmax`) reads the lm_head in int8 with a scale per row and keeps
every row whose estimate plus |x| |w - s q| (Cauchy-Schwarz) reaches the largest estimate minus its own bound; only
those are summed in float32. Fewer bits would read fewer bytes, if the bound still left few rows. This takes the
final hidden states of our greedy continuations of MT-bench first turns and counts, for each position, the rows the
bound keeps with weights rounded to 8, 6, 5 or 4 bits a row (and 4 bits a group of 32, with a scale, or a scale and a
minimum), in float64 (x itself exact: the int8 screen's rounding of x adds a little more).
"""

from __future__ import annotations

import argparse
import json

import torch

from eagle import load_target


def rounded_rows(w: torch.Tensor, bits: int) -> torch.Tensor:
    k = 2 ** (bits - 1) - 1
    s = (w.abs().amax(1, keepdim=True) / k).clamp(min=1e-30)  # an all-zero row stays zero
    return (w / s).round().clamp(-k, k) * s


def rounded_groups(w: torch.Tensor, bits: int, with_min: bool, group: int = 32) -> torch.Tensor:
    g = w.reshape(w.shape[0], -1, group)
    if with_min:
        lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
        s = ((hi - lo) / (2 ** bits - 1)).clamp(min=1e-30)
        return (((g - lo) / s).round() * s + lo).reshape(w.shape)
    k = 2 ** (bits - 1) - 1
    s = (g.abs().amax(2, keepdim=True) / k).clamp(min=1e-30)
    return ((g / s).round().clamp(-k, k) * s).reshape(w.shape)


def kept_rows(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Rows whose upper bound reaches the largest lower bound, per position of x [n, in]."""
    c = (w - wq).norm(dim=1)
    a = x @ wq.T
    nx = x.norm(dim=1, keepdim=True)
    lower = (a - nx * c).max(1, keepdim=True).values
    return ((a + nx * c) >= lower).sum(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", default="../shared/evaldata/mt_bench.jsonl")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()
    target = load_target(args.target)
    model, tok = target.model, target.tokenizer
    rows = [json.loads(line) for line in open(args.data)][: args.num_prompts]
    states = []
    with torch.no_grad():
        for row in rows:
            ids = tok.apply_chat_template([{"role": "user", "content": row["turns"][0]}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                 do_sample=False)
            states.append(model(out, output_hidden_states=True).hidden_states[-1][0, ids.shape[1] - 1:])
    x = torch.cat(states).double()
    w = model.get_output_embeddings().weight.detach().double()
    print(f"{x.shape[0]} positions, {w.shape[0]} rows")
    print("| weights | bytes a weight | rows kept: mean | median | max |")
    print("|---|---|---|---|---|")
    for name, size, wq in [("int8, a scale a row (the screen)", 1.0, rounded_rows(w, 8)),
                           ("int6, a scale a row", 0.75, rounded_rows(w, 6)),
                           ("int5, a scale a row", 0.625, rounded_rows(w, 5)),
                           ("int4, a scale a row", 0.5, rounded_rows(w, 4)),
                           ("int4, a scale a group of 32", 0.5 + 2 / 32, rounded_groups(w, 4, False)),
                           ("int4, a scale and a minimum a group of 32", 0.5 + 4 / 32, rounded_groups(w, 4, True))]:
        k = kept_rows(x, w, wq).double()
        print(f"| {name} | {size:.3g} | {k.mean():.1f} | {k.median():.0f} | {k.max():.0f} |")


if __name__ == "__main__":
    main()
