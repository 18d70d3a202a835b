"""The engines a CPU user would pick instead of ours, in one run, on the same prompts, the same GGUF and the same cores.

    .venv/bin/python benchmarks/peers.py --draft runs/demo/head3          # an EAGLE-3 head for the target

Rows (greedy, `--max-new-tokens` new tokens, 20 MT-bench + 10 HumanEval + 10 GSM8K prompts from
../shared/evaldata, each formatted by the target's chat template):
- `hf_generate`, `hf_prompt_lookup`: transformers' `generate` on the stock modules, alone and with its prompt lookup;
- `llamacpp_plain`: llama.cpp's `llama-completion` on the target's GGUF (the file our target is loaded from);
- `llamacpp_eagle3`: `llama-speculative-simple --spec-type draft-eagle3` with our head exported by
  `eagle export --format llama.cpp`, drafting `--k` tokens (`--spec-draft-p-min 0`: always K, as ours);
- `llamacpp_ngram`: `llama-speculative-simple --spec-type ngram-simple` (llama.cpp's prompt lookup);
- `ours_plain`, `ours_head` (chain of `--k`, the same head and K as llamacpp_eagle3), `ours_head_lookup` (one drafted
  token and a prompt-lookup branch of 5 merged into the tree), `ours_bench_choice` (the setting `eagle bench`
  names fastest on `--bench-prompts` MT-bench prompts, measured first);
- `vllm_plain`, `vllm_head` (with `--vllm`, after `make vllm`): vLLM's offline `LLM` on the target as a float32 HF
  directory, alone and with the head exported `--format hf` drafting `--k` (benchmarks/vllm_check.py runs it), each
  prompt alone, all prompts after the other rows (vLLM runs in its own environment).
llama.cpp is built once from the `llama-cpp-python` sdist (benchmarks/llamacpp.py; its cmake options are printed).
Its repacked AMX matmul crashed on Sapphire Rapids before: the script tries it on one short `llama-bench` and runs
every llama.cpp row with `--repack 0` when it fails (said in the output). Every program gets all cores (`-t`).

Columns: tokens/s (new tokens over the time from the prompt's pass to the last token, model loading excluded: for
llama.cpp its own prompt-eval + eval times), the ratio to llamacpp_plain (the median over prompts of each prompt's
ratio, with its quartiles: a job that takes the cores during some prompts moves those, not the median), tau (tokens a target pass yields), and
exact_match: the fraction of prompts whose text equals transformers' greedy text (`same_text`; llama.cpp computes with quantized
activations, so its rate below 1.00 is its own arithmetic, not hidden). For the EAGLE-3 rows both acceptance rates
(accepted / drafted) are printed with their 95 % Wilson intervals. `--check-export` also runs llama.cpp's own
converter on our published export of the head (`convert_hf_to_gguf.py --target-model-dir`, needs `sentencepiece`)
and compares its tensors with our GGUF's, name by name. The last line is one JSON object:
`{"machine": ..., "rows": {NAME: {"tokens_per_s", "vs_llamacpp_plain", "vs_llamacpp_plain_quartiles", "tau",
"exact_match"}}, ...}`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import llamacpp
from chain import hf_generate
from eagle import EagleHead, load_target
from eagle.llamacpp import export_llamacpp
from eagle.target import resolve_target
from infer import SpeculativeDecoder
from infer.evaluate import load_prompts, median_spread

EVAL = Path(__file__).resolve().parents[1].parent / "shared" / "evaldata"
ROWS = ("hf_generate", "hf_prompt_lookup", "llamacpp_plain", "llamacpp_eagle3", "llamacpp_ngram", "ours_plain",
        "ours_head", "ours_head_lookup", "ours_bench_choice")


def machine() -> str:
    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.*)", flags)
    kind = "AMX" if "amx_tile" in flags else "AVX-512 VNNI" if "avx512_vnni" in flags else \
        "AVX2" if "avx2" in flags else platform.machine()
    return f"{model.group(1).strip() if model else platform.processor()}, {os.cpu_count()} cores, {kind}"


def wilson(k: int, n: int) -> tuple[float, float]:
    """The 95 % Wilson interval of a rate k / n."""
    if n == 0:
        return 0.0, 1.0
    z, p = 1.96, k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return mid - half, mid + half


def prompt_sets(n_mt: int, n_code: int, n_math: int) -> list[dict]:
    out = []
    for name, n in (("mt_bench", n_mt), ("humaneval", n_code), ("gsm8k", n_math)):
        if n:
            out += [{**p, "set": name} for p in load_prompts(str(EVAL / f"{name}.jsonl"), n, spread=True)]
    return out


# -- llama.cpp ------------------------------------------------------------------------------------------------------
def llama_args(threads: int, repack: bool) -> list[str]:
    return ["-t", str(threads), "-c", "4096", "--temp", "0", "--seed", "0"] + ([] if repack else ["-nr"])


def amx_repack_works(target_gguf: Path, threads: int) -> bool:
    """Whether llama.cpp's default (repacked) weights decode here: a short llama-bench, which crashed on AMX CPUs."""
    try:
        llamacpp.run("llama-bench", "-m", str(target_gguf), "-p", "16", "-n", "4", "-r", "1", "-t", str(threads),
                     timeout=300)
        return True
    except llamacpp.BuildError as e:
        print(f"llama.cpp with repacked weights failed ({str(e).splitlines()[0]}): every llama.cpp row runs with "
              "--repack 0", flush=True)
        return False


def run_llamacpp(program: str, prompt: str, n: int, extra: list[str]) -> dict:
    """One prompt through a llama.cpp program: its new text, tokens, seconds and, for speculative runs, drafts."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt + "\n")  # llama.cpp drops a prompt file's last newline: the chat template ends with one
    try:
        got = subprocess.run([str(llamacpp.build() / program), "-f", f.name, "-n", str(n), *extra],
                             capture_output=True, text=True, errors="surrogateescape", timeout=900)
    finally:
        os.unlink(f.name)
    if got.returncode:
        tail = (got.stdout + got.stderr).strip().splitlines()[-3:]
        raise llamacpp.BuildError(f"{program} exited {got.returncode}: " + " | ".join(tail))
    log, out = got.stderr, got.stdout
    if program == "llama-completion":
        pe = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log)
        ev = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", log)
        text = out[1:] if out.startswith("\n") else out  # the program's opening and closing lines dropped
        text = text.removesuffix(" [end of text]\n").removesuffix("\n")
        tokens = int(ev.group(2)) + 1 if ev else 0
        seconds = (float(pe.group(1)) + (float(ev.group(1)) if ev else 0.0)) / 1e3
        return {"text": text, "tokens": min(tokens, n), "seconds": seconds, "prompt_tokens": int(pe.group(2))}
    enc = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    drafted = re.search(r"n_drafted = (\d+)", log)
    accepted = re.search(r"n_accept  = (\d+)", log)
    start = out.find(prompt)
    text = out[start + len(prompt):] if start >= 0 else out.lstrip("\n")
    text = text.removesuffix("\n\n\n\n")  # the program's two closing blank lines
    return {"text": text, "tokens": int(dec.group(1)), "seconds": float(enc.group(2)) + float(dec.group(2)),
            "drafted": int(drafted.group(1)), "accepted": int(accepted.group(1)), "prompt_tokens": int(enc.group(1))}


def check_export(head_dir: Path, ours: Path, target, work: Path) -> dict:
    """llama.cpp's converter on our published export vs our GGUF: the same tensor names, shapes, types and bytes."""
    import gguf

    import eagle_cli

    hf = work / "head-hf"
    eagle_cli.main(["export", "--draft", str(head_dir), "--out", str(hf)])
    theirs = work / "head-converter.gguf"
    src = llamacpp.source()
    target_dir = Path(target.model.name_or_path)
    got = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--target-model-dir",
                          str(target_dir), "--outfile", str(theirs), "--outtype", "f16"], capture_output=True, text=True)
    if got.returncode:
        return {"converter": "failed", "why": (got.stdout + got.stderr).strip().splitlines()[-1][-300:]}
    a = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    b = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    differ = [name for name in sorted(set(a) | set(b))
              if name not in a or name not in b or list(a[name].shape) != list(b[name].shape)
              or a[name].tensor_type != b[name].tensor_type or bytes(a[name].data) != bytes(b[name].data)]
    return {"converter": "ran", "tensors": len(b), "same": len(set(a) & set(b)) - len(set(differ) & set(a) & set(b)),
            "differ": differ}


# -- the run --------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", required=True, help="an EAGLE-3 head for the target")
    ap.add_argument("--mt", type=int, default=20)
    ap.add_argument("--code", type=int, default=10)
    ap.add_argument("--math", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="drafted tokens a round, ours and llama.cpp's alike")
    ap.add_argument("--hf-lookup", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    ap.add_argument("--bench-prompts", type=int, default=6)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--check-export", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="add the vllm_plain and vllm_head rows (needs `make vllm`)")
    ap.add_argument("--out", default="runs/peers")
    args = ap.parse_args()
    n, out_dir = args.max_new_tokens, Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    bin_dir = llamacpp.build()
    print(f"llama.cpp {llamacpp.VERSION} in {bin_dir}, cmake {' '.join(llamacpp.CMAKE_OPTIONS)}", flush=True)

    target_gguf = resolve_target(args.target)
    if not (isinstance(target_gguf, Path) and target_gguf.suffix == ".gguf"):
        raise SystemExit(f"--target {args.target!r}: the peers table needs a GGUF target (llama.cpp runs that file)")
    target = load_target(args.target)
    head = EagleHead.from_pretrained(args.draft)
    draft_gguf = out_dir / "head.gguf"
    export_llamacpp(head, draft_gguf, target_gguf)
    result: dict = {"machine": machine(), "target": args.target, "draft": args.draft, "k": args.k,
                    "max_new_tokens": n, "threads": args.threads, "llamacpp_build": list(llamacpp.CMAKE_OPTIONS)}
    if args.check_export:
        result["export_check"] = check_export(Path(args.draft), draft_gguf, target, out_dir)
        print(f"export check: {result['export_check']}", flush=True)
    repack = amx_repack_works(target_gguf, args.threads)
    result["llamacpp_repack"] = repack
    common = llama_args(args.threads, repack)

    dec = SpeculativeDecoder.from_pretrained(target, args.draft)
    prompts = prompt_sets(args.mt, args.code, args.math)
    choice = bench_choice(args, dec, out_dir)
    result["bench_choice"] = choice
    ours = {"ours_plain": dict(speculative=False),
            "ours_head": dict(mode="chain", num_speculative_tokens=args.k, prompt_lookup_num_tokens=0),
            "ours_head_lookup": dict(mode="chain", num_speculative_tokens=1, prompt_lookup_num_tokens=5),
            "ours_bench_choice": choice}
    llama = {"llamacpp_plain": ("llama-completion", ["-no-cnv", "--no-display-prompt", *common]),
             "llamacpp_eagle3": ("llama-speculative-simple",
                                 ["-m", str(target_gguf), "-md", str(draft_gguf), "--spec-type", "draft-eagle3",
                                  "--spec-draft-n-max", str(args.k), "--spec-draft-n-min", "0",
                                  "--spec-draft-p-min", "0", *common]),
             "llamacpp_ngram": ("llama-speculative-simple", ["-m", str(target_gguf), "--spec-type", "ngram-simple",
                                                              *common])}
    llama["llamacpp_plain"][1][:0] = ["-m", str(target_gguf)]
    rows_run = ROWS + (("vllm_plain", "vllm_head") if args.vllm else ())
    stats = {r: {"tokens": 0, "seconds": 0.0, "same": 0, "rounds": 0, "emitted": 0, "drafted": 0, "accepted": 0,
                 "per_prompt_tps": []} for r in rows_run}
    vllm_runs = run_vllm_rows(args, target, head, prompts, dec, out_dir) if args.vllm else {}
    warm = dec.encode(prompts[0]["prompt"])
    for kw in ours.values():  # layouts, screens and the head's kernels made before timing
        dec.generate(warm, 8, **kw)
    hf_generate(target, warm, 8)
    token_mismatch = 0
    by_set: dict = {}  # (row, prompt set) -> [accepted, drafted], for the two rows drafting with the head
    for i, p in enumerate(prompts):
        ids = dec.encode(p["prompt"])
        text = target.tokenizer.decode(ids, skip_special_tokens=False)
        ref, s = hf_generate(target, ids, n)
        ref_text = target.tokenizer.decode(ref, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        runs = {"hf_generate": (ref_text, len(ref), s, None),
                "hf_prompt_lookup": (*_text_and_time(target, hf_generate(target, ids, n, args.hf_lookup)), None)}
        for name, (program, extra) in llama.items():
            r = run_llamacpp(program, text, n, extra)
            token_mismatch += r["prompt_tokens"] != len(ids)  # llama.cpp's tokens of the same text
            runs[name] = (r["text"], r["tokens"], r["seconds"], r)
        for name, kw in ours.items():
            o = dec.generate(ids, n, **kw)
            toks = [t for t in o.token_ids if t not in target.eos_ids]
            runs[name] = (target.tokenizer.decode(toks, skip_special_tokens=True, clean_up_tokenization_spaces=False),
                          len(o.token_ids), o.total_s, o)
        for name, v in vllm_runs.items():
            toks = v["token_ids"][i]
            kept = [t for t in toks if t not in target.eos_ids]
            c = v.get("per_prompt", [{}] * len(prompts))[i] if "per_prompt" in v else {}
            extra = ({"drafted": c["draft_tokens"], "accepted": c["accepted"], "tokens": len(toks),
                      "rounds": c["drafts"]} if name == "vllm_head" else None)
            runs[name] = (target.tokenizer.decode(kept, skip_special_tokens=True, clean_up_tokenization_spaces=False),
                          len(toks), v["seconds"][i], extra)
        for name, (txt, count, sec, extra) in runs.items():
            st = stats[name]
            st["tokens"] += count
            st["seconds"] += sec
            st["per_prompt_tps"].append(count / sec if sec > 0 else 0.0)
            st["same"] += same_text(txt, ref_text, len(ref) >= n)
            drafted = accepted = 0
            if isinstance(extra, dict) and "drafted" in extra:
                drafted, accepted = extra["drafted"], extra["accepted"]
                st["drafted"] += drafted
                st["accepted"] += accepted
                st["emitted"] += extra["tokens"]
                st["rounds"] += extra.get("rounds", max(extra["tokens"] - extra["accepted"], 1))
            elif extra is not None and not isinstance(extra, dict) and extra.rounds:
                st["rounds"] += extra.rounds
                st["emitted"] += sum(extra.accept_lengths) + extra.rounds
                st["accepted"] += sum(extra.accept_lengths)
                st["drafted"] += extra.rounds * (args.k if name == "ours_head" else 0)
                drafted, accepted = extra.rounds * args.k, sum(extra.accept_lengths)
            if name in ("llamacpp_eagle3", "ours_head", "vllm_head"):
                per_set = by_set.setdefault((name, p["set"]), [0, 0])
                per_set[0] += accepted
                per_set[1] += drafted
        print(f"[{i + 1}/{len(prompts)} {p['set']}] " + ", ".join(f"{k} {v[1] / max(v[2], 1e-9):.1f}"
                                                                  for k, v in runs.items()), flush=True)
    result["prompts"] = len(prompts)
    result["prompt_token_mismatches"] = token_mismatch
    base = stats["llamacpp_plain"]["per_prompt_tps"]
    rows = {}
    for name in rows_run:
        st = stats[name]
        tps = st["tokens"] / st["seconds"]
        median, q = median_spread([a / b for a, b in zip(st["per_prompt_tps"], base) if b > 0])
        rows[name] = {"tokens_per_s": round(tps, 1), "vs_llamacpp_plain": round(median, 2),
                      "vs_llamacpp_plain_quartiles": [round(q[0], 2), round(q[1], 2)],
                      "tau": round(st["emitted"] / st["rounds"], 2) if st["rounds"] else None,
                      "exact_match": round(st["same"] / len(prompts), 3)}
    result["rows"] = rows
    for (name, part), (acc, drafted) in sorted(by_set.items()) + [
            ((name, "all"), (stats[name]["accepted"], stats[name]["drafted"]))
            for name in ("llamacpp_eagle3", "ours_head", "vllm_head") if name in stats]:
        lo, hi = wilson(acc, drafted)
        result.setdefault("acceptance", {})[f"{name} {part}"] = {
            "accepted": acc, "drafted": drafted, "rate": round(acc / max(drafted, 1), 4),
            "ci95": [round(lo, 4), round(hi, 4)]}
    print()
    print(f"{len(prompts)} prompts ({args.mt} MT-bench, {args.code} HumanEval, {args.math} GSM8K), {n} new tokens, "
          f"greedy, {args.threads} threads, {result['machine']}")
    print("| engine | tokens/s | vs llama.cpp plain (median, quartiles) | tau | exact match with transformers |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        q = r["vs_llamacpp_plain_quartiles"]
        print(f"| {name} | {r['tokens_per_s']} | {r['vs_llamacpp_plain']:.2f}x ({q[0]:.2f}-{q[1]:.2f}) | "
              f"{'' if r['tau'] is None else r['tau']} | {r['exact_match']:.2f} |")
    for name, a in result["acceptance"].items():
        print(f"acceptance {name}: {a['accepted']}/{a['drafted']} = {a['rate']:.3f} (95% CI {a['ci95'][0]:.3f}-"
              f"{a['ci95'][1]:.3f})")
    (out_dir / "peers.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


def run_vllm_rows(args, target, head, prompts, dec, out_dir: Path) -> dict:
    """vLLM's plain and speculative runs over every prompt (vllm_check.run_vllm), before the per-prompt loop."""
    import vllm_check
    from eagle.interop import export_published

    why = vllm_check.vllm_available()
    if why:
        raise SystemExit(f"--vllm: {why}")
    target_dir = vllm_check.write_target_dir(load_target(args.target), out_dir / "target-hf")
    export_dir = out_dir / "head-vllm"
    export_published(head, export_dir, "vllm")  # an earlier export there is replaced whole
    ids = [dec.encode(p["prompt"]) for p in prompts]
    method = "eagle3" if head.config.head_type == "eagle3" else "eagle"
    stop = list(target.eos_ids)
    out = {"vllm_plain": vllm_check.run_vllm(target_dir, ids, args.max_new_tokens, stop, None, args.threads),
           "vllm_head": vllm_check.run_vllm(target_dir, ids, args.max_new_tokens, stop,
                                            {"method": method, "model": str(export_dir),
                                             "num_speculative_tokens": args.k}, args.threads)}
    print(f"vLLM {out['vllm_plain']['vllm']}: plain and {method} runs done", flush=True)
    return out


def same_text(text: str, ref: str, ref_was_cut: bool) -> bool:
    """Whether a run wrote the reference's text. Trailing newlines aside (the programs end their output with some);
    where the reference stopped at the token limit, a run that went on past it (llama.cpp's speculative loop
    finishes its last round) matches when it starts with the reference."""
    text, ref = text.rstrip("\n"), ref.rstrip("\n")
    return text.startswith(ref) if ref_was_cut else text == ref


def _text_and_time(target, got):
    toks, s = got
    kept = [t for t in toks if t not in target.eos_ids]
    return target.tokenizer.decode(kept, skip_special_tokens=True, clean_up_tokenization_spaces=False), len(toks), s


def bench_choice(args, dec, out_dir: Path) -> dict:
    """`eagle bench`'s fastest lossless setting, measured on MT-bench prompts as a user would run it."""
    from infer.bench import BenchConfig, bench

    t0 = time.perf_counter()
    cfg = BenchConfig(target=args.target, draft=args.draft, data=str(EVAL / "mt_bench.jsonl"),
                      num_prompts=args.bench_prompts, out=str(out_dir / "bench"))
    cfg.decode.max_new_tokens = args.max_new_tokens
    report = bench(cfg, dec)
    settings = dict(report.best.settings) if report.best else dict(speculative=False)
    print(f"eagle bench chose {report.best.name if report.best else 'plain decoding'} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return settings


if __name__ == "__main__":
    main()
