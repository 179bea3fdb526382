"""The package's public face and its layers: every public name imports, ``import rcm_diffusers`` stays light,
no module imports itself back through another, and the sampling half never reaches into the distillation half.
"""

import ast
import importlib
import os
import subprocess
import sys

import pytest

import rcm_diffusers

PKG_DIR = os.path.dirname(rcm_diffusers.__file__)
REPO = os.path.dirname(PKG_DIR)

PUBLIC_PACKAGES = ["rcm_diffusers", "rcm_diffusers.lora", "rcm_diffusers.attention", "rcm_diffusers.digits"]


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_public_name_imports(package):
    mod = importlib.import_module(package)
    missing = [name for name in mod.__all__ if getattr(mod, name, None) is None]
    assert not missing, f"{package}.__all__ names that do not resolve: {missing}"


def test_top_level_names_are_the_documented_classes():
    from rcm_diffusers.lora.io import load_lora
    from rcm_diffusers.schedulers import RCMScheduler

    assert rcm_diffusers.RCMScheduler is RCMScheduler
    assert rcm_diffusers.load_lora is load_lora
    assert set(rcm_diffusers.__all__) >= {
        "RCMScheduler",
        "TrigFlowEulerScheduler",
        "TrigFlowUniPCScheduler",
        "enable_jvp_attention",
        "save_lora",
        "load_lora",
        "extract_lora",
    }


def test_import_is_light():
    """ComfyUI imports the package at start-up: no diffusers, accelerate, peft or transformers on a bare import."""
    code = (
        "import sys, rcm_diffusers; "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in "
        "('diffusers', 'accelerate', 'peft', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_cli_entry_point_resolves():
    """``rcm-lora`` (pyproject [project.scripts]) points at a callable."""
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "rcm-lora"]
    assert ep.value == "rcm_diffusers.lora.cli:main"
    assert callable(ep.load())


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _is_package(name: str) -> bool:
    return os.path.isfile(os.path.join(REPO, *name.split("."), "__init__.py"))


def _exists(name: str) -> bool:
    return _is_package(name) or os.path.isfile(os.path.join(REPO, *name.split(".")) + ".py")


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body (function-level imports included)."""
    graph = {}
    for root, _, files in os.walk(PKG_DIR):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            name = _module_name(path)
            pkg = name if f == "__init__.py" else name.rsplit(".", 1)[0]
            edges = set()
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                        target = ".".join(base + ([node.module] if node.module else []))
                    else:
                        target = node.module or ""
                    if not target.startswith("rcm_diffusers"):
                        continue
                    subs = [f"{target}.{a.name}" for a in node.names if _exists(f"{target}.{a.name}")]
                    edges.update(subs or [target])
                elif isinstance(node, ast.Import):
                    edges.update(a.name for a in node.names if a.name.startswith("rcm_diffusers."))
            edges.discard(name)
            graph[name] = {e for e in edges if _exists(e)}
    return graph


def test_no_import_cycles():
    graph = import_graph()
    assert "rcm_diffusers.distill.rcm_trainer" in graph and "rcm_diffusers.lora.keys" in graph
    # a package's __init__ importing its own submodules is how packages expose names; a cycle through it
    # needs a submodule importing the package back, which the walk below still sees.
    cycles, state = [], {}

    def visit(n, stack):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layers():
    """Sampling (top level, attention/, lora/, quant/) never imports distill/ or digits/; distill/ never
    imports digits/ (the benchmark sits on top of both)."""
    bad = []
    for mod, deps in import_graph().items():
        layer = mod.split(".")[1] if mod.count(".") else ""
        for d in deps:
            dl = d.split(".")[1] if d.count(".") else ""
            if layer not in ("distill", "digits") and dl in ("distill", "digits"):
                bad.append(f"{mod} -> {d}")
            if layer == "distill" and dl == "digits":
                bad.append(f"{mod} -> {d}")
    assert not bad, bad
