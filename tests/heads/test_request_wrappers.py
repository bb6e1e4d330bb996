"""The functional API over the requests (issue 38 item 3): `path_patch`, `find_circuit`,
`detect_roles`, `train_lens` and `head_atlas` build their request and run it through
`run_<analysis>`, so the function and `heads.run(model, request, inputs)` give the same result,
a bad value is refused by the request class itself with the message the function gives, and the
deprecated loose keywords warn at the caller's line."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from heads import run
from heads.engine.options import SweepOptions
from heads.scorers.patching import pairs_from_tokens

QUIET = SweepOptions(progress=False)


def _pairs():
    return pairs_from_tokens([[5, 6, 7], [8, 9, 10]], [[11, 12, 13], [14, 15, 16]], [5, 6], [40, 41])


def test_path_patch_equals_its_request_run(tiny_llama):
    from heads.scorers.patching.path import path_patch
    from heads.scorers.patching.request import PathPatchRequest

    pairs = _pairs()
    kw = {"receivers": {1: [0, 1]}, "inputs": "v", "direction": "denoising"}
    got = path_patch(tiny_llama, pairs, [0], **kw, options=QUIET)  # layer 0's heads
    request = PathPatchRequest(senders={0: list(range(tiny_llama.n_heads))}, **kw)
    want = run(tiny_llama, request, pairs, options=QUIET)
    torch.testing.assert_close(got.raw, want.raw, rtol=0, atol=0, equal_nan=True)
    assert got.params == want.params and not torch.isnan(got.raw[0]).any()  # every layer-0 head sent


def test_loose_keyword_warnings_name_the_callers_file(tiny_llama):
    """The DeprecationWarnings of edge_scores / find_circuit's loose keywords point at the line
    that called them (they pointed one frame too deep, into the scorer's own module)."""
    from heads.scorers.circuits import edge_scores, find_circuit

    pairs = _pairs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        edge_scores(tiny_llama, pairs, method="eap", progress=False)
        edge_scores(tiny_llama, pairs, method="eap", batch_size=1, options=QUIET)
        find_circuit(tiny_llama, pairs, method="eap", n=3, curve=False, batch_rows=8, progress=False)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 3
    assert {Path(w.filename).name for w in deprecations} == {Path(__file__).name}
