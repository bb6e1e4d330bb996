"""Layering as a tested rule (docs/architecture.md, "Layout"): `heads` <- `steer`, `probes` <- `viz`.

Every module of `heads/`, `steer/`, `probes/` and `viz/` and every code cell of the notebooks
is parsed with `ast`; every import is checked, also those inside functions, relative ones,
and `importlib.import_module("...")` / `__import__("...")` with a literal name:

* `heads` imports none of `steer`, `probes`, `viz`;
* `steer` imports only `heads`;
* `probes` imports only `heads` and `steer`;
* nothing but `viz` and the notebooks imports `viz`.

Tests and benchmarks are exempt. The checker is also run on planted backwards imports, so
this test can fail.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("heads", "steer", "probes", "viz")
ALLOWED = {
    "heads": set(),
    "steer": {"heads"},
    "probes": {"heads", "steer"},
    "viz": {"heads", "steer", "probes"},
    "notebooks": {"heads", "steer", "probes", "viz"},
}


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Absolute dotted names an import node brings in (relative ones resolved against `module`);
    a relative import that climbs above the top-level package gives `"<beyond top level>"`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if not node.level:
            return [node.module or ""]
        package = module.split(".") if is_package else module.split(".")[:-1]
        keep = len(package) - (node.level - 1)
        if keep < 1:
            return ["<beyond top level>"]
        base = ".".join(package[:keep])
        if node.module:
            return [f"{base}.{node.module}"]
        return [f"{base}.{a.name}" for a in node.names]
    if isinstance(node, ast.Call) and node.args:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        arg = node.args[0]
        if (
            name in ("import_module", "__import__")
            and isinstance(arg, ast.Constant)
            and isinstance(arg.value, str)
        ):
            return [arg.value]
    return []


def backward_imports(
    source: str, module: str, *, layer: str | None = None, is_package: bool = False
) -> list[str]:
    """Backwards imports in `source`, the code of dotted module `module` (e.g. `"heads.scorers.maps.static"`).

    `layer` is the rule to apply (default the module's top-level package; `"notebooks"` for a
    notebook). Returns one `"line N: <layer> imports <name>"` per violation.
    """
    layer = layer or module.split(".")[0]
    allowed = ALLOWED[layer] | {layer}
    out = []
    for node in ast.walk(ast.parse(source)):
        for name in _imported(node, module, is_package):
            top = name.split(".")[0]
            if name == "<beyond top level>" or (top in PACKAGES and top not in allowed):
                out.append(f"line {node.lineno}: {layer} imports {name}")
    return out


def _notebook_source(path: Path) -> str:
    """The code cells of a notebook, IPython magics and shell lines blanked (line count kept)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    lines = []
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        lines += ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.splitlines()]
    return "\n".join(lines)


def tree_violations(root: Path) -> list[str]:
    """Every backwards import under `root` (its four packages and `notebooks/`)."""
    out, seen = [], 0
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            is_package = path.name == "__init__.py"
            parts = rel.with_suffix("").parts[:-1] if is_package else rel.with_suffix("").parts
            module = ".".join(parts)
            out += [
                f"{rel}:{v}" for v in backward_imports(path.read_text("utf-8"), module, is_package=is_package)
            ]
            seen += 1
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        src = _notebook_source(path)
        out += [f"{path.relative_to(root)}:{v}" for v in backward_imports(src, "notebook", layer="notebooks")]
        seen += 1
    if not seen:
        raise ValueError(f"no modules found under {root}")
    return out


def test_the_tree_has_no_backwards_import():
    assert tree_violations(ROOT) == []


def test_every_package_module_is_walked():
    # the walk sees the packages' modules, including ones only imported inside functions
    walked = {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    want = {"heads/__init__.py", "steer/pasta/profiling.py", "probes/studies/safety.py", "viz/cli/eval.py"}
    assert want <= walked
    assert not (ROOT / "heads" / "profiling.py").exists()  # PASTA profiling lives in steer/


@pytest.mark.parametrize(
    "module,source,expected",
    [
        ("heads.x", "import steer\n", ["line 1: heads imports steer"]),
        (
            "heads.x",
            "def f():\n    from steer.pasta.method import Pasta\n",
            ["line 2: heads imports steer.pasta.method"],
        ),
        (
            "heads.x",
            "class A:\n    def m(self):\n        import probes.datasets.tasks as t\n",
            ["line 3: heads imports probes.datasets.tasks"],
        ),
        (
            "heads.x",
            "import importlib\nimportlib.import_module('viz.cli.main')\n",
            ["line 2: heads imports viz.cli.main"],
        ),
        ("heads.x", "__import__('steer')\n", ["line 1: heads imports steer"]),
        ("heads.x", "from .. import steer\n", ["line 1: heads imports <beyond top level>"]),
        (
            "steer.x",
            "from probes.datasets.tasks import load_task\n",
            ["line 1: steer imports probes.datasets.tasks"],
        ),
        ("steer.x", "try:\n    import viz\nexcept ImportError:\n    pass\n", ["line 2: steer imports viz"]),
        ("probes.x", "from viz.figures import head_heatmap\n", ["line 1: probes imports viz.figures"]),
        # allowed: own package (also relative), lower layers, third-party names that only look alike
        ("heads.x", "from .maps import maps_scores\nimport torch\nimport headsteer_extra\n", []),
        ("steer.x", "from heads.results.scores import HeadScores\nfrom .pasta import Pasta\n", []),
        ("probes.x", "from steer import Ablate\nfrom heads import HeadModel\nfrom . import tasks\n", []),
        (
            "viz.x",
            "from probes.studies.safety import safety_analysis\nfrom .figures import head_heatmap\n",
            [],
        ),
    ],
)
def test_checker_on_planted_sources(module, source, expected):
    assert backward_imports(source, module) == expected


def test_relative_imports_resolve_against_the_package():
    # `from . import x` in a package's __init__ stays in the package; in a subpackage `..` climbs one
    assert backward_imports("from . import maps\n", "heads", is_package=True) == []
    assert backward_imports("from ..viz import cli\n", "heads.sub.x") == []  # heads.viz, not viz
    assert backward_imports("from ...viz import cli\n", "heads.sub.x") == [
        "line 1: heads imports <beyond top level>"
    ]


def test_planted_backwards_import_in_a_copy_of_the_tree_fails(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("data", "__pycache__"))
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks")
    assert tree_violations(tmp_path) == []
    (tmp_path / "heads" / "planted.py").write_text(
        "def f():\n    from steer.pasta.method import Pasta\n    return Pasta\n"
    )
    nb = {"cells": [{"cell_type": "code", "source": ["%matplotlib inline\n", "import viz.figures\n"]}]}
    (tmp_path / "notebooks" / "ok.ipynb").write_text(json.dumps(nb))  # notebooks may import viz
    (tmp_path / "probes" / "tasks.py").write_text(
        (tmp_path / "probes" / "tasks.py").read_text() + "\n\ndef _late():\n    import viz.cli.main\n"
    )
    got = tree_violations(tmp_path)
    assert len(got) == 2
    assert got[0].startswith("heads/planted.py:line 2: heads imports steer.pasta.method")
    assert got[1].startswith("probes/tasks.py:") and got[1].endswith("probes imports viz.cli.main")


def test_no_script_shadows_a_package():
    """`python benchmarks/x.py` puts benchmarks/ first on sys.path: a script named like a package
    (e.g. benchmarks/probes.py) would shadow it for every benchmark."""
    root = Path(__file__).resolve().parents[1]
    scripts = {p.stem for p in (root / "benchmarks").glob("*.py")}
    assert not scripts & {"heads", "steer", "probes", "viz"}, scripts
