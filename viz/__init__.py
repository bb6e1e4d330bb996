"""Figures, reports, the `headsteer` CLI, the server and the explorer.

`import viz` stays light (the CLI installs its Ctrl-C handler before torch loads): the old paths
of moved `viz` modules (one release, `heads._util.aliases`) are looked up only when one is
imported.
"""

from __future__ import annotations

import sys as _sys
from importlib.abc import MetaPathFinder as _MetaPathFinder
from importlib.machinery import ModuleSpec as _ModuleSpec


class _OldPaths(_MetaPathFinder):
    """Asked last on `sys.meta_path`, so only for `viz.*` paths no file provides."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> _ModuleSpec | None:
        if not name.startswith("viz."):
            return None
        from heads._util.aliases import FINDER

        return FINDER.find_spec(name, path, target)


_sys.meta_path.append(_OldPaths())
