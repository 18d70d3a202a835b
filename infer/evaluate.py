"""Measure a head: plain greedy and speculative decoding on the same prompts, in one process, after a warm-up.

    eagle eval --target smollm2-135m --draft runs/demo/head --data ../shared/evaldata/mt_bench.jsonl \
        --num-prompts 20 --max-new-tokens 128 --mode chain --num-speculative-tokens 4 --out runs/eval
    eagle eval ... --mode dynamic --top-k 4 --depth 4 --total-tokens 8
    eagle eval ... --mode static --tree configs/trees/small.json --temperature 0.7 --seed 0

Every decoding option is a field of `infer.DecodeConfig` (the `decode` part of EvalConfig; flat on the command
line). With `--temperature` > 0 both runs sample (seeded), so `lossless` is not defined and reported as null.

`lossless` compares the speculative tokens with our own plain decoding's, which shares every kernel with them.
`--reference hf` also decodes every prompt with stock transformers (`infer.reference`: a model loaded on its own,
greedy `generate`) and reports `lossless_vs_reference` (speculative tokens equal to the reference's) and
`baseline_vs_reference`, with the first mismatch of each prompt and the reference's top-2 logit margin there.

Prompt files: one JSON object a line with `turns` (the first turn is used; `question_id`, `category` optional),
or `messages` / `conversations` (the first user turn), or `prompt`. Writes `report.json`, `report.md` and, with
matplotlib installed (the `plot` extra, which `make` installs), `report.png`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cpu_backend import CPUConfig
from eagle import load_target
from eagle.device import resolve_device, resolve_dtype
from infer.decoder import DecodeConfig, GenerateOutput, SpeculativeDecoder, check_config
from infer.proposer import load_choices
from infer.reference import HFReference, first_mismatch


class EvalError(ValueError):
    pass


@dataclass
class EvalConfig:
    target: str = "smollm2-135m"
    draft: str = ""
    draft_model: str = ""  # instead of a head: a small causal LM with the target's tokenizer (chains only)
    data: str = ""
    out: str = "runs/eval"
    num_prompts: int = 20
    # take num_prompts evenly spaced over the file instead of its first ones: MT-bench's file is sorted by
    # category, so its first 20 are writing and roleplay only
    spread: bool = False
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    cpu: CPUConfig = field(default_factory=CPUConfig)  # the CPU backend's switches (flat flags: --no-fast-path)
    device: str = "auto"  # auto (CUDA when present), cpu, cuda, cuda:N
    dtype: str = "float32"  # float32, bfloat16, float16
    warmup: int = 1  # prompts decoded once, unmeasured, before timing starts
    num_threads: int = 0
    # "hf": also decode every prompt greedily with stock transformers, a model loaded on its own (infer.reference),
    # and report lossless_vs_reference; "": only our own plain decoding is compared
    reference: str = ""


def _first_user_turn(row: dict) -> str | None:
    if isinstance(row.get("turns"), list) and row["turns"]:
        return str(row["turns"][0])
    for key, role_key, text_key in (("messages", "role", "content"), ("conversations", "from", "value")):
        if isinstance(row.get(key), list):
            for m in row[key]:
                if isinstance(m, dict) and m.get(role_key) in ("user", "human"):
                    return str(m.get(text_key, ""))
    for key in ("prompt", "question", "instruction"):
        if isinstance(row.get(key), str):
            return row[key]
    return None


def load_prompts(spec: str, n: int, spread: bool = False) -> list[dict]:
    """Prompts from a local JSONL file (see module docstring) or a hub dataset name: the first n usable ones, or
    with `spread` n evenly spaced over all usable ones (the i-th of n is usable prompt floor(i * total / n))."""
    path = Path(spec)
    if n < 1:
        raise EvalError(f"num_prompts {n}: expected at least 1")
    if path.suffix in (".jsonl", ".json") or path.exists():
        if not path.exists():
            raise EvalError(f"prompt file {spec!r} does not exist")
        if path.is_dir():
            raise EvalError(f"prompt file {spec!r} is a directory; name a JSONL file")
        rows = []
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise EvalError(f"prompt file {spec!r} line {i + 1} is not valid JSON: {e.msg}") from None
    else:
        try:
            from datasets import load_dataset
        except ImportError:
            raise EvalError(f"prompt set {spec!r} is not a local file; a hub dataset needs the datasets package "
                            "(pip install datasets)") from None
        try:
            rows = list(load_dataset(spec, split="test" if "test" in spec else "train"))
        except Exception as e:  # the hub client raises many types; name the input and the first line of why
            raise EvalError(f"prompt set {spec!r} is neither a local file nor a loadable hub dataset: "
                            f"{str(e).splitlines()[0]}") from None
    prompts = []
    for i, row in enumerate(rows):
        text = _first_user_turn(row) if isinstance(row, dict) else None
        if text:
            prompts.append({"question_id": row.get("question_id", row.get("id", i)),
                            "category": row.get("category", "all"), "prompt": text})
        if len(prompts) == n and not spread:
            break
    if not prompts:
        raise EvalError(f"prompt set {spec!r} has no usable prompt (expected `turns`, `messages` or `prompt`)")
    if spread and len(prompts) > n:
        prompts = [prompts[i * len(prompts) // n] for i in range(n)]
    return prompts


def acceptance_per_position(accept_lengths: list[int], k: int) -> list[float]:
    """Fraction of rounds whose accepted path reached draft position i (1-based), i = 1..k."""
    if not accept_lengths:
        return [0.0] * k
    a = torch.tensor(accept_lengths)
    return [float((a >= i).float().mean()) for i in range(1, k + 1)]


def speedup_spread(pairs: list[tuple[GenerateOutput, GenerateOutput]]) -> tuple[float, list[float]]:
    """The median over prompts of speculative tokens/s over plain tokens/s, each prompt's two runs back to back,
    and its quartiles: a job that takes the cores for a while moves a few prompts' ratios, not the median (an
    aggregate over prompts reported 2.56x for a head that ran at 0.74-1.09x)."""
    return median_spread([s.tokens_per_s / b.tokens_per_s for b, s in pairs if b.tokens_per_s and s.tokens_per_s])


def median_spread(ratios: list[float]) -> tuple[float, list[float]]:
    """(median, [first quartile, third quartile]) of per-prompt ratios; (0, [0, 0]) for none."""
    if not ratios:
        return 0.0, [0.0, 0.0]
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), [q[0], q[2]]


def _summary(pairs: list[tuple[GenerateOutput, GenerateOutput]], k: int, sampling: bool = False) -> dict:
    acc = [a for _, s in pairs for a in s.accept_lengths]
    median, quartiles = speedup_spread(pairs)
    rounds = sum(s.rounds for _, s in pairs)
    base_tok, spec_tok = sum(len(b.token_ids) for b, _ in pairs), sum(len(s.token_ids) for _, s in pairs)
    base_s, spec_s = sum(b.total_s for b, _ in pairs), sum(s.total_s for _, s in pairs)
    return {
        "tau": (sum(acc) + rounds) / max(rounds, 1),
        "acceptance_per_position": acceptance_per_position(acc, k),
        "baseline_tokens_per_s": base_tok / base_s if base_s else 0.0,
        "spec_tokens_per_s": spec_tok / spec_s if spec_s else 0.0,
        "speedup": median,  # the median of per-prompt ratios
        "speedup_quartiles": quartiles,
        # all tokens over all seconds of each kind: moved by whatever else ran during some prompts
        "speedup_aggregate": (spec_tok / spec_s) / (base_tok / base_s) if base_s and spec_s and base_tok else 0.0,
        "lossless": None if sampling else sum(b.token_ids == s.token_ids for b, s in pairs) / max(len(pairs), 1),
        "draft_s": sum(s.draft_s for _, s in pairs),
        "verify_s": sum(s.verify_s for _, s in pairs),
        "prefill_s": sum(s.prefill_s for _, s in pairs),
        # where a round's time goes; "other" is everything else in the loop (bookkeeping, streaming, stops)
        "round_ms": {
            "draft": 1e3 * sum(s.draft_s for _, s in pairs) / max(rounds, 1),
            "verify": 1e3 * sum(s.verify_s for _, s in pairs) / max(rounds, 1),
            "other": 1e3 * sum(s.total_s - s.prefill_s - s.draft_s - s.verify_s for _, s in pairs) / max(rounds, 1),
        },
        "baseline_ms_per_token": 1e3 * base_s / max(base_tok, 1),
        "num_prompts": len(pairs),
    }


def _reference_summary(rows: list[dict], compared: bool) -> dict:
    """The fractions of prompts whose speculative (`lossless_vs_reference`) and plain (`baseline_vs_reference`)
    tokens equal the reference's; null where no reference decoded them."""
    n = max(len(rows), 1)
    return {"lossless_vs_reference": sum(r["spec_mismatch"] is None for r in rows) / n if compared else None,
            "baseline_vs_reference": sum(r["baseline_mismatch"] is None for r in rows) / n if compared else None}


def draft_depth(d: DecodeConfig) -> int:
    """The deepest a round's accepted path can go: the positions acceptance is reported for."""
    if d.mode == "chain":
        depth = d.num_speculative_tokens
    elif d.mode == "dynamic":
        depth = d.depth
    elif d.mode == "static":
        depth = max(len(c) for c in load_choices(d.tree))
    else:
        raise EvalError(f"--mode {d.mode!r}: expected chain, static or dynamic")
    return max(depth, d.prompt_lookup_num_tokens)  # a lookup branch reaches its own length


def check_reference(cfg: EvalConfig) -> None:
    if cfg.reference not in ("", "hf"):
        raise EvalError(f"--reference {cfg.reference!r}: expected hf (stock transformers) or nothing")
    if cfg.reference and cfg.decode.temperature > 0:
        raise EvalError("--reference hf compares greedy outputs: it needs --temperature 0")


def _vs_reference(dec: SpeculativeDecoder, ref: HFReference, prompt_ids: list[int], d: DecodeConfig,
                  base: GenerateOutput, spec: GenerateOutput) -> dict:
    """The reference's greedy tokens for one prompt, cut at the first stop string as ours are, and where ours part
    from them."""
    r = ref.greedy(prompt_ids, d.max_new_tokens, dec.target.eos_ids)
    if d.stop:
        cut = dec._stop_string_cut([], r.token_ids, d.stop)
        r.token_ids = r.token_ids if cut is None else r.token_ids[:cut]
    out = {"reference_token_ids": r.token_ids}
    for name, ours in (("baseline", base), ("spec", spec)):
        m = first_mismatch(ours.token_ids, r)
        out[f"{name}_mismatch"] = None if m is None else asdict(m)
    return out


def evaluate(cfg: EvalConfig, decoder: SpeculativeDecoder | None = None,
             reference: HFReference | None = None) -> dict:
    """`reference`: the stock model to compare with (else, with `cfg.reference` "hf", one loaded here)."""
    d = cfg.decode
    check_config(d)  # before the target loads
    check_reference(cfg)
    resolve_device(cfg.device), resolve_dtype(cfg.dtype)  # one-line errors before anything loads
    k = draft_depth(d)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    prompts = load_prompts(cfg.data, cfg.num_prompts, cfg.spread)
    target = None if decoder else load_target(cfg.target, cfg.device, cfg.dtype)  # one-line errors before decoding
    dec = decoder or SpeculativeDecoder.from_pretrained(target, cfg.draft or None,
                                                        draft_model=cfg.draft_model or None)
    dec.config, dec.cpu = d, cfg.cpu
    sampling = d.temperature > 0
    if cfg.reference and reference is None:
        reference = HFReference.load(dec.target.name, device=dec.target.device, dtype=dec.target.dtype)

    def run(prompt, n, speculative, i):
        g = torch.Generator(device=dec.target.device).manual_seed((d.seed or 0) * 1_000_003 + i) if sampling else None
        return dec.generate(prompt, n, speculative=speculative, generator=g)

    for p in prompts:  # before any decoding: a prompt the context cannot take ends the run at once
        n = len(dec.encode(p["prompt"]))
        if n >= dec.target.max_length:
            raise EvalError(f"prompt {p['question_id']} of {cfg.data!r}: {n} tokens do not fit the target's context "
                            f"of {dec.target.max_length} tokens (it must leave room for one new token)")
    for p in prompts[: cfg.warmup]:
        run(p["prompt"], min(d.max_new_tokens, 16), False, -1)
        run(p["prompt"], min(d.max_new_tokens, 16), True, -1)
    pairs, per_prompt = [], []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        base = run(p["prompt"], d.max_new_tokens, False, i)
        spec = run(p["prompt"], d.max_new_tokens, True, i)
        pairs.append((base, spec))
        ids = dec.encode(p["prompt"])
        row = {"question_id": p["question_id"], "category": p["category"], "prompt_token_ids": ids,
               "baseline_token_ids": base.token_ids, "spec_token_ids": spec.token_ids,
               "accept_lengths": spec.accept_lengths, "tau": spec.tau, "baseline_s": base.total_s,
               "spec_s": spec.total_s}
        if reference is not None:
            row.update(_vs_reference(dec, reference, ids, d, base, spec))
        per_prompt.append(row)
        vs_ref = "" if reference is None else (", reference: same" if row["spec_mismatch"] is None
                                                else f", reference: DIFFERENT at token {row['spec_mismatch']['position']}")
        print(f"[{i + 1}/{len(prompts)}] {p['category']}: tau {spec.tau:.2f}, "
              f"{base.tokens_per_s:.1f} -> {spec.tokens_per_s:.1f} tok/s, "
              + ("sampled" if sampling else "identical" if base.token_ids == spec.token_ids else "DIFFERENT")
              + vs_ref, flush=True)
    by_cat = defaultdict(list)
    for pair, p, row in zip(pairs, prompts, per_prompt):
        by_cat[p["category"]].append((pair, row))
    whole = list(zip(pairs, per_prompt))
    report = {
        "settings": asdict(cfg),
        **_summary(pairs, k, sampling),
        **_reference_summary([row for _, row in whole], reference is not None),
        "per_category": {c: {**_summary([pair for pair, _ in v], k, sampling),
                             **_reference_summary([row for _, row in v], reference is not None)}
                         for c, v in sorted(by_cat.items())},
        "seconds": time.perf_counter() - t0,
        "prompts": per_prompt,
    }
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    plot(report, out / "report.png")
    return report


def plot(r: dict, path: Path) -> bool:
    """`report.png`: acceptance by draft position, and how many tokens each round emitted. Needs matplotlib (the
    `plot` extra); without it nothing is drawn and False is returned."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    acc = r["acceptance_per_position"]
    per_round = [a + 1 for p in r["prompts"] for a in p["accept_lengths"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.bar(range(1, len(acc) + 1), acc, color="tab:blue")
    left.set(xlabel="draft position", ylabel="rounds reaching it", ylim=(0, 1),
             title=f"acceptance by position (tau {r['tau']:.2f})")
    top = max(per_round, default=1)
    right.hist(per_round, bins=[b + 0.5 for b in range(top + 1)], color="tab:green", rwidth=0.85)
    right.set(xlabel="tokens emitted in a round", ylabel="rounds", xticks=range(1, top + 1),
              title=f"speculative {r['spec_tokens_per_s']:.1f}, plain {r['baseline_tokens_per_s']:.1f} tokens/s "
                    f"({r['speedup']:.2f}x)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def markdown(r: dict) -> str:
    s, d = r["settings"], r["settings"]["decode"]
    shape = {"chain": f"k = {d['num_speculative_tokens']}", "static": f"tree {d['tree']}",
             "dynamic": f"top_k {d['top_k']}, depth {d['depth']}, total_tokens {d['total_tokens']}"}.get(d["mode"], "")
    temp = f", temperature {d['temperature']}, top_p {d['top_p']}" if d["temperature"] > 0 else ", greedy"
    lines = [f"# Speculative decoding: {s['target']} + {s['draft']}", "",
             f"{r['num_prompts']} prompts from `{s['data']}`, {d['max_new_tokens']} new tokens, mode {d['mode']} "
             f"({shape}){temp}", "",
             "| set | prompts | tau | baseline tok/s | speculative tok/s | speedup (median, quartiles) | lossless | "
             "vs reference |",
             "|---|---|---|---|---|---|---|---|"]
    rows = [("all", r)] + [(c, m) for c, m in r["per_category"].items() if len(r["per_category"]) > 1]
    for name, m in rows:
        lines.append(f"| {name} | {m['num_prompts']} | {m['tau']:.2f} | {m['baseline_tokens_per_s']:.1f} | "
                     f"{m['spec_tokens_per_s']:.1f} | {m['speedup']:.2f}x ({m['speedup_quartiles'][0]:.2f}-"
                     f"{m['speedup_quartiles'][1]:.2f}) | {_fraction(m['lossless'])} | "
                     f"{_fraction(m.get('lossless_vs_reference'))} |")
    lines += ["", "Acceptance by draft position: " +
              ", ".join(f"{i + 1}: {a:.2f}" for i, a in enumerate(r["acceptance_per_position"])),
              f"Time drafting {r['draft_s']:.1f}s, verifying {r['verify_s']:.1f}s (speculative runs). "
              f"Per round: draft {r['round_ms']['draft']:.1f} ms, verify {r['round_ms']['verify']:.1f} ms, "
              f"other {r['round_ms']['other']:.1f} ms; plain greedy {r['baseline_ms_per_token']:.1f} ms per token."]
    for p in r["prompts"]:
        m = p.get("spec_mismatch")
        if m is not None:
            margin = "" if m["margin"] is None else f", the reference's top-2 logit margin there {m['margin']:.4g}"
            lines.append(f"Prompt {p['question_id']}: differs from the reference at new token {m['position']} "
                         f"(ours {m['ours']}, reference {m['reference']}{margin}).")
    return "\n".join(lines + [""])


def _fraction(v: float | None) -> str:
    return "n/a" if v is None else format(v, ".2f")
