"""One vLLM engine over a list of prompts, run inside `.venv-vllm` (`make vllm`); `benchmarks/vllm_check.py` calls it.

    .venv-vllm/bin/python benchmarks/vllm_run.py REQUEST.json RESULT.json

REQUEST: {"target": HF directory (or a speculators export, which names its verifier), "dtype": "float32",
"prompts": [[token ids], ...], "max_new_tokens": N, "stop_token_ids": [...], "speculative_config": null or vLLM's
dict (method, model, num_speculative_tokens), "max_model_len": 2048}. Each prompt is generated alone (batch 1, as
ours decode), greedy, after one unmeasured warm-up prompt. RESULT: {"token_ids": [[...]], "seconds": [...],
"drafts", "draft_tokens", "accepted", "accepted_per_position": [...], "per_prompt": [the same counters for each
prompt], "vllm": version}: vLLM's own `vllm:spec_decode_*` metrics (as its offline example reads them), summed over
the measured prompts. Imports nothing of this project: the two virtual environments hold different transformers.
"""

from __future__ import annotations

import json
import sys
import time


def spec_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters, by name."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per = out["accepted_per_position"]
            per.extend([0] * (len(m.values) - len(per)))
            for i, v in enumerate(m.values):
                per[i] += int(v)
    return out


def difference(a: dict, b: dict, sign: int = 1) -> dict:
    """a - b (a + b with sign -1) of two counter snapshots."""
    n = max(len(a["accepted_per_position"]), len(b["accepted_per_position"]))
    pa = a["accepted_per_position"] + [0] * (n - len(a["accepted_per_position"]))
    pb = b["accepted_per_position"] + [0] * (n - len(b["accepted_per_position"]))
    return {**{k: a[k] - sign * b[k] for k in ("drafts", "draft_tokens", "accepted")},
            "accepted_per_position": [x - sign * y for x, y in zip(pa, pb)]}


def main(request_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    req = json.loads(open(request_path).read())
    llm = LLM(model=req["target"], dtype=req.get("dtype", "float32"), max_model_len=req.get("max_model_len", 2048),
              speculative_config=req.get("speculative_config"), disable_log_stats=False, seed=0,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"],
                            stop_token_ids=req.get("stop_token_ids") or None, detokenize=False)

    def generate(ids):
        return llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids

    generate(req["prompts"][0][: max(len(req["prompts"][0]) // 2, 1)])  # warm-up, unmeasured
    token_ids, seconds, per_prompt = [], [], []
    for ids in req["prompts"]:
        before = spec_counters(llm)
        t0 = time.perf_counter()
        out = generate(ids)
        seconds.append(time.perf_counter() - t0)
        token_ids.append(list(out))
        per_prompt.append(difference(spec_counters(llm), before))
    total = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": []}
    for c in per_prompt:
        total = difference(total, c, sign=-1)
    result = {"token_ids": token_ids, "seconds": seconds, "vllm": vllm.__version__, **total,
              "per_prompt": per_prompt}
    with open(result_path + ".tmp", "w") as f:
        f.write(json.dumps(result))
    import os

    os.replace(result_path + ".tmp", result_path)


if __name__ == "__main__":  # vLLM's CPU engine starts worker processes that import this module
    main(sys.argv[1], sys.argv[2])
