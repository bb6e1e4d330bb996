"""Deprecated module paths: one table, one import hook.

Modules that moved keep their old dotted path for one release. Instead of a stub file per old
path, `ALIASES` lists every old path with its new one, and `install()` puts one import hook
(`FINDER`) on `sys.meta_path`: importing an old path then warns once
(`DeprecationWarning`) and gives the new module itself (the same object, so `isinstance` checks
and module state agree). The table holds names only; nothing here imports the new modules until
a user imports an old path.

`import viz` must stay light (the CLI installs its Ctrl-C handler before torch loads), so `viz`
does not import this module at start: its own small finder imports it when an old `viz.*` path
is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["ALIASES", "FINDER", "REMOVED_IN", "install", "keep_functions"]

REMOVED_IN = "0.3.0"
"""The release in which the old paths go."""

ALIASES: dict[str, str] = {
    "heads.attribution": "heads.scorers.safety.attribution",
    "heads.images": "heads.inputs.images",
    "heads.loading": "heads.model.loading",
    "heads.maps": "heads.scorers.maps.static",
    "heads.maps_analysis": "heads.scorers.maps.analysis",
    "heads.maps_inference": "heads.scorers.maps.inference",
    "heads.prompts": "heads.inputs.prompts",
    "heads.scores": "heads.results.scores",
    "heads.scorers.circuits.pruning": "heads.results.graph",
    "heads.scorers.circuits.result": "heads.results.circuits",
    "heads.scorers.patching.result": "heads.results.patching",
    "heads.ships": "heads.scorers.safety.ships",
    "heads.sinks": "heads.scorers.sinks",
    "heads.spans": "heads.inputs.spans",
    "steer.act_calibration": "steer.act.calibration",
    "steer.profiling": "steer.pasta.profiling",
    "steer.vhd_trace": "steer.vhr.trace",
    "probes.evaluate": "probes.studies.evaluate",
    "probes.refusal_model": "probes.studies.refusal_model",
    "probes.relations": "probes.datasets.relations",
    "probes.requests": "probes.datasets.requests",
    "probes.safety": "probes.studies.safety",
    "probes.tasks": "probes.datasets.tasks",
    "viz.maps_report": "viz.reports.maps",
    "viz.report": "viz.reports.base",
    "viz.serve": "viz.server.app",
    "viz.vision_report": "viz.reports.vision",
}
"""Old dotted module path -> the module that replaced it (moved in 0.2.0)."""


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of `ALIASES` and loads each as its new module."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in ALIASES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = ALIASES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (this alias goes in headsteer {REMOVED_IN})",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: `create_module` returned the new module, already executed."""


FINDER = _AliasFinder()
"""The import hook serving every old path (first on `sys.meta_path` after `install()`: the table
decides, whatever another finder, e.g. an editable install of an older tree, would find)."""


def install() -> None:
    """Make every old path of `ALIASES` importable (idempotent). `heads` and `probes` call it on
    import; `viz`, which must import light, asks `FINDER` only when an old path is imported."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, FINDER)


class _KeepFunctions(ModuleType):
    """A package whose function attributes an old module path of the same name must not replace."""

    _kept: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: object) -> None:
        if (
            name in self._kept
            and isinstance(value, ModuleType)
            and not isinstance(getattr(self, name, None), ModuleType)
        ):
            return  # importing `heads.ships` (an old path) leaves the function `heads.ships` in place
        super().__setattr__(name, value)


def keep_functions(package: ModuleType, names: tuple[str, ...]) -> None:
    """Keep `package.<name>` a function when the old module path `package.<name>` is imported.

    Python sets a package's attribute to every submodule it imports; an old path of `ALIASES`
    named like a function the package exports (`heads.ships`, the Ships scorer) would otherwise
    replace the function by the module. `from heads.ships import ships` keeps working.
    """
    package.__class__ = _KeepFunctions
    object.__setattr__(package, "_kept", frozenset(names))
