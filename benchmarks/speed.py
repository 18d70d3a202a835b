"""Decoding speed on this machine: where a target step's time goes, what verification costs, and tokens/s of
transformers' `generate`, its prompt lookup, our plain greedy and our speculative decoding, all in one run.

    .venv/bin/python benchmarks/speed.py --data ../shared/evaldata/mt_bench.jsonl --num-prompts 20 \
        --draft runs/demo/head --k 3            # or --dynamic 4,3,8 for an EAGLE-2 tree

Parts (every timing is a median over repeats, methods interleaved so machine noise hits them alike):
1. memory: read bandwidth (a 256 MB sum) and the bytes of the target's weights, i.e. the floor of one step;
2. the cost of one target pass over M new tokens after a KV cache of --context tokens, M = 1..32, on text the
   target wrote itself (a verification pass of a chain it agrees with): stock (linear layers and sdpa), the fast
   path (`cpu_backend`: the measured layouts of cpu_backend.fastpath, the C attention of cpu_backend.attention)
   with the whole float32 lm_head, the fast path with greedy tokens through the int8 screen (`cpu_backend.Screen`),
   that with weights in GGUF Q4_1 form read as their codes on the FMA path, and on AMX tiles or in VNNI byte
   products where the CPU has them (the default; the switches `q4_1`, `amx`, `vnni` of `cpu_backend.switches`);
   the ratio to M = 1 (what verifying M tokens costs);
3. thread scaling of the same pass at M = 1 and 8;
4. the prompts: HF generate and HF prompt lookup (stock layers, as users run them), our greedy with stock layers,
   with fast layers and the whole lm_head, with the float32 copies of Q4_1 weights, with the codes on the FMA
   path, and as decoding runs by default; our speculative decoding; identical outputs checked against HF greedy.
   The stock runs drop the kernels' layouts, so each timed run of ours follows an untimed one-token run that makes
   its layouts again (made inside a timed run they would cost it ~1 s a prompt).
The last line printed is a JSON object with `hf_generate_tps`, `engine_greedy_tps`, `spec_tps`,
`verify_cost_ratio_k8`, `lossless` and the rest. Without --draft the speculative run is left out (`spec_tps` null):
the engine's greedy against transformers' alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from chain import hf_generate  # benchmarks/chain.py: transformers' generate with the stock layers
from cpu_backend import CPUConfig, kernels, switches
from eagle import load_target
from infer import SpeculativeDecoder
from infer.cache import TargetCache
from infer.evaluate import load_prompts


def bandwidth_gb_s() -> float:
    x = torch.ones(64 * 1024 * 1024)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def real_text(dec: SpeculativeDecoder, data: str, length: int) -> list[int]:
    """`length` tokens of text the target writes itself: MT-bench first turns, each followed by its greedy reply,
    one after another. A pass over random tokens would give the target flat distributions, unlike decoding, where
    the int8 screen (`cpu_backend.Screen`) then recomputes hundreds of logits per row instead of a few."""
    ids: list[int] = []
    for p in load_prompts(data, 20):
        prompt = dec.encode(p["prompt"])
        ids += prompt + dec.generate(prompt, 128, speculative=False).token_ids
        if len(ids) >= length:
            return ids[:length]
    raise ValueError(f"{data}: fewer than {length} tokens in 20 prompts and their replies")


@torch.inference_mode()
def use_codes(q4: bool, fast: bool) -> None:
    """GGUF weights read as their codes (`q4`), multiplied on AMX tiles or in VNNI byte products where the CPU has
    them (`fast`), else on the FMA path."""
    switches.use(dataclasses.replace(switches.current(), q4_1=q4, amx=fast, vnni=fast))


def pass_ms(dec: SpeculativeDecoder, text: list[int], context: int, rows_list: list[int], repeats: int,
            fast: bool, screen: bool = True, q4: bool = True, amx: bool = True) -> dict[int, float]:
    """Median ms of one target pass (features and the greedy token of every row) over `rows` new tokens of `text`
    after its first `context`, with the layouts decoding uses (fast; `screen`: greedy tokens through the int8
    screen, else the whole float32 lm_head; `q4`: weights in GGUF Q4_1 form read as codes, `amx`: on AMX tiles
    or in VNNI byte products where the CPU has them, else on the FMA path) or the stock layers: a
    verification pass of a chain the target agrees with."""
    target = dec.target
    use_codes(q4, amx)
    dec.use_cpu(CPUConfig(fast_path=fast, screen_argmax=screen))
    cache = TargetCache()
    ctx = torch.tensor([text[:context]])
    target.features(ctx, position_ids=torch.arange(context)[None], cache=cache.hf)
    out = {}
    for rows in rows_list:
        ids = torch.tensor([text[context:context + rows]])
        pos = torch.arange(context, context + rows)[None]
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            feats = target.features(ids, position_ids=pos, cache=cache.hf)
            dec.greedy_tokens(feats[0])
            if r:
                times.append((time.perf_counter() - t0) * 1e3)
            cache.crop(context)
        out[rows] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", help="a trained head; without one only the greedy methods run")
    ap.add_argument("--data", default="../shared/evaldata/mt_bench.jsonl")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--spread", action="store_true", help="prompts evenly spaced over the file, not its first ones")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="drafted tokens per round for the speculative run")
    ap.add_argument("--dynamic", metavar="TOP_K,DEPTH,TOTAL",
                    help="an EAGLE-2 dynamic tree for the speculative run instead of the chain, e.g. 4,3,8")
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens for transformers")
    ap.add_argument("--prompt-lookup", type=int, default=0, metavar="M",
                    help="our prompt lookup branch of M tokens in the speculative run's tree (with --lookup-ngram)")
    ap.add_argument("--lookup-ngram", default="2,4", metavar="MIN,MAX", help="prompt_lookup_min, prompt_lookup_max")
    ap.add_argument("--prompt-lookup-adaptive", action="store_true",
                    help="the lookup's length follows its acceptance (prompt_lookup_adaptive)")
    ap.add_argument("--context", type=int, default=256, help="KV-cache length for the pass-cost curve")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    target = load_target(args.target)
    dec = SpeculativeDecoder.from_pretrained(target, args.draft)
    dec.generate([1, 2, 3], 2, speculative=False)  # calibrates the layouts once (cached on disk afterwards)
    if args.dynamic:
        top_k, depth, total = map(int, args.dynamic.split(","))
        spec_kw = dict(mode="dynamic", top_k=top_k, depth=depth, total_tokens=total)
    else:
        spec_kw = dict(mode="chain", num_speculative_tokens=args.k)
    if args.prompt_lookup:
        lo, hi = map(int, args.lookup_ngram.split(","))
        spec_kw.update(prompt_lookup_num_tokens=args.prompt_lookup, prompt_lookup_min=lo, prompt_lookup_max=hi,
                       prompt_lookup_adaptive=args.prompt_lookup_adaptive)

    # 1-2. memory floor and the pass-cost curve, stock vs fast
    # every weight is read once per step (a tied embedding counts once: its lm_head use reads it whole)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    # a greedy token through the int8 screen reads the lm_head's int8 copy instead (a quarter of its bytes)
    lm = target.lm_head.weight
    screened_bytes = weight_bytes - lm.numel() * (lm.element_size() - 1) if dec.screens_greedy_tokens else weight_bytes
    # and weights in GGUF Q4_1 form are read as codes: 0.625 bytes a weight instead of 4 (640 bytes a group of 1,024);
    # in Q8_0 form (Q8_0, Q5_0, Q4_0 tensors) 1.0625 (1,088 bytes a group); K-quant codes 1.5 (1,536)
    def saved(p: torch.Tensor) -> float:  # bytes a weight not read
        if kernels.q4_1_codes(p) is not None:
            return 4 - 0.625
        if kernels.q8_0_codes(p) is not None:
            return 4 - 1.0625
        return 4 - 1.5 if kernels.kquant_codes(p) is not None else 0

    read_bytes = screened_bytes - sum(p.numel() * saved(p) for p in target.model.parameters()
                                      if p.dim() == 2 and p is not lm)
    bw = bandwidth_gb_s()
    rows = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32]
    text = real_text(dec, args.data, args.context + max(rows))
    settings = {"stock": (False, False, False, False),  # (fast, screen, q4, amx)
                "fast_whole_lm_head": (True, False, False, False), "fast_float32": (True, True, False, False),
                "fast_fma_codes": (True, True, True, False), "fast": (True, True, True, True)}
    curves = {name: {r: [] for r in rows} for name in settings}
    for _ in range(3):  # interleave them so drift hits all alike
        for name, (fast, screen, q4, amx) in settings.items():
            for r, ms in pass_ms(dec, text, args.context, rows, args.repeats, fast, screen, q4, amx).items():
                curves[name][r].append(ms)
    curve = {name: {r: statistics.median(v) for r, v in c.items()} for name, c in curves.items()}
    print("| new tokens M | stock ms | fast, whole lm_head ms | fast, float32 weights ms | fast, codes on FMAs ms | "
          f"fast ms (AMX: {kernels.amx_on()}) | fast / fast(M=1) | codes on FMAs / (M=1) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r} | {curve['stock'][r]:.1f} | {curve['fast_whole_lm_head'][r]:.1f} | "
              f"{curve['fast_float32'][r]:.1f} | {curve['fast_fma_codes'][r]:.1f} | {curve['fast'][r]:.1f} | "
              f"{curve['fast'][r] / curve['fast'][1]:.2f} | "
              f"{curve['fast_fma_codes'][r] / curve['fast_fma_codes'][1]:.2f} |")

    # 3. threads
    scaling = {}
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        scaling[n] = pass_ms(dec, text, args.context, [1, 8], args.repeats, True)
    torch.set_num_threads(threads)
    print("threads:", json.dumps(scaling))

    # 4. the prompts
    prompts = load_prompts(args.data, args.num_prompts, args.spread)
    n = args.max_new_tokens
    methods = ["hf_generate", "hf_prompt_lookup", "engine_greedy_stock", "engine_greedy_whole_lm_head",
               "engine_greedy_float32", "engine_greedy_fma_codes", "engine_greedy"]
    methods += ["spec"] if args.draft else []
    tokens, same = {m: 0 for m in methods}, {m: 0 for m in methods}
    seconds = {m: 0.0 for m in methods}
    round_s = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "other": 0.0}
    emitted = passes = 0
    warm = dec.encode(prompts[0]["prompt"])
    hf_generate(target, warm, 8)
    for q4, amx in ((False, False), (True, False), (True, True)):  # every layout made before any timing
        use_codes(q4, amx)
        dec.generate(warm, 8, speculative=False)
    if args.draft:
        dec.generate(warm, 8, **spec_kw)
    for i, p in enumerate(prompts):
        ids = dec.encode(p["prompt"])
        runs = {"hf_generate": hf_generate(target, ids, n),
                "hf_prompt_lookup": hf_generate(target, ids, n, args.lookup)}
        stock = dec.generate(ids, n, speculative=False, cpu=CPUConfig(fast_path=False))  # drops the kernels' layouts
        runs["engine_greedy_stock"] = (stock.token_ids, stock.total_s)

        def timed(q4: bool, amx: bool, **kw):  # the layouts made again by an untimed token first
            use_codes(q4, amx)
            dec.generate(ids, 1, **kw)
            return dec.generate(ids, n, **kw)

        whole = timed(False, False, speculative=False, cpu=CPUConfig(screen_argmax=False))
        runs["engine_greedy_whole_lm_head"] = (whole.token_ids, whole.total_s)
        f32 = timed(False, False, speculative=False)
        runs["engine_greedy_float32"] = (f32.token_ids, f32.total_s)
        fma = timed(True, False, speculative=False)
        runs["engine_greedy_fma_codes"] = (fma.token_ids, fma.total_s)
        fast = timed(True, True, speculative=False)
        runs["engine_greedy"] = (fast.token_ids, fast.total_s)
        if args.draft:
            spec = timed(True, True, **spec_kw)
            runs["spec"] = (spec.token_ids, spec.total_s)
            emitted += sum(spec.accept_lengths) + spec.rounds
            passes += spec.rounds
            round_s["prefill"] += spec.prefill_s
            round_s["draft"] += spec.draft_s
            round_s["verify"] += spec.verify_s
            round_s["other"] += spec.total_s - spec.prefill_s - spec.draft_s - spec.verify_s
        ref = runs["hf_generate"][0]
        for m, (toks, s) in runs.items():
            tokens[m] += len(toks)
            seconds[m] += s
            same[m] += toks == ref
        print(f"[{i + 1}/{len(prompts)}] " + ", ".join(f"{m} {len(t) / s:.1f}" for m, (t, s) in runs.items()),
              flush=True)
    tps = {m: tokens[m] / seconds[m] for m in methods}
    ms_per_token = 1e3 / tps["engine_greedy"]
    result = {
        "target": args.target, "draft": args.draft, "data": args.data, "num_prompts": len(prompts),
        "max_new_tokens": n, "spec_setting": spec_kw, "threads": threads,
        "hf_generate_tps": tps["hf_generate"], "hf_prompt_lookup_tps": tps["hf_prompt_lookup"],
        "engine_greedy_stock_tps": tps["engine_greedy_stock"], "engine_greedy_tps": tps["engine_greedy"],
        "spec_tps": tps.get("spec"), "spec_tau": emitted / passes if passes else None,
        "speedup_vs_hf_generate": {m: tps[m] / tps["hf_generate"] for m in methods},
        "verify_cost_ratio_k8": curve["fast"][8] / curve["fast"][1],
        "verify_cost_ratio_k16": curve["fast"][16] / curve["fast"][1],
        "amx": kernels.amx_on(), "vnni": kernels.vnni_on(),
        "verify_cost_ratio_k8_stock": curve["stock"][8] / curve["stock"][1],
        "pass_ms": curve, "threads_pass_ms": scaling,
        "spec_round_ms": {k: 1e3 * v / max(passes, 1) for k, v in round_s.items()},
        "identical_to_hf_greedy": {m: same[m] / len(prompts) for m in methods},
        "lossless": min(same[m] for m in ("engine_greedy", "spec") if m in same) / len(prompts),
        "memory": {"bandwidth_gb_s": bw, "weight_mb": weight_bytes / 1e6, "floor_ms": weight_bytes / bw / 1e6,
                   "screened_weight_mb": screened_bytes / 1e6, "screened_floor_ms": screened_bytes / bw / 1e6,
                   "q4_read_mb": read_bytes / 1e6, "q4_floor_ms": read_bytes / bw / 1e6,
                   "engine_greedy_ms_per_token": ms_per_token},
    }
    print()
    print("| method | tokens/s | vs HF generate | identical to HF greedy |")
    print("|---|---|---|---|")
    for m in methods:
        print(f"| {m} | {tps[m]:.1f} | {result['speedup_vs_hf_generate'][m]:.2f}x | "
              f"{result['identical_to_hf_greedy'][m]:.2f} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
