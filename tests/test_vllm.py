"""vLLM serves our heads as we decode them: a head trained here on SmolLM2, exported for vLLM (EAGLE-1 in the
published layout, EAGLE-3 in the speculators format), accepts per draft position what our decoder accepts on the
same 8 prompts (within 0.02), and vLLM's tokens equal transformers' greedy tokens. Needs `make vllm`; takes minutes.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from vllm_check import vllm_available  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.smollm,
              pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available()))]


def _eagle(*args):
    subprocess.run([sys.executable, "-m", "eagle_cli", *args], cwd=ROOT, check=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm") / "data"
    _eagle("prep", "--target", "smollm2-135m", "--data", "sharegpt", "--out", str(out), "--max-rows", "300",
           "--max-length", "384")
    return out


# the EAGLE-1 head drafts over the whole vocabulary: the published EAGLE-1 layout has no place for a draft
# vocabulary, so vLLM would draft over all of it and the two would propose different tokens now and then
@pytest.mark.parametrize("preset, fmt, extra", [("configs/smollm2-135m-eagle1.yaml", "hf", ["model.draft_vocab=0"]),
                                                ("configs/smollm2-135m-eagle3.yaml", "speculators", [])])
def test_vllm_accepts_what_we_accept_and_writes_transformers_tokens(data, tmp_path, preset, fmt, extra):
    head = tmp_path / "head"
    _eagle("train", "--config", preset, f"data.prepared={data}", f"run_dir={tmp_path / 'run'}", f"out={head}",
           "budget.minutes=3", "eval.every_minutes=0", "eval.num_prompts=0", *extra)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_check.py"), "--draft", f"run={head}", "--format",
                        fmt, "--num-prompts", "8", "--max-new-tokens", "64", "--out", str(tmp_path / "vllm")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    ours = result["rows"]["ours_head run"]
    served = result["rows"][f"vllm_head run {fmt}"]
    assert "refused" not in served
    assert ours["tau"] > 1.05  # the head drafts something worth comparing
    assert served["max_diff"] <= 0.02, (ours["acceptance_per_position"], served["acceptance_per_position"])
    assert served["exact_match"] == 1.0 and result["rows"]["vllm_plain"]["exact_match"] == 1.0
