"""Every `headsteer report` command that runs an analysis builds the request the Python API builds,
checks it against the model's config before any weight loads (a bad value: one line, exit 2,
the loader never called), and runs it through `heads.run` (the request it passes there is
captured and compared with the one built in Python from the same values)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import heads
from heads.scorers.circuits.request import CircuitRequest
from heads.scorers.patching.request import DLARequest, LensRequest, PatchRequest
from heads.scorers.qk.request import CompositionRequest, QKRequest
from tests.support.cli import one_line_error
from viz.cli import app


class _Stop(Exception):
    """Raised by the captured `heads.run` once it has seen the requests it needs."""


@pytest.fixture
def captured(monkeypatch):
    """The requests passed to `heads.run`, in order; the run stops (exit 1) after `stop_after`."""
    seen: list = []
    real = heads.run

    def fake(model, request, *inputs, **kw):
        seen.append(request)
        if len(seen) >= fake.stop_after:  # type: ignore[attr-defined]
            raise _Stop
        return real(model, request, *inputs, **kw)

    fake.stop_after = 1  # type: ignore[attr-defined]
    monkeypatch.setattr(heads, "run", fake)
    return fake, seen


def _cli(tmp_path, *args):
    return CliRunner().invoke(app, ["report", *args, "--out", str(tmp_path / "r.html")])


# ------------------------------------------------------------------ bad values: before the weights
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["circuit", "--size", "0"], "--size"),
        (["circuit", "--steps", "1000"], "steps must be"),
        (["circuit", "--size", "5", "--faithfulness", "0.5"], "give at most one"),
        (["circuit", "--sizes", "5,200"], "--sizes"),
        (["circuit", "--confirm", "-1"], "--confirm"),
        (["circuit", "--stability", "1"], "--stability"),
        (["qk", "--head", "2:1"], "head must look like"),
        (["qk", "--head", "9.0"], "unknown layer 9"),
        (["qk", "--head", "1.7"], "unknown head 7"),
        (["patching", "--kind", "nope"], "--kind"),
        (["safety", "--steps", "1000"], "steps must be an int in 1.."),
        (["safety", "--steps", "0"], "--steps"),
        (["atlas", "--stability", "1"], "--stability"),
    ],
)
def test_a_bad_value_exits_2_before_the_weights(no_load, tiny_llama_dir, tmp_path, args, message):
    r = CliRunner().invoke(
        app, ["report", *args, "--out", str(tmp_path / "r.html"), "--model", tiny_llama_dir]
    )
    one_line_error(r, message)
    assert not (tmp_path / "r.html").exists()


# ------------------------------------------------------------------ the request the API builds
def test_report_patching_runs_the_api_requests(captured, tiny_llama_dir, tmp_path):
    fake, seen = captured
    fake.stop_after = 3
    r = _cli(tmp_path, "patching", "--model", tiny_llama_dir, "--n", "2", "--kind", "q", "--direction",
             "noising", "--stability", "2")  # fmt: skip
    assert r.exit_code == 1, r.output  # the captured run stopped it
    assert seen == [
        PatchRequest(kind="q", direction="noising", stability=2),
        DLARequest(stability=2),
        LensRequest(),
    ]
    seen.clear()
    r = _cli(tmp_path, "patching", "--model", tiny_llama_dir, "--n", "2", "--method", "attribution")
    assert r.exit_code == 1, r.output
    assert seen == [
        PatchRequest(kind="head_out", method="attribution"),
        DLARequest(),
        LensRequest(),
    ]


def test_report_circuit_runs_the_api_request(captured, tiny_llama_dir, tmp_path):
    _, seen = captured
    r = _cli(tmp_path, "circuit", "--model", tiny_llama_dir, "--pairs", "2", "--method", "eap",
             "--size", "10", "--sizes", "100,10", "--confirm", "3")  # fmt: skip
    assert r.exit_code == 1, r.output
    assert seen == [CircuitRequest(method="eap", size=10, sizes=[10, 100], confirm=3)]
    # --faithfulness given: the request's target (find_circuit's faithfulness=)
    seen.clear()
    r = _cli(tmp_path, "circuit", "--model", tiny_llama_dir, "--pairs", "2", "--faithfulness", "0.5",
             "--steps", "3")  # fmt: skip
    assert seen == [CircuitRequest(method="eap-ig", faithfulness=0.5, steps=3)], r.output


def test_report_qk_runs_the_api_requests(captured, tiny_llama_dir, tmp_path):
    fake, seen = captured
    fake.stop_after = 2
    prompts = tmp_path / "p.txt"
    prompts.write_text("The cat sat on the mat\n")
    r = _cli(tmp_path, "qk", "--model", tiny_llama_dir, "--head", "L1.H0", "--task", str(prompts))
    assert r.exit_code == 1, r.output
    assert seen == [QKRequest(head=(1, 0), by="source_token"), CompositionRequest(readers=[(1, 0)])]


# ------------------------------------------------------------------ headsteer run REQUEST.json
@pytest.mark.parametrize(
    ("request_json", "extra", "message"),
    [
        ('{"request": "patch", "knd": "q"}', ["--inputs", "ioi"], "unknown key 'knd'"),
        ('{"request": "patch", "layers": [9]}', ["--inputs", "ioi"], "unknown layer 9"),
        ('{"request": "qk_attribution", "head": [1, 7]}', ["--inputs", "ioi"], "prompt file"),
        ('{"request": "patch"}', [], "needs its inputs"),
        ('{"request": "composition_scores"}', ["--inputs", "ioi"], "takes no inputs"),
        ('{"request": "head_atlas"}', [], "report atlas"),
        ('{"request": "patch"}', ["--inputs", "ioi", "--max-memory", "lots"], "--max-memory"),
        ('{"request": "patch"}', ["--inputs", "ioi", "--max-rows", "0"], "--max-rows"),
        ('{"request": "patch"}', ["--inputs", "nofile.jsonl"], "--inputs 'nofile.jsonl' is neither"),
    ],
)
def test_run_refuses_before_the_weights(no_load, tiny_llama_dir, tmp_path, request_json, extra, message):
    req = tmp_path / "r.json"
    req.write_text(request_json)
    r = CliRunner().invoke(
        app, ["run", str(req), "--out", str(tmp_path / "out.json"), "--model", tiny_llama_dir, *extra]
    )
    one_line_error(r, message)
    assert not (tmp_path / "out.json").exists()


def test_run_saves_what_heads_run_gives(tiny_llama, tiny_llama_dir, tmp_path):
    from heads.results.patching import PatchResult
    from heads.scorers.patching.pairs import encode_pairs
    from probes.datasets.pairs import load_task_pairs

    req = PatchRequest(kind="head_out", direction="noising", layers=[1, 2])
    path = tmp_path / "r.json"
    path.write_text(req.to_json())
    out = tmp_path / "patch.json"
    args = ["run", str(path), "--inputs", "ioi", "--n", "2", "--out", str(out), "--model", tiny_llama_dir]
    r = CliRunner().invoke(app, [*args, "--quiet"])
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.output
    got = PatchResult.load(out)
    want = heads.run(tiny_llama, req, encode_pairs(tiny_llama, load_task_pairs("ioi", "test", n=2)))
    assert got.scores.shape == want.scores.shape
    assert (got.scores - want.scores).abs().max() < 1e-5
    before = out.read_bytes()
    r = CliRunner().invoke(app, args)  # the result exists: refused without --force, untouched
    one_line_error(r, "exists")
    assert out.read_bytes() == before


def test_run_knows_the_inputs_of_every_request():
    """Every request class `heads` defines is either run by `headsteer run` (its inputs known) or
    refused by name: a new request is not silently given the wrong inputs."""
    from heads.scorers.request_base import request_classes
    from viz.cli.run_request import NO_INPUT, PAIRS, PROMPTS

    python_only = {"head_atlas", "gate_heads", "qrhead_scores"}  # their inputs are Python objects
    assert set(request_classes()) == {*PAIRS, *PROMPTS, *NO_INPUT} | python_only


@pytest.mark.parametrize("which", ["request", "prompts"])
def test_run_refuses_a_file_that_is_not_utf8(no_load, tiny_llama_dir, tmp_path, which):
    """A request or prompt file that is not UTF-8: one line naming the file, exit 2 (was exit 1,
    `internal error: UnicodeDecodeError`)."""
    req, prompts = tmp_path / "r.json", tmp_path / "p.txt"
    body = b'{"request":"sink_stats"}'
    req.write_bytes(b"\xff\xfe" + body if which == "request" else body)
    prompts.write_bytes(b"a b c\n" + (b"\xff\xfe d e\n" if which == "prompts" else b"d e\n"))
    args = ["run", str(req), "--inputs", str(prompts), "--out", str(tmp_path / "o.json")]
    r = CliRunner().invoke(app, [*args, "--model", tiny_llama_dir])
    one_line_error(r, "not valid UTF-8 text")
    assert str(req if which == "request" else prompts) in r.output
    assert not (tmp_path / "o.json").exists()


def test_safety_prompts_not_utf8_name_the_file(tmp_path):
    from heads.errors import HeadsteerValueError
    from viz.reports.safety import read_prompts

    path = tmp_path / "p.txt"
    path.write_bytes(b"fine\n\xff bad\n")
    with pytest.raises(HeadsteerValueError, match=r"p.txt' line 2 is not valid UTF-8 text"):
        read_prompts(path)


@pytest.mark.parametrize("request_json", ['{"request": "sink_stats"}', '{"request": "attribution_patching"}'])
def test_run_quiet_is_a_valid_request(tiny_llama_dir, tmp_path, request_json):
    """`--quiet` (SweepOptions(progress=False)) is accepted by every analysis (it was refused:
    "sink_stats does not take progress=")."""
    req, prompts = tmp_path / "r.json", tmp_path / "p.txt"
    req.write_text(request_json)
    prompts.write_text("a b c d\ne f g h\n")
    args = ["run", str(req), "--inputs", str(prompts), "--n", "2", "--out", str(tmp_path / "o.json")]
    r = CliRunner().invoke(app, [*args, "--model", tiny_llama_dir, "--quiet"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o.json").exists()


@pytest.mark.parametrize(
    ("request_json", "inputs", "message"),
    [
        (
            '{"request": "patch"}',
            '{"clean": "a b c", "corrupted": "a b d", "answer": " hello world foo", "counterfactual": " x"}',
            "pair 0 answer",
        ),
        (
            '{"request": "patch"}',
            '{"clean": "a b c", "corrupted": "a b c d e", "answer": " x", "counterfactual": " y"}',
            "positions must align",
        ),
        ('{"request": "sink_stats"}', None, "exceeds the model's limit of"),
        (
            '{"request": "direct_logit_attribution", "positions": [20]}',
            '{"clean": "a b c", "corrupted": "a b d", "answer": " x", "counterfactual": " y"}',
            "positions: 20 is outside the pairs'",
        ),
        (
            '{"request": "logit_lens", "positions": [-1, -30]}',
            '{"clean": "a b c", "corrupted": "a b d", "answer": " x", "counterfactual": " y"}',
            "positions: -30 is outside the pairs'",
        ),
    ],
)
def test_run_checks_its_inputs_with_the_tokenizer_before_the_weights(
    no_load, tiny_llama, tiny_llama_dir, tmp_path, request_json, inputs, message
):
    """An input decidable from the tokenizer and config alone is refused with no weight read (the
    loader fails the test if called): the weights were loaded first, then the error came."""
    req = tmp_path / "r.json"
    req.write_text(request_json)
    if inputs is None:  # one prompt longer than the model's positions
        path = tmp_path / "long.txt"
        path.write_text(" ".join(["word"] * (tiny_llama.max_positions + 8)) + "\n")
    else:
        path = tmp_path / "pairs.jsonl"
        path.write_text(inputs + "\n")
    args = ["run", str(req), "--inputs", str(path), "--out", str(tmp_path / "o.json")]
    r = CliRunner().invoke(app, [*args, "--model", tiny_llama_dir])
    one_line_error(r, message)
    assert "loading" not in r.output
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("command", ["patching", "circuit"])
def test_report_checks_its_pairs_with_the_tokenizer_before_the_weights(
    no_load, tiny_llama_dir, tmp_path, command
):
    """`headsteer report patching|circuit --task FILE`: a pair whose prompts differ in token length
    is refused with no weight read (it was refused after loading)."""
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"clean": "a b c", "corrupted": "a b c d e", "answer": " x", "counterfactual": " y"}\n')
    r = CliRunner().invoke(
        app,
        [
            "report",
            command,
            "--task",
            str(path),
            "--out",
            str(tmp_path / "r.html"),
            "--model",
            tiny_llama_dir,
        ],
    )
    one_line_error(r, "positions must align")
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("command", ["qk", "attention"])
def test_report_checks_prompt_length_before_the_weights(
    no_load, tiny_llama, tiny_llama_dir, tmp_path, command
):
    """`report qk --task FILE` and `report attention --prompt TEXT`: a prompt over the model's
    positions is refused from the tokenizer and config alone, naming the flag (it was refused
    after the weights loaded)."""
    words = " ".join(["word"] * (tiny_llama.max_positions + 8))
    if command == "qk":
        path = tmp_path / "long.txt"
        path.write_text(words + "\n")
        extra = ["--task", str(path), "--head", "0.0"]
    else:
        extra = ["--prompt", f"**{words}**"]
    out = tmp_path / "r.html"
    r = CliRunner().invoke(app, ["report", command, *extra, "--out", str(out), "--model", tiny_llama_dir])
    flag = "--task" if command == "qk" else "--prompt"
    one_line_error(r, f"{flag}: a sequence of")
    assert "exceeds the model's limit of" in r.output
    assert not out.exists()


def test_run_counts_prompts_as_the_analysis_encodes_them(no_load, tiny_llama, tiny_llama_dir, tmp_path):
    """A prompt that fits the model's positions as written but not inside the analysis' `{query}`
    template is refused before the weights (it was refused after loading them)."""
    from heads.scorers.safety.common import DEFAULT_TEMPLATE

    tok = tiny_llama.tokenizer
    words = ["word"] * (tiny_llama.max_positions - 4)
    raw = len(tok(" ".join(words))["input_ids"])
    assert raw <= tiny_llama.max_positions  # fits as written
    assert (
        len(tok(DEFAULT_TEMPLATE.replace("{query}", " ".join(words)))["input_ids"]) > tiny_llama.max_positions
    )
    path = tmp_path / "p.txt"
    path.write_text(" ".join(words) + "\n")
    req = tmp_path / "r.json"
    req.write_text('{"request": "attribution_patching"}')
    args = ["run", str(req), "--inputs", str(path), "--out", str(tmp_path / "o.json")]
    r = CliRunner().invoke(app, [*args, "--model", tiny_llama_dir])
    one_line_error(r, "--inputs: a sequence of")
    assert not (tmp_path / "o.json").exists()
