"""Find the fastest speculative setting for this machine, target and head: measured, not guessed.

    eagle bench --target smollm2-135m --draft runs/demo/head --data ../shared/evaldata/mt_bench.jsonl \
        --num-prompts 8 --max-new-tokens 128 --out runs/bench
    eagle bench ... --sweep-k 1,2,3 --sweep-dynamic 4:3:8 --sweep-lookup 0,8   # a smaller sweep

Candidates: chains of each `sweep_k`, EAGLE-2 dynamic trees of each `sweep_dynamic` (TOP_K:DEPTH:TOTAL_TOKENS;
not with a `draft_model`, which drafts chains only), each of them also with a prompt-lookup branch of each non-zero
`sweep_lookup`, and prompt lookup alone (each lookup also with an adaptive length, `prompt_lookup_adaptive`, with
`sweep_lookup_adaptive`); without a head or draft model, prompt lookup alone only. Every other
decoding option (temperature, max_new_tokens, ...) is the base all candidates share. For every prompt, plain
decoding and every candidate run back to back, in an order reversed every other prompt, so machine noise hits them
alike; speeds compare only within one run. After `prune_after` prompts, candidates slower than `prune_below` x the
fastest stop (each speedup is against plain decoding on the prompts the candidate ran).

Writes `bench.json` (every candidate, fastest first, and the best as settings and as command-line flags) and
`bench.md`. The best is the fastest candidate whose greedy outputs equalled plain decoding's on every prompt; with
sampling (temperature > 0) outputs differ by design and only speed counts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cpu_backend import CPUConfig
from eagle import load_target
from eagle.device import resolve_device, resolve_dtype
from infer.decoder import DecodeConfig, SpeculativeDecoder, check_config
from infer.evaluate import EvalError, load_prompts
from infer.proposer import ModelProposer


@dataclass
class BenchConfig:
    target: str = "smollm2-135m"
    draft: str = ""  # an EAGLE head
    draft_model: str = ""  # instead of a head: a small causal LM with the target's tokenizer (chains only)
    data: str = ""
    out: str = "runs/bench"
    num_prompts: int = 8
    spread: bool = True  # prompts evenly spaced over the file (MT-bench's file is sorted by category)
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # what every candidate shares
    cpu: CPUConfig = field(default_factory=CPUConfig)  # the CPU backend's switches (flat flags: --no-fast-path)
    device: str = "auto"  # auto (CUDA when present), cpu, cuda, cuda:N
    dtype: str = "float32"  # float32, bfloat16, float16
    sweep_k: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    sweep_dynamic: list[str] = field(default_factory=lambda: ["2:3:4", "4:3:8", "4:4:8", "8:4:16"])
    sweep_lookup: list[int] = field(default_factory=lambda: [0, 5, 8])  # 0: the head's drafts alone
    sweep_lookup_adaptive: bool = True  # every lookup candidate also with an adaptive length
    warmup: int = 1  # prompts decoded once by every candidate, unmeasured, before timing starts
    # after this many prompts, candidates slower than prune_below x the fastest stop (0: every candidate runs all)
    prune_after: int = 2
    prune_below: float = 0.7  # lenient: two prompts are noisy here (at 0.8 chain k = 2 was once dropped on noise)
    num_threads: int = 0


@dataclass
class Candidate:
    name: str
    settings: dict  # the DecodeConfig fields it sets
    tau: float = 0.0
    tokens_per_s: float = 0.0
    speedup: float = 0.0  # over plain decoding on the same prompts in the same run
    identical: float | None = None  # fraction of prompts with plain greedy's tokens; None when sampling
    draft_ms: float = 0.0  # per round
    verify_ms: float = 0.0
    head: bool = True  # drafts with the head (False: prompt lookup alone, run without --draft)
    prompts: int = 0  # prompts it ran: all of them, or prune_after when it was pruned


@dataclass
class BenchReport:
    num_prompts: int
    baseline_tokens_per_s: float
    candidates: list[Candidate]  # fastest first; those pruned after `prune_after` prompts after the rest
    best: Candidate | None  # None: no lossless candidate beat plain decoding
    flags: str  # the best's settings as `eagle eval` / `eagle generate` flags


def candidates(cfg: BenchConfig, has_head: bool) -> list[Candidate]:
    """The settings to measure, named; a one-line error for a malformed sweep."""
    shapes: list[Candidate] = []
    if has_head:
        for k in cfg.sweep_k:
            if k < 1:
                raise EvalError(f"sweep_k {k}: chains draft at least 1 token")
            shapes.append(Candidate(f"chain k={k}", dict(mode="chain", num_speculative_tokens=k,
                                                         prompt_lookup_num_tokens=0, prompt_lookup_adaptive=False)))
        for spec in cfg.sweep_dynamic:
            parts = str(spec).split(":")
            if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
                raise EvalError(f"sweep_dynamic {spec!r}: expected TOP_K:DEPTH:TOTAL_TOKENS such as 4:3:8")
            top_k, depth, total = (int(p) for p in parts)
            shapes.append(Candidate(f"dynamic {top_k}:{depth}:{total}",
                                    dict(mode="dynamic", top_k=top_k, depth=depth, total_tokens=total,
                                         prompt_lookup_num_tokens=0, prompt_lookup_adaptive=False)))
    if any(m < 0 for m in cfg.sweep_lookup):
        raise EvalError(f"sweep_lookup {cfg.sweep_lookup}: prompt lookup lengths must be >= 0")
    out = [c for c in shapes if 0 in cfg.sweep_lookup]
    for m in (m for m in cfg.sweep_lookup if m > 0):
        for adaptive in (False, True) if cfg.sweep_lookup_adaptive and m > 1 else (False,):  # 1: the same twice
            name = f"lookup {m}" + (", adaptive" if adaptive else "")
            lookup = dict(prompt_lookup_num_tokens=m, prompt_lookup_adaptive=adaptive)  # the base's must not leak in
            out += [Candidate(f"{c.name} + {name}", {**c.settings, **lookup}) for c in shapes]
            out.append(Candidate(f"{name} (no head)", lookup, head=False))
    if not out:
        raise EvalError("nothing to measure: give a --draft head (with --sweep-k or --sweep-dynamic) or a "
                        "non-zero --sweep-lookup")
    for c in out:
        check_config(dataclasses.replace(cfg.decode, **c.settings))
    return out


def flags(settings: dict) -> str:
    return " ".join((f"--{'' if v else 'no-'}{k.replace('_', '-')}" if isinstance(v, bool) else
                     f"--{k.replace('_', '-')} {v}") for k, v in settings.items())


def bench(cfg: BenchConfig, decoder: SpeculativeDecoder | None = None) -> BenchReport:
    check_config(cfg.decode)
    resolve_device(cfg.device), resolve_dtype(cfg.dtype)  # one-line errors before anything loads
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    has_head = bool(cfg.draft or cfg.draft_model) or (decoder is not None and decoder.proposer is not None)
    chains_only = bool(cfg.draft_model) or isinstance(getattr(decoder, "proposer", None), ModelProposer)
    cands = candidates(dataclasses.replace(cfg, sweep_dynamic=[]) if chains_only else cfg, has_head)
    prompts = load_prompts(cfg.data, cfg.num_prompts, cfg.spread)
    target = None if decoder else load_target(cfg.target, cfg.device, cfg.dtype)  # one-line errors before decoding
    dec = decoder or SpeculativeDecoder.from_pretrained(target, cfg.draft or None,
                                                        draft_model=cfg.draft_model or None)
    dec.config, dec.cpu = cfg.decode, cfg.cpu
    alone = SpeculativeDecoder(dec.target, None, config=cfg.decode, cpu=cfg.cpu)  # prompt lookup without the head
    sampling = cfg.decode.temperature > 0
    n = cfg.decode.max_new_tokens

    def run(c: Candidate | None, prompt: str, i: int, new_tokens: int = n):
        g = None
        if sampling:
            g = torch.Generator(device=dec.target.device).manual_seed((cfg.decode.seed or 0) * 1_000_003 + i)
        if c is None:
            return dec.generate(prompt, new_tokens, speculative=False, generator=g)
        return (dec if c.head else alone).generate(prompt, new_tokens, generator=g, **c.settings)

    for p in prompts[: cfg.warmup]:
        for c in [None] + cands:
            run(c, p["prompt"], -1, min(n, 16))
    stats = {c.name: [0, 0.0, 0, 0, 0.0, 0.0, 0] for c in cands}  # tokens, s, emitted, rounds, draft, verify, same
    base_runs: list[tuple[int, float]] = []  # plain decoding's (tokens, seconds) on each prompt
    active = list(cands)
    for i, p in enumerate(prompts):
        base = run(None, p["prompt"], i)
        base_runs.append((len(base.token_ids), base.total_s))
        for c in active if i % 2 == 0 else active[::-1]:
            out = run(c, p["prompt"], i)
            st = stats[c.name]
            for j, v in enumerate((len(out.token_ids), out.total_s, sum(out.accept_lengths) + out.rounds,
                                   out.rounds, out.draft_s, out.verify_s, out.token_ids == base.token_ids)):
                st[j] += v
            c.prompts += 1
        speed = {c.name: stats[c.name][0] / stats[c.name][1] for c in active}
        if i + 1 == cfg.prune_after and i + 1 < len(prompts):
            top = max(speed.values())
            active = [c for c in active if speed[c.name] >= cfg.prune_below * top]
            print(f"after {i + 1} prompts: {len(cands) - len(active)} of {len(cands)} candidates slower than "
                  f"{cfg.prune_below} x the fastest stop", flush=True)
        print(f"[{i + 1}/{len(prompts)}] plain {base.tokens_per_s:.1f} tok/s; fastest so far: "
              f"{max(active, key=lambda c: speed[c.name]).name}", flush=True)
    for c in cands:  # each against plain decoding on the prompts it ran
        tokens, s, emitted, rounds, draft, verify, same = stats[c.name]
        base_tokens, base_s = (sum(x) for x in zip(*base_runs[: c.prompts]))
        c.tokens_per_s, c.tau = tokens / s, emitted / max(rounds, 1)
        c.speedup = c.tokens_per_s / (base_tokens / base_s)
        c.identical = None if sampling else same / c.prompts
        c.draft_ms, c.verify_ms = 1e3 * draft / max(rounds, 1), 1e3 * verify / max(rounds, 1)
    cands.sort(key=lambda c: (-c.prompts, -c.tokens_per_s))  # those that ran every prompt first
    base_tps = sum(t for t, _ in base_runs) / sum(s for _, s in base_runs)
    best = next((c for c in cands if c.prompts == len(prompts) and c.identical in (None, 1.0) and c.speedup > 1.0),
                None)
    report = BenchReport(len(prompts), base_tps, cands, best, "" if best is None else flags(best.settings))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"settings": asdict(cfg), **asdict(report)}, indent=1))
    (out / "bench.md").write_text(markdown(report, cfg))
    return report


def markdown(r: BenchReport, cfg: BenchConfig) -> str:
    d = cfg.decode
    drafter = cfg.draft or (f"draft model {cfg.draft_model}" if cfg.draft_model else "no head")
    lines = [f"# Fastest speculative setting: {cfg.target} + {drafter}", "",
             f"{r.num_prompts} prompts from `{cfg.data}`, {d.max_new_tokens} new tokens, "
             + (f"temperature {d.temperature}" if d.temperature > 0 else "greedy")
             + f", {torch.get_num_threads()} threads. Plain decoding: {r.baseline_tokens_per_s:.1f} tokens/s.", "",
             "| setting | prompts | tau | tokens/s | speedup | draft / verify ms a round | identical to plain |",
             "|---|---|---|---|---|---|---|"]
    for c in r.candidates:
        lines.append(f"| {c.name} | {c.prompts} | {c.tau:.2f} | {c.tokens_per_s:.1f} | {c.speedup:.2f}x | "
                     f"{c.draft_ms:.1f} / {c.verify_ms:.1f} | "
                     f"{'n/a' if c.identical is None else format(c.identical, '.2f')} |")
    if any(c.prompts < r.num_prompts for c in r.candidates):
        lines += ["", f"Candidates with fewer prompts were slower than {cfg.prune_below} x the fastest after "
                  f"{cfg.prune_after} prompts and stopped there (`--prune-after 0` runs every candidate on all)."]
    if r.best is None:
        lines += ["", "No candidate beat plain decoding on this machine.", ""]
    else:
        lines += ["", f"Fastest: **{r.best.name}** ({r.best.speedup:.2f}x plain decoding): `eagle eval` / `eagle "
                  f"generate` flags `{r.flags}`" + ("" if r.best.head else ", without `--draft`") + ".", ""]
    return "\n".join(lines)
