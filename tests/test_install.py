"""What a GPU user installs: the core imports and runs with torch, transformers, accelerate, safetensors, pyyaml and
tqdm alone (what they pull in), and an input that needs an optional package says which in one line."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("datasets", "gguf", "pyarrow", "matplotlib", "tensorboard")
PROBE = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
import cpu_backend, data_prep, eagle, eagle_cli, infer, train.loop
from tiny import tiny_head, tiny_target
from infer import SpeculativeDecoder
t = tiny_target()
out = SpeculativeDecoder(t, tiny_head(t)).generate([5, 9, 14], 8, num_speculative_tokens=2)
print("decoded", len(out.token_ids))
for argv in (["generate", "--target", "smollm2-135m", "--prompt", "hi"],
             ["eval", "--target", "smollm2-135m", "--data", "some/hub-prompts", "--out", "/nonexistent/x"]):
    eagle_cli.main(argv)
"""


def test_the_core_runs_without_the_optional_packages():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decoded 8" in done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("eagle ")]
    assert errors == ["eagle generate: error: target 'smollm2-135m' is a GGUF file: reading it needs the gguf package "
                      "(pip install gguf)",
                      "eagle eval: error: prompt set 'some/hub-prompts' is not a local file; a hub dataset needs the "
                      "datasets package (pip install datasets)"]
