"""One mechanism as a tested rule (docs/architecture.md, "The edit engine"): analyses and
steering reach the model only through the engine's edit sites; the raw torch hooks that place
those sites live in `heads/backends/` and nowhere else.

Every module of `heads/`, `steer/`, `probes/` and `viz/` and every code cell of the notebooks
is parsed with `ast`. Outside `heads/backends/` none may

* name a torch hook registration (`register_forward_hook`, `register_forward_pre_hook`,
  `register_full_backward_hook`, `register_full_backward_pre_hook`, `register_backward_hook`,
  the process-wide `register_module_*_hook`, a tensor's `register_hook` /
  `register_post_accumulate_grad_hook`, `register_multi_grad_hook`), called or not, as an
  attribute or through `getattr`;
* touch a module's hook dictionaries (`_forward_hooks`, `_forward_pre_hooks`,
  `_backward_hooks`, `_backward_pre_hooks`);
* swap a module's `forward` or `__call__` (assignment, `del`, `setattr`, `object.__setattr__`,
  `__dict__["forward"] = ...`).

Tests and benchmarks are exempt (their oracles and baselines are plain hooks by design). The
checker is also run on planted sources, and it must find the backends' own hooks, so the test
can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_layering import _notebook_source

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("heads", "steer", "probes", "viz")
ALLOWED_DIR = ROOT / "heads" / "backends"

HOOK_NAMES = frozenset(
    {
        "register_forward_hook",
        "register_forward_pre_hook",
        "register_full_backward_hook",
        "register_full_backward_pre_hook",
        "register_backward_hook",
        "register_module_forward_hook",
        "register_module_forward_pre_hook",
        "register_module_full_backward_hook",
        "register_module_full_backward_pre_hook",
        "register_module_backward_hook",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "register_multi_grad_hook",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
    }
)
SWAPPED = frozenset({"forward", "__call__"})


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _func_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def violations(source: str, filename: str = "<planted>") -> list[str]:
    """`"line: what"` for every raw hook or forward swap in `source`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in HOOK_NAMES:
            found.append(f"{node.lineno}: torch hook {node.attr}")
        elif isinstance(node, ast.Name) and node.id in HOOK_NAMES:
            found.append(f"{node.lineno}: torch hook {node.id}")
        elif isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] in HOOK_NAMES:
            found.append(f"{node.lineno}: imports torch hook {node.name}")
        elif isinstance(node, ast.Call):
            name, args = _func_name(node), node.args
            if name in {"getattr", "hasattr"} and len(args) >= 2 and _const_str(args[1]) in HOOK_NAMES:
                found.append(f"{node.lineno}: torch hook {_const_str(args[1])} by name")
            if name in {"setattr", "__setattr__", "delattr", "__delattr__"}:
                names = [_const_str(a) for a in args[:2]]
                if any(n in SWAPPED for n in names):
                    found.append(f"{node.lineno}: swaps forward by {name}")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr in SWAPPED and sub.ctx is not ast.Load:
                    found.append(f"{sub.lineno}: swaps .{sub.attr}")
                elif (
                    isinstance(sub, ast.Subscript)
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr == "__dict__"
                    and _const_str(sub.slice) in SWAPPED
                ):
                    found.append(f"{sub.lineno}: swaps __dict__[{_const_str(sub.slice)!r}]")
    return found


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_raw_hook_or_forward_swap_outside_the_backends():
    bad = [
        f"{p.relative_to(ROOT)}:{v}"
        for p in _modules()
        if ALLOWED_DIR not in p.parents
        for v in violations(p.read_text(encoding="utf-8"), str(p))
    ]
    bad += [
        f"{p.relative_to(ROOT)}:{v}"
        for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
        for v in violations(_notebook_source(p), str(p))
    ]
    assert not bad, (
        "raw torch hooks / forward swaps outside heads/backends/ (use engine edits):\n" + "\n".join(bad)
    )


def test_the_checker_sees_the_backends_own_hooks():
    """The backends place the sites with plain hooks: the checker must find them (it is not blind)."""
    found = [v for p in sorted(ALLOWED_DIR.rglob("*.py")) for v in violations(p.read_text(encoding="utf-8"))]
    assert any("register_forward_hook" in v for v in found)
    assert any("register_forward_pre_hook" in v for v in found)


PLANTED = [
    ("h = model.layers[0].register_forward_hook(fn)", 1),
    ("h = proj.register_forward_pre_hook(fn, with_kwargs=True)", 1),
    ("m.register_full_backward_hook(fn)", 1),
    ("reg = m.register_forward_hook\nreg(fn)", 1),
    ("getattr(m, 'register_forward_pre_hook')(fn)", 1),
    ("from torch.nn.modules.module import register_module_forward_hook as r\nr(fn)", 1),
    ("from torch.nn.modules.module import register_module_forward_hook\nregister_module_forward_hook(fn)", 2),
    ("torch.nn.modules.module.register_module_forward_hook(fn)", 1),
    ("x.register_hook(lambda g: g * 0)", 1),
    ("m._forward_hooks[0] = fn", 1),
    ("layer.forward = wrapped", 1),
    ("layer.forward, old = wrapped, layer.forward", 1),
    ("del layer.forward", 1),
    ("setattr(layer, 'forward', wrapped)", 1),
    ("object.__setattr__(layer, 'forward', wrapped)", 1),
    ("layer.__dict__['forward'] = wrapped", 1),
    ("type(m).__call__ = wrapped", 1),
    # clean code: calling forward, defining forward, engine edits
    ("y = layer.forward(x)\nz = m(x)", 0),
    ("class A:\n    def forward(self, x):\n        return x", 0),
    ("with editing(model, [HeadScale(layers=[0], heads=[1], scale=0.0)]):\n    forward(model, enc)", 0),
    ("name = 'register_forward_hook is forbidden'", 0),
]


@pytest.mark.parametrize(("source", "expected"), PLANTED)
def test_checker_on_planted_sources(source, expected):
    assert len(violations(source)) == expected, violations(source)
