"""Layering as a tested rule (docs/architecture.md, "Layout"): `heads` <- `steer`, `probes` <- `viz`.

Every module of `heads/`, `steer/`, `probes/` and `viz/` and every code cell of the notebooks
is parsed with `ast`; every import is checked, also those inside functions, relative ones,
and `importlib.import_module("...")` / `__import__("...")` with a literal name:

* `heads` imports none of `steer`, `probes`, `viz`;
* `steer` imports only `heads`;
* `probes` imports only `heads` and `steer`;
* nothing but `viz` and the notebooks imports `viz`;
* no import cycle between the modules of one package (`module_cycles`), counting imports at
  module level, inside functions and under `if TYPE_CHECKING:` alike (a function-level import
  is a cycle postponed, not removed; a type-only import still ties the modules' designs: the
  backends are leaves that never name `HeadModel`, the adapter builds on them);
* no module of `heads.engine` imports `heads.scorers` (`engine_violations`): scorers are built
  on the engine, never the reverse.

Tests and benchmarks are exempt. Every checker is also run on planted sources and on a copy
of the tree with a planted cycle or upward import, so these tests can fail.
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
    tasks = tmp_path / "probes" / "datasets" / "tasks.py"
    tasks.write_text(tasks.read_text() + "\n\ndef _late():\n    import viz.cli.main\n")
    got = tree_violations(tmp_path)
    assert len(got) == 2
    assert got[0].startswith("heads/planted.py:line 2: heads imports steer.pasta.method")
    assert got[1].startswith("probes/datasets/tasks.py:") and got[1].endswith("probes imports viz.cli.main")


def test_no_script_shadows_a_package():
    """`python benchmarks/x.py` puts benchmarks/ first on sys.path: a script named like a package
    (e.g. benchmarks/probes.py) would shadow it for every benchmark."""
    root = Path(__file__).resolve().parents[1]
    scripts = {p.stem for p in (root / "benchmarks").glob("*.py")}
    assert not scripts & {"heads", "steer", "probes", "viz"}, scripts


# ---- cycles inside a package and the engine below the scorers -------------------------------------


def _package_modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package `__init__`) for every module of the four packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            is_package = path.name == "__init__.py"
            out[".".join(rel.parts[:-1] if is_package else rel.parts)] = (path, is_package)
    return out


def import_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of the same top-level package it imports (sources given as text).

    `from a.b import c` counts as an import of `a.b.c` where that is a module, else of `a.b`;
    a name that is no module counts as its longest prefix that is one.
    """

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, (source, is_package) in modules.items():
        for node in ast.walk(ast.parse(source)):
            names = _imported(node, module, is_package)
            if isinstance(node, ast.ImportFrom):  # `from pkg import submodule`
                base = names[0] if node.module else None
                if base is not None:
                    subs = [f"{base}.{a.name}" for a in node.names]
                    names = [s if s in modules else base for s in subs]
            for name in names:
                target = resolve(name)
                if target and target != module and target.split(".")[0] == module.split(".")[0]:
                    graph[module].add(target)
    return graph


def module_cycles(modules: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """The import cycles: each strongly connected set of two or more modules, sorted (Tarjan)."""
    graph = import_graph(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def below_violations(modules: dict[str, tuple[str, bool]], lower: str) -> list[str]:
    """`"<module> imports <scorer module>"` for each import of `heads.scorers` under package
    `lower` (`"heads.engine"`, `"heads.results"`)."""
    graph = import_graph(modules)
    return [
        f"{m} imports {t}"
        for m in sorted(graph)
        if m == lower or m.startswith(lower + ".")
        for t in sorted(graph[m])
        if t == "heads.scorers" or t.startswith("heads.scorers.")
    ]


def engine_violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """`"<module> imports <scorer module>"` for each import of `heads.scorers` under `heads.engine`."""
    return below_violations(modules, "heads.engine")


def results_violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """The same for `heads.results`: the results sit below the analyses that make them (a result
    needing scorer code gets that piece moved down, as `PatchResult`'s normalisation was)."""
    return below_violations(modules, "heads.results")


def _tree_sources(root: Path) -> dict[str, tuple[str, bool]]:
    return {m: (p.read_text("utf-8"), pkg) for m, (p, pkg) in _package_modules(root).items()}


def test_no_import_cycle_inside_a_package():
    modules = _tree_sources(ROOT)
    assert {"heads.scorers.safety.ships", "heads.engine.state", "viz.cli.main"} <= set(modules)
    assert module_cycles(modules) == []


def test_the_engine_never_imports_the_scorers():
    assert engine_violations(_tree_sources(ROOT)) == []


def test_the_results_never_import_the_scorers():
    modules = _tree_sources(ROOT)
    assert {"heads.results.patching", "heads.results.dla"} <= set(modules)
    assert results_violations(modules) == []


def _planted(**sources: str) -> dict[str, tuple[str, bool]]:
    return {m.replace("__", "."): (src, False) for m, src in sources.items()}


def test_cycle_checker_on_planted_sources():
    a_b = _planted(heads__a="import heads.b\n", heads__b="def f():\n    from heads import a\n")
    assert module_cycles(a_b) == [["heads.a", "heads.b"]]  # a function-level import still counts
    three = _planted(
        heads__a="from heads.b import x\n", heads__b="from .c import y\n", heads__c="import heads.a as a\n"
    )
    assert module_cycles(three) == [["heads.a", "heads.b", "heads.c"]]
    type_only = _planted(
        heads__a="import heads.b\n",
        heads__b="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from heads.a import A\n",
    )
    assert module_cycles(type_only) == [["heads.a", "heads.b"]]  # a type-only import counts too
    across = _planted(heads__a="import steer.b\n", steer__b="import heads.a\n")
    assert module_cycles(across) == []  # between packages: the layering test's business
    chain = _planted(heads__a="import heads.b\n", heads__b="import heads.c\n", heads__c="import torch\n")
    assert module_cycles(chain) == []


def test_engine_checker_on_planted_sources():
    mods = _planted(
        heads__engine__x="def f():\n    from heads.scorers.sinks import sinks\n",
        heads__engine__y="from heads.results.scores import HeadScores\n",
        heads__scorers__sinks="from heads.engine.x import f\n",
        heads__results__scores="",
    )
    assert engine_violations(mods) == ["heads.engine.x imports heads.scorers.sinks"]
    mods = _planted(
        heads__results__a="def f():\n    from heads.scorers.stability import grid_stability\n",
        heads__results__b="from heads.results.a import f\n",
        heads__scorers__stability="from heads.results.b import f\n",
    )
    assert results_violations(mods) == ["heads.results.a imports heads.scorers.stability"]
    assert engine_violations(mods) == []


def test_planted_cycle_and_upward_import_in_a_copy_of_the_tree_fail(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("data", "__pycache__"))
    assert module_cycles(_tree_sources(tmp_path)) == []
    assert engine_violations(_tree_sources(tmp_path)) == []
    state = tmp_path / "heads" / "engine" / "state.py"  # the leaf imports the scorers: both rules break
    state.write_text(state.read_text() + "\n\ndef _late():\n    from heads.scorers.sinks import sinks\n")
    modules = _tree_sources(tmp_path)
    assert "heads.engine.state imports heads.scorers.sinks" in engine_violations(modules)
    cycles = module_cycles(modules)
    assert len(cycles) == 1 and {"heads.engine.state", "heads.scorers.sinks"} <= set(cycles[0])
    state.write_text(
        state.read_text().replace("\n\ndef _late():\n    from heads.scorers.sinks import sinks\n", "")
    )
    assert module_cycles(_tree_sources(tmp_path)) == []
    # a type-only import closes a cycle as well: a backend naming the adapter that builds on it
    hf = tmp_path / "heads" / "backends" / "hf.py"
    hf.write_text(
        hf.read_text() + "\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        "    from heads.model.adapter import HeadModel\n"
    )
    cycles = module_cycles(_tree_sources(tmp_path))
    assert len(cycles) == 1 and {"heads.backends.hf", "heads.model.adapter"} <= set(cycles[0])
    hf.write_text(hf.read_text().split("\n\nfrom typing import TYPE_CHECKING")[0])
    steer_cycle = tmp_path / "steer" / "noop.py"
    steer_cycle.write_text(steer_cycle.read_text() + "\n\ndef _late():\n    import steer.pasta.method\n")
    assert any("steer.noop" in c for c in module_cycles(_tree_sources(tmp_path)))
