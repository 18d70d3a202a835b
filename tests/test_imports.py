"""The import rules: the EAGLE core is plain torch and knows no backend; the CPU backend has one door.

- `eagle` (head, config, checkpoints and interop, target loading, attention) imports none of the other packages;
- the rest of the core, `infer/cache.py` and `infer/tree.py` (the KV cache and trees), imports only `eagle`;
- `cpu_backend` builds on `eagle` alone;
- `infer` and `data_prep` import `eagle`, themselves and the backend's door (`cpu_backend`, its `__init__` names),
  `train` those and `infer` / `data_prep` through their packages; nothing outside `cpu_backend` reaches its modules;
- no import circle among the core's modules, at the top of a file or inside a function.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle", "cpu_backend", "infer", "data_prep", "train")
CORE = {"eagle/*.py", "infer/cache.py", "infer/tree.py"}
ALLOWED = {"eagle": {"eagle"}, "cpu_backend": {"eagle", "cpu_backend"},
           "infer": {"eagle", "infer", "cpu_backend"}, "data_prep": {"eagle", "data_prep", "cpu_backend"},
           "train": {"eagle", "data_prep", "infer", "train", "cpu_backend"}}


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) of every import in a file, those inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
    return found


def test_each_package_imports_only_what_it_may():
    door = set(__import__("cpu_backend").__all__)
    for pkg, ok in ALLOWED.items():
        for f in sorted((ROOT / pkg).glob("*.py")):
            for module, names in imports(f):
                top = module.split(".")[0]
                if top in PACKAGES:
                    assert top in ok, f"{f.relative_to(ROOT)} imports {module}"
                if top == "cpu_backend" and pkg != "cpu_backend":
                    assert module == "cpu_backend" and set(names) <= door, \
                        f"{f.relative_to(ROOT)} reaches past the CPU backend's door: {module} {names}"


def test_the_core_never_imports_the_backend():
    core = {f for pattern in CORE for f in ROOT.glob(pattern)}
    assert ROOT / "eagle" / "head.py" in core and ROOT / "infer" / "cache.py" in core
    for f in sorted(core):
        for module, _ in imports(f):
            top = module.split(".")[0]
            assert top not in PACKAGES or top == "eagle", f"{f.relative_to(ROOT)} imports {module}"


def test_the_core_has_no_import_circle():
    modules = {f"eagle.{f.stem}": f for f in (ROOT / "eagle").glob("*.py") if f.stem != "__init__"}
    graph = {m: {mod for mod, names in imports(f) for mod in [mod, *(f"{mod}.{n}" for n in names)]
                 if mod in modules and mod != m}
             for m, f in modules.items()}

    def visit(m, path):
        assert m not in path, "import circle: " + " -> ".join([*path[path.index(m):], m])
        for n in graph[m]:
            visit(n, [*path, m])

    for m in graph:
        visit(m, [])
