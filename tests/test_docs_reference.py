"""The API reference as a reader sees it (issue 40, item 5): every documented attribute under its
own name (griffe, which renders the reference, reads `a / b:` or `a, b:` in an Attributes section
as the name `a` typed `/ b`), and modules export their analyses, not their internal helpers (the
reference shows each module's `__all__` only)."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("attributes", "parameters", "other parameters")


def _entries():
    """(object path, section, name, annotation) of every docstring entry of the four packages,
    parsed as the reference parses them (griffe, Google style)."""
    griffe = pytest.importorskip("griffe")
    logging.getLogger("griffe").setLevel(logging.ERROR)
    out = []

    def walk(obj, seen):
        if obj.path in seen or obj.is_alias:
            return
        seen.add(obj.path)
        if obj.docstring:
            for sec in obj.docstring.parse(griffe.Parser.google):
                if sec.kind.value in SECTIONS:
                    out.extend(
                        (
                            obj.path,
                            sec.kind.value,
                            it.name,
                            "" if it.annotation is None else str(it.annotation),
                        )
                        for it in sec.value
                    )
        for m in obj.members.values():
            walk(m, seen)

    for pkg in ("heads", "steer", "probes", "viz"):
        walk(griffe.load(pkg, search_paths=[str(ROOT)], allow_inspection=False), set())
    return out


def test_docstring_entries_name_one_attribute_each():
    entries = _entries()
    assert len(entries) > 500  # the scan reads the docstrings at all
    bad = [
        f"{path} [{sec}] {name!r} typed {ann!r}"
        for path, sec, name, ann in entries
        if (sec == "attributes" and (name.endswith(",") or ann.startswith(("/", ","))))
        or " / " in name  # a grouped parameter is written "a, b:", which griffe keeps whole
    ]
    assert not bad, "entries the reference misreads (write one name per entry):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "module, helpers",
    [
        (
            "heads.scorers.patching.activation",
            ("RunCache", "record_run", "unembed_only", "check_sweep_inputs", "prefix_cache"),
        ),
        ("heads.scorers.patching.logit", ("output_logits", "RunCache", "record_run")),
        ("heads.scorers.patching.record", ("RunCache", "record_run", "check_kv_kind", "first_output")),
    ],
)
def test_internal_helpers_stay_out_of_the_reference(module, helpers):
    mod = importlib.import_module(module)
    assert not set(helpers) & set(mod.__all__)
    assert all(hasattr(mod, h) for h in helpers)  # still importable by the module path


def test_an_internal_module_shows_its_docstring_only():
    """A module whose `__all__` is empty (`heads.scorers.patching.record`) gets its docstring and no
    members on its reference page: mkdocstrings would read an empty `__all__` as none and list all."""
    import ast

    tree = ast.parse((ROOT / "docs" / "scripts" / "gen_pages.py").read_text(encoding="utf-8"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_exports_nothing")
    ns: dict = {"ast": ast, "Path": Path}
    exec(compile(ast.Module([fn], []), "gen_pages.py", "exec"), ns)  # the generator's own check
    assert ns["_exports_nothing"](ROOT / "heads" / "scorers" / "patching" / "record.py")
    assert not ns["_exports_nothing"](ROOT / "heads" / "scorers" / "patching" / "activation.py")
    assert not ns["_exports_nothing"](ROOT / "heads" / "scorers" / "patching" / "__init__.py")
