"""Training throughput and the training-time test's memory, on the device at hand, offline, from the checkout alone.

    python benchmarks/train_throughput.py                               # this CPU: SmolLM2's width
    python benchmarks/train_throughput.py --device cuda --width 4096    # a GPU: an 8B target's width

1. Throughput: `eagle train` on synthetic prepared rows with cached features (random ids and features of a random
   Llama of the chosen width, 2 layers, loaded without them as training on cached features does), for the EAGLE-1
   preset, the EAGLE-3 preset (its sparse training-time test) and EAGLE-3 dense (`loss.unroll_fraction=1`), each with
   every `--workers` count of data-loader processes: training tokens/s and the share of the time spent waiting for
   batches (the logs' `tok_s` and `data_wait`, the first logging interval left out).
2. The dense test's memory: an EAGLE-3 head of that width (draft vocabulary `--draft-vocab`) unrolled `--steps-ttt`
   steps over every position of one batch of 2k / 4k / 8k tokens (`--ttt-tokens`), forward and backward (bf16
   autocast on CUDA), each in a process of its own: the peak device
   memory above what the process held before the step (CUDA: `max_memory_allocated`; CPU: the peak RSS, reset first
   through /proc/self/clear_refs).
Prints one JSON line (the device and its name, every run's figures); BENCHMARKS.md keeps the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTHS = {  # hidden -> (heads, key-value heads, MLP, vocabulary): SmolLM2-135M's and Llama-3.1-8B's shapes
    576: (9, 3, 1536, 49152),
    2048: (32, 8, 8192, 128256),
    4096: (32, 8, 14336, 128256),
}
RECIPES = {  # name -> (preset, overrides)
    "eagle1": ("configs/smollm2-135m-eagle1.yaml", []),
    "eagle3-sparse": ("configs/smollm2-135m-eagle3.yaml", ["model.feature_layers=[1,1,2]"]),
    "eagle3-dense": ("configs/smollm2-135m-eagle3.yaml", ["model.feature_layers=[1,1,2]", "loss.unroll_fraction=1"]),
}


def make_target(folder: Path, width: int) -> Path:
    """A 2-layer random Llama of the width (its tokenizer word-level over the vocabulary), saved once in bfloat16."""
    if (folder / "config.json").exists():
        return folder
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    heads, kv, mlp, vocab = WIDTHS[width]
    special = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    words = {t: i for i, t in enumerate(special + [f"w{i}" for i in range(vocab - len(special))])}
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=mlp, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=False,
                      eos_token_id=3, pad_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_rows(prepared: Path, target_dir: Path, rows: int, device: str, seed: int = 0) -> None:
    """`rows` training rows (and 16 held out) of 128-512 random tokens, the second half of each an assistant reply,
    with random features cached for EAGLE-1 (H) and EAGLE-3 (4H) heads, as a prep and a feature pass would leave."""
    if (prepared / "train.jsonl").exists():
        return
    from eagle.features import FeatureWriter, default_dtype, features_dir
    from eagle.target import load_target

    target = load_target(str(target_dir), device=device, dtype="auto", layers=False)  # as training will load it
    g = torch.Generator().manual_seed(seed)
    prepared.mkdir(parents=True)
    for split, n in (("train", rows), ("val", 16)):
        lengths = torch.randint(128, 513, (n,), generator=g).tolist()
        with open(prepared / f"{split}.jsonl", "w") as f:
            for length in lengths:
                ids = torch.randint(4, target.vocab_size, (length,), generator=g).tolist()
                f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * (length // 2) + [1] * (length - length // 2)})
                        + "\n")
        dtype = default_dtype(target.dtype)
        for layers in (None, [1, 1, 2]):
            width = target.hidden_size * (1 + len(layers or []))
            with FeatureWriter(features_dir(prepared, split, target, layers, dtype), lengths, width, dtype) as w:
                for i, length in enumerate(lengths):
                    w.add(i, torch.randn(length, width, generator=g).to(dtype))


def throughput(args, target_dir: Path, prepared: Path, recipe: str, workers: int) -> dict:
    preset, overrides = RECIPES[recipe]
    run = Path(args.work) / "runs" / f"{recipe}-w{workers}"
    argv = [sys.executable, str(ROOT / "eagle_cli.py"), "train", "--config", str(ROOT / preset),
            f"model.target={target_dir}", f"data.prepared={prepared}", f"run_dir={run}", f"out={run}/head",
            f"budget.max_steps={args.steps}", "budget.minutes=0", "eval.every_minutes=0", "eval.num_prompts=0",
            "save_every_minutes=1000", "tensorboard=false", f"device={args.device}", f"data.workers={workers}",
            "log_every=5", "model.vocab_counts=", *overrides]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{recipe} with {workers} workers failed:\n{done.stderr[-3000:]}")
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "tok_s" in r][1:]  # the first interval builds kernels and fills the loader
    import shutil

    shutil.rmtree(run)
    return {"tokens_per_s": round(statistics.median(r["tok_s"] for r in steps)),
            "data_wait": round(statistics.mean(r["data_wait"] for r in steps), 4), "steps": args.steps}


TTT_PROBE = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from eagle import HeadConfig
from eagle.head import make_head
from train.config import TrainConfig
from train.losses import head_loss
width, tokens, steps, device = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), torch.device(sys.argv[5])
heads, kv, mlp, vocab = json.loads(sys.argv[6])
cfg = HeadConfig(head_type="eagle3", hidden_size=width, vocab_size=vocab, num_attention_heads=heads,
                 num_key_value_heads=kv, head_dim=width // heads, intermediate_size=mlp, feature_layer_ids=[1, 1, 2],
                 draft_vocab_size=int(sys.argv[7]))
head = make_head(cfg).to(device)
class Ends:  # the target's embedding and lm_head the head borrows (random)
    embed = torch.nn.Embedding(vocab, width).to(device).requires_grad_(False)
    lm_head = torch.nn.Linear(width, vocab, bias=False).to(device).requires_grad_(False)
head.embed_tokens, head.lm_head = Ends.embed, Ends.lm_head
head._gather_draft_rows()
train = TrainConfig()
train.loss.steps, train.loss.unroll_fraction = steps, 1.0
g = torch.Generator(device=device).manual_seed(0)
ids = torch.randint(0, vocab, (1, tokens), device=device, generator=g)
feats = torch.randn(1, tokens, 4 * width, device=device, generator=g)
mask = torch.ones(1, tokens, dtype=torch.bool, device=device)
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
if device.type == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
else:
    open("/proc/self/clear_refs", "w").write("5"); before = hwm()
with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
    loss, _ = head_loss(head, ids, mask, feats, train, g)
loss.backward()
if device.type == "cuda":
    torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - before
else:
    peak = hwm() - before
print(json.dumps({"tokens": tokens, "peak_bytes": peak}))
"""


def ttt_memory(args, tokens: int) -> dict:
    draft_vocab = args.draft_vocab or (4096 if args.width < 2048 else 32000)  # the SmolLM2 presets'; SpecForge's
    done = subprocess.run([sys.executable, "-c", TTT_PROBE, str(ROOT), str(args.width), str(tokens),
                           str(args.steps_ttt), args.device, json.dumps(WIDTHS[args.width]), str(draft_vocab)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"tokens": tokens, "error": done.stderr.strip().splitlines()[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/train_throughput")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=576, choices=sorted(WIDTHS))
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--ttt-tokens", default="2048,4096,8192")
    ap.add_argument("--steps-ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=0, help="the probe head's (0: 4,096 below width 2,048, else 32,000)")
    args = ap.parse_args()
    work = Path(args.work)
    target_dir = make_target(work / f"llama-{args.width}", args.width)
    prepared = work / f"rows-{args.width}-{args.device}"
    make_rows(prepared, target_dir, args.rows, args.device)
    device = torch.device(args.device)
    result = {"device": args.device, "width": args.width,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "throughput": {}, "ttt_memory": []}
    for recipe in args.recipes.split(","):
        for workers in map(int, args.workers.split(",")):
            result["throughput"][f"{recipe}, {workers} workers"] = throughput(args, target_dir, prepared, recipe,
                                                                               workers)
            print(recipe, workers, result["throughput"][f"{recipe}, {workers} workers"], file=sys.stderr, flush=True)
    for tokens in map(int, args.ttt_tokens.split(",")) if args.ttt_tokens else []:
        result["ttt_memory"].append(ttt_memory(args, tokens))
        print(result["ttt_memory"][-1], file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
