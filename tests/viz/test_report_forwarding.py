import pytest

from heads.errors import HeadsteerTypeError


@pytest.mark.parametrize("report", ["probes", "safety"])
def test_reports_refuse_a_keyword_their_study_does_not_take(report, tmp_path):
    if report == "probes":
        from viz.reports.probes import probes_report as fn
    else:
        from viz.reports.safety import safety_report as fn
    out = tmp_path / "r.html"
    with pytest.raises(HeadsteerTypeError, match=r"got an unexpected keyword argument 'n_shots'"):
        fn(None, out, n_shots=3)  # refused before the model is touched or a file is written
    assert not out.exists()
