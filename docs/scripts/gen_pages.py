"""Pages generated at build time by mkdocs-gen-files (run by `make docs`), so they cannot drift.

(`families.md` is committed: `docs/scripts/gen_families.py` writes it and a test checks it.)

* `shapes.md`: the shape-letter glossary, from the `heads` package docstring;
* `reference/`: one API page per package and subpackage of heads, steer, probes and viz,
  rendered by mkdocstrings from the docstrings, with its `SUMMARY.md` for literate-nav.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PACKAGES = ("heads", "steer", "probes", "viz")


# ------------------------------------------------------------------------- shape letters
def _shapes_page() -> str:
    doc = ast.get_docstring(ast.parse((ROOT / "heads" / "__init__.py").read_text())) or ""
    m = re.search(r"Shape letters in docstrings.*?(?:\n\n|\Z)", doc, re.S)
    if not m:
        raise RuntimeError("heads/__init__.py's docstring has no 'Shape letters in docstrings' paragraph")
    para = " ".join(m.group(0).split())
    body = para.split("): ", 1)[1] if "): " in para else para.split(":", 1)[-1]
    # "... B batch rows; N rows of ...; ... M head variants (`...`). A head selection ..."
    main, _, tail = body.partition(". A head selection")
    items = [x.strip() for x in main.split(";") if x.strip()]
    rows = []
    for item in items:
        # "Q query positions and K key positions of one attention call" holds two letters
        parts = re.split(r"\s+and\s+(?=[A-Za-z]\s)", item)
        if len(parts) > 1 and " of " in parts[-1]:  # "... of one attention call" is shared
            shared = parts[-1][parts[-1].index(" of ") :]
            parts = [p if " of " in p else p + shared for p in parts]
        for part in parts:
            letter, _, meaning = part.strip().partition(" ")
            rows.append(f"| `{letter}` | {meaning.strip().rstrip('.')} |")
    return "\n".join(
        [
            "# Shape letters",
            "",
            "Every docstring writes tensor shapes with these letters (`[B, T]`: a batch of token",
            "rows). Generated from the `heads` package docstring.",
            "",
            "| letter | meaning |",
            "|---|---|",
            *rows,
            "",
            ("A head selection" + tail).rstrip(". ") + "." if tail else "",
            "",
            "The original paragraph:",
            "",
            f"> {para}",
            "",
        ]
    )


# ------------------------------------------------------------------------- API reference
def _deprecated_alias(path: Path) -> bool:
    """A 0.1 module kept as a re-export of its new home (`import *` plus a DeprecationWarning)."""
    text = path.read_text(encoding="utf-8")
    return "import *" in text and "DeprecationWarning" in text


def _public(path: Path) -> bool:
    return not any(part.startswith("_") and part != "__init__.py" for part in path.parts)


def _reference() -> None:
    nav = mkdocs_gen_files.Nav()
    for pkg in PACKAGES:
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            rel = init.relative_to(ROOT)
            if not _public(rel) or "data" in rel.parts:
                continue
            parts = rel.parent.parts
            dotted = ".".join(parts)
            modules = sorted(
                p
                for p in init.parent.glob("*.py")
                if p.name != "__init__.py"
                and not p.name.startswith("_")
                and p.name != "__main__.py"
                and not _deprecated_alias(p)
            )
            if len(parts) == 1:
                doc_path = Path("reference", pkg, "index.md")
            else:
                doc_path = Path("reference", pkg, dotted + ".md")
            nav[(pkg, dotted)] = doc_path.relative_to("reference").as_posix()
            with mkdocs_gen_files.open(doc_path, "w") as fh:
                fh.write(f"# `{dotted}`\n\n")
                fh.write(
                    f"::: {dotted}\n    options:\n      show_root_heading: false\n      members: false\n\n"
                )
                for mod in modules:
                    fh.write(f"::: {dotted}.{mod.stem}\n\n")
    with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as fh:
        fh.writelines(nav.build_literate_nav())


with mkdocs_gen_files.open("shapes.md", "w") as fh:
    fh.write(_shapes_page())
_reference()
