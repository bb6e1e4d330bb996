"""`SweepOptions(max_memory=...)` in the steering sweeps (PASTA profiling, ACT calibration, the
CAA vector): a budget below one row is refused before any forward, the planned minimum named;
a budget that fits leaves the result unchanged."""

from __future__ import annotations

import pytest
import torch

from heads import SweepOptions
from heads.errors import HeadsteerValueError
from steer.act.calibration import calibrate_act_heads
from steer.caa import caa_vector
from steer.pasta.profiling import profile_heads

_PROMPTS = ["Say **yes** now", "Say **no** now"]
_CALLS = {
    "profile_heads": lambda m, o: profile_heads(
        m, _PROMPTS, [" yes", " no"], heads=[(0, 0)], chat=False, options=o
    ),
    "calibrate_act_heads": lambda m, o: calibrate_act_heads(
        m, ["a b", "c d"], [["yes", "no"]] * 2, [0, 1], heads=[(1, 0)], options=o
    ),
    "caa_vector": lambda m, o: caa_vector(m, [("I agree", "I disagree")], 1, options=o),
}


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_a_budget_below_one_row_is_refused_before_any_forward(tiny_llama, monkeypatch, name):
    monkeypatch.setattr(tiny_llama.backend, "run", lambda **kw: pytest.fail("a forward ran"))
    with pytest.raises(HeadsteerValueError, match=r"needs at least .* max_memory is 1 KB"):
        _CALLS[name](tiny_llama, SweepOptions(progress=False, max_memory="1KB"))


def test_a_budget_that_fits_changes_no_result(tiny_llama):
    opts = SweepOptions(progress=False)
    free = caa_vector(tiny_llama, [("I agree", "I disagree"), ("Yes", "No")], 1, options=opts)
    got = caa_vector(
        tiny_llama, [("I agree", "I disagree"), ("Yes", "No")], 1, options=opts.replace(max_memory="8GB")
    )
    torch.testing.assert_close(got, free, rtol=1e-5, atol=1e-6)
