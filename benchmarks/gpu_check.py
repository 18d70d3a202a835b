"""The whole pipeline on one accelerator, offline, from the checkout alone: the check to run when a GPU is at hand.

    python benchmarks/gpu_check.py                        # CUDA: a ~1.1B Llama-shaped target, under 5 minutes
    python benchmarks/gpu_check.py --device cpu --tiny    # the same steps on a tiny target (a test runs it)

Needs only torch, transformers, accelerate, safetensors, pyyaml and tqdm: the target is a Llama built from a config
with random weights (TinyLlama's shape; `--tiny`: a few hundred thousand parameters), its tokenizer a word-level
vocabulary built here, and the prompts random word sequences, so nothing is downloaded. Steps:
1. regenerate `--rows` conversations with the target (`eagle prep`'s path, batched greedy decoding);
2. train an EAGLE-1 and an EAGLE-3 head for `--train-seconds` each, bf16 autocast over float32 weights and features
   kept in bfloat16 (`mixed_precision: bf16`, `data.feature_dtype: bfloat16`);
3. decode `--prompts` held-out prompts in float32 and in bfloat16: plain greedy, then chain (k = 3) and dynamic tree
   (4, 3, 8) with each head; every output is compared with the target's own greedy decoding by transformers'
   `generate` in the same precision (a separate copy of the target: `infer.reference`).
A random target's text is hard to predict, so tau is low here; the check is that every step runs on the device, in
both precisions, and that float32 outputs equal the reference's (bfloat16 ones may part at near-ties: each
mismatch's top-2 logit margin is reported).

The last line printed is one JSON object: the device, the seconds of each step, training tokens/s and peak memory
per head, and per precision and setting the tokens/s, the ratio to plain greedy, tau and the exact-match rate.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle import EagleHead, TargetModel  # noqa: E402 (after the checkout is on the path)
from eagle.configio import load_config  # noqa: E402
from eagle.device import resolve_device  # noqa: E402
from infer import SpeculativeDecoder, load_prompts  # noqa: E402
from infer.reference import HFReference, first_mismatch  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPES = {  # TinyLlama-1.1B's decoder, and a tiny one for the CPU
    "full": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
}


def build_target(shape: dict, device: torch.device, seed: int = 0) -> TargetModel:
    """A Llama of `shape` with random weights (float32) on `device`, and a word-level tokenizer over its vocabulary
    (w0, w1, ...) with a ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    vocab = {t: i for i, t in enumerate(special + [f"w{i}" for i in range(shape["vocab_size"] - len(special))])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    cfg = LlamaConfig(**shape, max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # sharper than a random init's near-uniform logits: fewer ties, more varied text
        model.lm_head.weight.mul_(8.0)
    return TargetModel(name="gpu-check-llama", model=model, tokenizer=tok)


def write_conversations(path: Path, n: int, words: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = int(torch.randint(8, 25, (1,), generator=g))
            text = " ".join(f"w{int(i)}" for i in torch.randint(0, words, (length,), generator=g))
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None


def train_head(kind: str, target: TargetModel, data: Path, run: Path, seconds: float, device: torch.device,
               tiny: bool) -> dict:
    from train.config import TrainConfig
    from train.loop import train

    overrides = [f"data.prepared={data}", f"run_dir={run / kind / 'run'}", f"out={run / kind / 'head'}",
                 f"device={device}", f"budget.minutes={seconds / 60}", "mixed_precision=bf16",
                 "data.feature_dtype=bfloat16", "eval.num_prompts=0", "eval.every_minutes=0", "tensorboard=false",
                 "save_every_minutes=100", "log_every=10", f"optim.batch_tokens={1024 if tiny else 8192}",
                 f"model.draft_vocab={256 if tiny else 8192}"]
    if kind == "eagle3":
        overrides += ["model.head_type=eagle3", "loss.steps=3"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    state = train(load_config(TrainConfig, None, overrides), target=target)
    return {"steps": state.step, "tokens_per_s": round(state.tokens / max(state.train_s, 1e-9), 1),
            "sim_tau": round(state.best_tau, 3), "peak_memory_mb": peak_memory_mb(device)}


def run(dec: SpeculativeDecoder, ids: list[list[int]], want, new_tokens: int, device: torch.device, **kw) -> dict:
    """One setting over every prompt: tokens/s, tau, and the outputs' exact-match rate against `want` (the
    reference's), with the reference's top-2 logit margin at each mismatch."""
    sync(device)
    t0, tokens, same, rounds, emitted, margins = time.perf_counter(), 0, 0, 0, 0, []
    for i, w in zip(ids, want):
        r = dec.generate(i, new_tokens, **kw)
        tokens += len(r.token_ids)
        rounds, emitted = rounds + r.rounds, emitted + sum(r.accept_lengths) + r.rounds
        m = first_mismatch(r.token_ids, w)
        same += m is None
        if m is not None:
            margins.append(None if m.margin is None else round(m.margin, 4))
    sync(device)
    return {"tokens_per_s": round(tokens / (time.perf_counter() - t0), 1),
            "tau": round(emitted / rounds, 3) if rounds else None, "exact_match": round(same / len(ids), 3),
            "mismatch_margins": margins}


def decode(target: TargetModel, reference: HFReference, heads: dict[str, Path], prompts: list[str], new_tokens: int,
           device: torch.device) -> dict:
    """Plain greedy, then chain k = 3 and dynamic (4, 3, 8) with each head, on every prompt, against the
    reference's greedy outputs."""
    dec = SpeculativeDecoder(target, None)
    ids = [dec.encode(p) for p in prompts]
    want = [reference.greedy(i, new_tokens, target.eos_ids) for i in ids]
    dec.generate(ids[0], 4, speculative=False)  # warm-up (and on the CPU, the backend's plan)
    out = {"plain": run(dec, ids, want, new_tokens, device, speculative=False)}
    for kind, path in heads.items():
        dec = SpeculativeDecoder(target, EagleHead.from_pretrained(path, device=target.device, dtype=target.dtype,
                                                                   target=target))
        dec.generate(ids[0], 4, num_speculative_tokens=3)  # warm-up (on the CPU, the head's plan)
        for name, kw in (("chain3", dict(num_speculative_tokens=3)),
                         ("dynamic_4_3_8", dict(mode="dynamic", top_k=4, depth=3, total_tokens=8))):
            r = run(dec, ids, want, new_tokens, device, **kw)
            out[f"{kind}_{name}"] = {**r, "vs_plain": round(r["tokens_per_s"] / out["plain"]["tokens_per_s"], 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="a tiny target and short budgets (the CPU check)")
    ap.add_argument("--rows", type=int, default=None, help="conversations regenerated (default 320; tiny 48)")
    ap.add_argument("--train-seconds", type=float, default=None, help="per head (default 60; tiny 4)")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts decoded (default 16; tiny 4)")
    ap.add_argument("--new-tokens", type=int, default=None, help="per reply and decoded prompt (default 32; tiny 16)")
    ap.add_argument("--out", default=None, help="a folder for the rows, runs and heads (default: a temporary one)")
    args = ap.parse_args()
    device, tiny = resolve_device(args.device), args.tiny
    rows = args.rows or (48 if tiny else 320)
    seconds = args.train_seconds or (4.0 if tiny else 60.0)
    new_tokens = args.new_tokens or (16 if tiny else 32)
    n_prompts = args.prompts or (4 if tiny else 16)
    shape = SHAPES["tiny" if tiny else "full"]
    report, timings = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
                       "shape": "tiny" if tiny else "TinyLlama-1.1B, random weights"}, {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.out or tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        target = build_target(shape, device)
        reference_model = copy.deepcopy(target.model)  # the reference's own copy, which the decoder never touches
        timings["build_s"] = round(time.perf_counter() - t0, 1)

        # 1. regenerate the rows
        from data_prep.prep import PrepConfig, prepare

        write_conversations(work / "conversations.jsonl", rows, min(shape["vocab_size"] - 16, 4000))
        t0 = time.perf_counter()
        summary = prepare(PrepConfig(target=target.name, data=str(work / "conversations.jsonl"), out=str(work / "data"),
                                     regenerate=True, max_turns=1, max_new_tokens=new_tokens, max_length=256,
                                     regen_batch_size=64, val_fraction=max(n_prompts / rows, 0.05),
                                     device=str(device), overwrite=True), target=target)
        sync(device)
        timings["prep_s"] = round(time.perf_counter() - t0, 1)
        report["rows_kept"] = summary.kept

        # 2. train both heads
        report["train"] = {}
        for kind in ("eagle1", "eagle3"):
            t0 = time.perf_counter()
            report["train"][kind] = train_head(kind, target, work / "data", work, seconds, device, tiny)
            timings[f"train_{kind}_s"] = round(time.perf_counter() - t0, 1)

        # 3. decode in float32 and bfloat16, against the reference in the same precision
        prompts = [p["prompt"] for p in load_prompts(str(work / "data" / "val_conversations.jsonl"), n_prompts)]
        report["decode"] = {}
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            t0 = time.perf_counter()
            t = TargetModel(name=target.name, model=copy.deepcopy(target.model).to(dtype), tokenizer=target.tokenizer)
            ref = HFReference(TargetModel(name=target.name, model=copy.deepcopy(reference_model).to(dtype),
                                          tokenizer=target.tokenizer))
            heads = {kind: work / kind / "head" for kind in ("eagle1", "eagle3")}
            report["decode"][name] = decode(t, ref, heads, prompts, new_tokens, device)
            del t, ref
            timings[f"decode_{name}_s"] = round(time.perf_counter() - t0, 1)
        report["seconds"] = timings
    print(json.dumps(report))


if __name__ == "__main__":
    main()
