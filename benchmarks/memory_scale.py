"""Memory and disk at real widths, measured against `eagle plan`'s arithmetic (issue 61's checks), on random Llamas
of a 3B model's width (hidden 3,072, 24 heads, 8 key-value heads, MLP 8,192, SmolLM2's tokenizer and vocabulary of
49,152, bfloat16 weights), 1 and 8 layers:

1. prep with one-turn regeneration (48 new tokens) of 30 and of 240 ShareGPT rows: peak RSS of each
   (`/usr/bin/time -f %M`), the features' bytes on the disk and their dtype. The growth from 30 to 240 rows must stay
   under 25 % of the 240-row run's feature bytes (features stream to the disk as they are made). The rows are
   ordered longest prompt first (`make_data`), so both runs start with the batches that set the peak: a random
   sample of 240 rows holds longer prompts than one of 30, which is the batch's memory, not the data's.
2. `eagle plan` for the 240-row run: its feature bytes and peak host memory against the measured ones (within 25 %).
3. training 3 steps on cached features (eval.num_prompts=0) beside the 1-layer and the 8-layer target: the peak RSS
   of the two may differ by less than 15 % of the 7 extra layers' bytes (only embedding, final norm and lm_head are
   loaded), and `eagle plan`'s training figure against the measured one.

    python benchmarks/memory_scale.py --work runs/memory_scale          # ~15 minutes on 2 cores
Prints one JSON line; BENCHMARKS.md keeps the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle.memory import TargetSize  # noqa: E402 (after the checkout is on the path)
from eagle.target import target_config  # noqa: E402

WIDTH = dict(hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
             max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True)


def make_target(folder: Path, layers: int) -> Path:
    """A random Llama of the 3B width with SmolLM2's tokenizer, saved in bfloat16 (made once)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = target_config("smollm2-135m")
    cfg = LlamaConfig(vocab_size=len(tok), num_hidden_layers=layers, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **WIDTH)
    torch.manual_seed(layers)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_data(path: Path, tokenizer, rows: int, max_prompt: int) -> Path:
    """`rows` ShareGPT conversations prep keeps (first prompt at most `max_prompt` tokens), longest prompt first:
    regeneration runs the longest batches first, so a prefix of the file of 30 rows and the whole file start with the
    same batches, those that set the peak (prefill, KV cache, feature buffers), and differ in how many shorter rows
    follow: the memory those add is what grows with the data."""
    import importlib

    from data_prep.sources import load_conversations

    regenerate = importlib.import_module("data_prep.regenerate")
    convs, _ = load_conversations("sharegpt", max_rows=rows * 2, allow_no_assistant=True)
    seen, kept = set(), []
    for msgs in convs:
        head, users = regenerate.user_turns(msgs)
        if not users:
            continue
        try:
            ids = regenerate.prompt_ids(tokenizer, head + users[:1], max_prompt)
        except regenerate.SkipRow:
            continue
        if tuple(ids) not in seen:
            seen.add(tuple(ids))
            kept.append((len(ids), head + users[:1]))
    kept = sorted(kept[:rows], key=lambda k: -k[0])
    path.write_text("".join(json.dumps({"messages": msgs}) + "\n" for _, msgs in kept))
    return path


def timed(argv: list[str], log: Path) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of a command, its output in `log`."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M", *argv], stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t0
    text = log.read_text()
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}); see {log}:\n{text[-2000:]}")
    kb = int(next(line for line in reversed(text.splitlines()) if line.startswith("MAXRSS")).split()[1])
    return kb * 1024, seconds


def eagle(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "eagle_cli.py"), *map(str, args)]


def feature_bytes(out: Path) -> tuple[int, str]:
    """(bytes of the features regeneration wrote, their dtype): the `features` tensors of the journal's shards."""
    total, dtype = 0, ""
    for f in sorted((out / "regenerated").glob("shard-*.safetensors")):
        with open(f, "rb") as h:
            header = json.loads(h.read(int.from_bytes(h.read(8), "little")))
        start, end = header["features"]["data_offsets"]
        total, dtype = total + end - start, header["features"]["dtype"]
    return total, dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/memory_scale")
    ap.add_argument("--rows", default="30,240")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="regeneration batch size")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="training batch (optim.batch_tokens)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    small, large = (int(r) for r in args.rows.split(","))
    one, eight = make_target(work / "llama-1", 1), make_target(work / "llama-8", 8)
    _, tok = target_config(str(one))
    data = make_data(work / f"data-{args.max_length}.jsonl", tok, large, args.max_length - args.max_new_tokens)
    prep_args = ["--data", data, "--regenerate", "--max-turns", "1", "--max-new-tokens", args.max_new_tokens,
                 "--max-length", args.max_length, "--regen-batch-size", args.batch, "--dtype", "bfloat16",
                 "--device", "cpu", "--overwrite"]
    result: dict = {"width": WIDTH, "max_new_tokens": args.max_new_tokens, "max_length": args.max_length,
                    "batch": args.batch}

    # 1. prep at two data sizes
    prep = {}
    for rows in (small, large):
        out = work / f"prep-{rows}"
        rss, seconds = timed(eagle("prep", "--target", one, "--out", out, "--max-rows", rows, *prep_args),
                             work / f"prep-{rows}.log")
        nbytes, dtype = feature_bytes(out)
        prep[rows] = {"peak_rss": rss, "feature_bytes": nbytes, "feature_dtype": dtype, "seconds": round(seconds, 1)}
    growth = prep[large]["peak_rss"] - prep[small]["peak_rss"]
    result["prep"] = prep
    result["prep_growth_share_of_features"] = round(growth / prep[large]["feature_bytes"], 3)

    # 2. the plan of the large run
    done = subprocess.run(eagle("plan", "--target", one, "--data", data, "--max-rows", large,
                                "--max-new-tokens", args.max_new_tokens, "--max-turns", 1, "--max-length",
                                args.max_length, "--regen-batch-size", args.batch, "--dtype", "bfloat16", "--json"),
                          capture_output=True, text=True, check=True)
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    result["plan"] = {k: plan[k] for k in ("feature_disk_bytes", "prep_peak_host_bytes", "prep_parts")}
    result["plan_vs_measured"] = {
        "feature_bytes": round(plan["feature_disk_bytes"] / prep[large]["feature_bytes"], 3),
        "prep_peak": round(plan["prep_peak_host_bytes"] / prep[large]["peak_rss"], 3)}

    # 3. training on cached features beside a 1-layer and an 8-layer target of the same width (each on rows it
    #    prepared itself, so every feature is cached), then the plan of that training run
    train = {}
    for target, name in ((one, "1-layer"), (eight, "8-layer")):
        prepared = work / f"prep-{small}" if target == one else work / f"prep8-{small}"
        if target == eight:
            timed(eagle("prep", "--target", eight, "--out", prepared, "--max-rows", small, *prep_args),
                  work / "prep8.log")
        run = work / f"train-{name}"
        shutil.rmtree(run, ignore_errors=True)
        rss, seconds = timed(eagle("train", f"model.target={target}", f"data.prepared={prepared}", f"run_dir={run}",
                                   f"out={run}/head", "budget.max_steps=3", "eval.num_prompts=0",
                                   "eval.every_minutes=0", f"optim.batch_tokens={args.batch_tokens}",
                                   f"data.max_length={args.max_length}",
                                   "model.dtype=bfloat16", "tensorboard=false", "device=cpu"),
                             work / f"train-{name}.log")
        train[name] = {"peak_rss": rss, "seconds": round(seconds, 1)}
    s1, s8 = (TargetSize.of(target_config(str(t))[0]) for t in (one, eight))
    layer_bytes = (s8.params - s1.params) * 2  # bfloat16
    result["train"] = train
    result["seven_layers_bytes"] = layer_bytes
    result["train_difference_share_of_layers"] = round(
        (train["8-layer"]["peak_rss"] - train["1-layer"]["peak_rss"]) / layer_bytes, 3)
    done = subprocess.run(eagle("plan", "--target", one, "--data", data, "--max-rows", small,
                                "--max-new-tokens", args.max_new_tokens, "--max-length", args.max_length,
                                "--dtype", "bfloat16", "--batch-tokens", args.batch_tokens, "--num-prompts", 0,
                                "--json"),
                          capture_output=True, text=True, check=True)
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    result["plan_train"] = {k: plan[k] for k in ("train_peak_device_bytes", "train_parts")}
    result["plan_vs_measured"]["train_peak"] = round(plan["train_peak_device_bytes"] / train["1-layer"]["peak_rss"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
