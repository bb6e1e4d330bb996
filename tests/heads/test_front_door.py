"""The front door (`from heads import ...`): every analysis and result a researcher uses, the
renamed AtP entry point with its deprecated old name, and the old module path `heads.ships` that
must not replace the function `heads.ships`."""

from __future__ import annotations

import importlib
import warnings

import pytest

import heads

ANALYSES = (
    "patch",
    "path_patch",
    "direct_logit_attribution",
    "logit_lens",
    "knockout",
    "find_circuit",
    "detect_roles",
    "train_lens",
    "head_atlas",
    "ships",
    "dataset_ships",
    "sahara",
    "attribution_patching",
    "maps_scores",
    "qrhead_scores",
    "gate_heads",
    "sink_stats",
    "qk_attribution",
    "composition_scores",
    "evaluate_pairs",
    "record",
    "run_with_hooks",
    "run",
)


def test_every_analysis_is_exported_and_callable():
    for name in ANALYSES:
        assert name in heads.__all__, name
        assert callable(getattr(heads, name)), name
    assert len(set(heads.__all__)) == len(heads.__all__)  # no name listed twice
    for name in heads.__all__:
        assert hasattr(heads, name), name


def test_every_request_class_is_exported():
    from heads.scorers.request_base import request_classes

    for cls in request_classes().values():
        assert getattr(heads, cls.__name__) is cls


def test_attribute_is_a_deprecated_alias_of_attribution_patching():
    with pytest.warns(DeprecationWarning, match="heads.attribution_patching"):
        old = heads.attribute
    assert old is heads.attribution_patching
    assert "attribute" not in heads.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        heads.nope  # noqa: B018


def test_old_module_path_keeps_the_function():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("heads.ships")
    assert callable(heads.ships) and not isinstance(heads.ships, type(old))
    assert old.ships is heads.ships


def test_attribution_metric_is_named_apart_from_the_patching_metric():
    from heads.scorers.patching.metrics import Metric
    from heads.scorers.safety import attribution

    assert attribution.AttributionMetric is not Metric
    with pytest.warns(DeprecationWarning, match="use AttributionMetric"):
        old = attribution.Metric
    assert old is attribution.AttributionMetric
    assert "Metric" not in attribution.__all__
