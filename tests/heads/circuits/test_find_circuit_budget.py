"""`find_circuit(options=SweepOptions(max_memory=...))` refuses a too-small budget naming
'needs at least X', and X is enough: it counts the weights, a forward, the edge scores' plan and
the exact evaluations (X once counted the evaluations' activations only, and giving X was refused
again by the edge-scoring plan, naming a larger minimum)."""

from __future__ import annotations

import re

import pytest
import torch

from heads import SweepOptions
from heads.errors import HeadsteerValueError
from heads.planning.units import parse_bytes
from heads.scorers.circuits import find_circuit
from heads.scorers.patching import pairs_from_tokens
from tests.support.families import tiny_family_model

torch.set_num_threads(1)


def test_named_minimum_is_enough():
    m = tiny_family_model("llama")
    g = torch.Generator().manual_seed(7)
    clean = torch.randint(3, 300, (2, 9), generator=g).tolist()
    corr = [list(r) for r in clean]
    for r in corr:
        r[1] = (r[1] + 5) % 300 + 3
    p = pairs_from_tokens(clean, corr, [5, 6], [40, 41])
    with pytest.raises(HeadsteerValueError) as info:
        find_circuit(m, p, n=5, options=SweepOptions(max_memory=1000, progress=False))
    got = re.search(r"needs at least ([\d.]+ [KMG]?i?B)", str(info.value))
    assert got, str(info.value)
    minimum = parse_bytes(got.group(1), "x")
    try:
        find_circuit(m, p, n=5, options=SweepOptions(max_memory=minimum, progress=False))
    except HeadsteerValueError as e:  # observed: 'eap_lean on 1 x 9 tokens needs at least 438 KB ...'
        pytest.fail(f"the named minimum {got.group(1)} was refused again: {e}")
