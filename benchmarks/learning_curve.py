"""Acceptance per training minute: a recipe trained at several budgets, each head decoded on MT-bench prompts.

    .venv/bin/python benchmarks/learning_curve.py --data runs/demo/data --budgets 5 15 45 90 \
        --recipe today=configs/smollm2-135m-eagle1.yaml \
        --recipe eagle3=configs/smollm2-135m-eagle3.yaml

A recipe is NAME=CONFIG[,KEY=VALUE,...] (overrides as `eagle train` takes them). Every budget is a separate run
(`budget.minutes` sets the learning-rate schedule's length, so a 15-minute head is not the 5-minute one trained
longer), in `--out/NAME/BUDGET/`; a finished run is reused, so the script resumes where it stopped and new recipes
or budgets can be added later. Each head is decoded on `--num-prompts` MT-bench prompts spread over the file
(greedy, `--max-new-tokens`): a chain of 3 (tau and per-position acceptance) and the dynamic tree `--dynamic`
(tau), beside the simulated tau of its last validation (every held-out row, `train.validate.validate`). The data's
preparation minutes (regeneration included) are read from the summary.json of `--data` and of every `data.extra`
folder a recipe adds, plus the minutes training spent computing features prep did not leave, and shown beside the
training minutes.

Prints a Markdown table, writes `--out/curve.json` and `--out/curve.png` (tau against training minutes, one line per
recipe), and prints the JSON as its last line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from eagle.configio import load_config
from infer import DecodeConfig
from infer.evaluate import EvalConfig, evaluate
from train.config import TrainConfig
from train.loop import train

MT_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "evaldata" / "mt_bench.jsonl"


def parse_recipe(spec: str) -> tuple[str, str, list[str]]:
    name, _, rest = spec.partition("=")
    config, *overrides = rest.split(",")
    if not name or not config:
        raise SystemExit(f"--recipe {spec!r}: expected NAME=CONFIG[,KEY=VALUE,...]")
    return name, config, overrides


def prep_minutes(data: Path) -> float | None:
    """The minutes `eagle prep` took (its summary.json), regeneration included."""
    f = data / "summary.json"
    return json.loads(f.read_text()).get("seconds", 0) / 60 if f.exists() else None


def train_at(name: str, config: str, overrides: list[str], minutes: float, data: str, root: Path) -> dict:
    run = root / name / f"{minutes:g}"
    cfg = load_config(TrainConfig, config, [f"data.prepared={data}", f"run_dir={run / 'train'}",
                                            f"out={run / 'head'}", f"budget.minutes={minutes}", *overrides])
    t0 = time.perf_counter()
    state = train(cfg)
    prep = [prep_minutes(Path(d)) for d in [cfg.data.prepared, *cfg.data.extra]]
    # the feature pass training made for rows prep left without features (raw rows) counts as preparation
    return {"head": str(run / "head"), "prep_min": sum(m or 0.0 for m in prep) + state.feature_s / 60,
            "train_min": state.train_s / 60, "steps": state.step,
            "tokens": state.tokens, "sim_tau": state.best_tau, "wall_min": (time.perf_counter() - t0) / 60}


def decode(head: str, args, **settings) -> dict:
    cfg = EvalConfig(draft=head, data=str(MT_BENCH), num_prompts=args.num_prompts, spread=True,
                     out=str(Path(head).parent / f"eval-{settings.get('mode', 'chain')}"),
                     decode=DecodeConfig(max_new_tokens=args.max_new_tokens, **settings))
    r = evaluate(cfg)
    return {"tau": r["tau"], "acceptance_per_position": r["acceptance_per_position"], "speedup": r["speedup"],
            "lossless": r["lossless"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", action="append", required=True, help="NAME=CONFIG[,KEY=VALUE,...]")
    ap.add_argument("--budgets", type=float, nargs="+", default=[5, 15, 45, 90])
    ap.add_argument("--data", default="runs/demo/data")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dynamic", default="4:3:8", help="TOP_K:DEPTH:TOTAL of the dynamic tree")
    ap.add_argument("--out", default="runs/curves")
    args = ap.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    store = root / "curve.json"
    results = json.loads(store.read_text()) if store.exists() else {}
    top_k, depth, total = (int(x) for x in args.dynamic.split(":"))
    for spec in args.recipe:
        name, config, overrides = parse_recipe(spec)
        for minutes in args.budgets:
            key = f"{name}@{minutes:g}"
            if key in results:
                continue
            row = {"recipe": name, "config": config, "overrides": overrides, "budget_min": minutes,
                   **train_at(name, config, overrides, minutes, args.data, root)}
            row["chain3"] = decode(row["head"], args, mode="chain", num_speculative_tokens=3)
            row["dynamic"] = decode(row["head"], args, mode="dynamic", top_k=top_k, depth=depth,
                                    total_tokens=total)
            results[key] = row
            store.write_text(json.dumps(results, indent=1))  # after every run: a kill loses one run at most
    prep = prep_minutes(Path(args.data))
    print(f"data: {args.data}" + (f" (prepared in {prep:.1f} min)" if prep else ""))
    print("| recipe | prep + train min | steps | simulated tau | tau chain 3 | acceptance 1 / 2 / 3 | tau dynamic "
          f"{args.dynamic} | dynamic / chain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(results.values(), key=lambda r: (r["recipe"], r["budget_min"])):
        c, d = r["chain3"], r["dynamic"]
        data_min = r.get("prep_min", prep or 0.0)
        print(f"| {r['recipe']} | {data_min:.0f} + {r['budget_min']:g} | {r['steps']} | {r['sim_tau']:.2f} | "
              f"{c['tau']:.2f} | "
              + " / ".join(f"{a:.2f}" for a in c["acceptance_per_position"])
              + f" | {d['tau']:.2f} | {d['tau'] / c['tau']:.2f}x |")
    plot(results, root / "curve.png")
    print(json.dumps(results))


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    names = sorted({r["recipe"] for r in results.values()})
    colors = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    for i, name in enumerate(names):  # one colour a recipe: the chain solid, the dynamic tree dashed
        rows = sorted((r for r in results.values() if r["recipe"] == name), key=lambda r: r["budget_min"])
        x = [r["budget_min"] for r in rows]
        ax.plot(x, [r["chain3"]["tau"] for r in rows], "o-", color=colors(i), label=name)
        ax.plot(x, [r["dynamic"]["tau"] for r in rows], "s--", color=colors(i), alpha=0.6)
    ax.set_xlabel("training minutes")
    ax.set_ylabel("tau (20 MT-bench prompts)")
    ax.set_title("chain of 3 (solid), dynamic tree (dashed)", fontsize=9)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
