"""Probing data sets, metrics, the evaluation harness, per-head probes and studies."""

from heads._util import aliases as _aliases

_aliases.install()  # the moved modules' old paths, one release (heads._util.aliases)
