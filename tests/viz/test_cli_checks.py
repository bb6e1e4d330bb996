"""`headsteer` options refused before the model loads: unused options per method, library
bounds, empty --emphasize, negative head files, bad pairs files, --split on files, explore's
host and port."""

from __future__ import annotations

import json
import socket
from functools import partial

import pytest
from typer.testing import CliRunner

from heads.errors import HeadsteerValueError
from tests.support.cli import one_line_error
from viz.cli.main import app

runner = CliRunner()
REC = {"clean": "a b", "corrupted": "a c", "answer": " b"}
_one_line_error = partial(one_line_error, ignore=("loading ", "warning: "))


@pytest.mark.parametrize("steer", ["var", "vhr"])
def test_generate_var_vhr_refuse_multiplier(no_load, steer):
    r = runner.invoke(app, ["generate", "Hi **there**", "--steer", steer, "--multiplier", "3"])
    _one_line_error(r, f"--multiplier is not used by --steer {steer}")


def test_generate_unused_option_table_is_complete(no_load):
    # every method option of generate is refused by the methods that do not use it
    cases = {
        "pasta": [["--multiplier", "3"], ["--image", "x.png"]],
        "instaboost": [["--alpha", "0.1"], ["--pasta-heads", "span"], ["--top-k", "3"], ["--image", "x.png"]],
        "var": [["--alpha", "0.1"], ["--pasta-heads", "span"], ["--top-k", "3"], ["--emphasize", "x"]],
    }
    for steer, opts in cases.items():
        for opt in opts:
            r = runner.invoke(app, ["generate", "Hi **there**", "--steer", steer, *opt])
            assert r.exit_code == 2, (steer, opt, r.output)
            assert opt[0] in r.stderr and "error: " in r.stderr, (steer, opt, r.stderr)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["generate", "Hi **there**", "--steer", "vhr", "--alpha", "0.01"],
            "--alpha is not used by --steer vhr",
        ),
        (
            ["generate", "Hi **there**", "--steer", "var", "--pasta-heads", "auto"],
            "--pasta-heads is not used",
        ),
        (["generate", "Hi **there**", "--multiplier", "5"], "--multiplier is not used by --steer pasta"),
        (["generate", "Hi **there**", "--steer", "instaboost", "--alpha", "0.01"], "--alpha is not used"),
        (["vision", "generate", "**ctx** q", "--steer", "var", "--weight", "0.8"], "--weight is not used"),
        (
            ["vision", "generate", "**ctx** q", "--steer", "vhr", "--p", "0.6"],
            "--p is not used by --steer vhr",
        ),
        (
            ["vision", "generate", "**ctx** q", "--without-image", "delete", "--steer", "var"],
            "--without-image",
        ),
        (
            ["eval", "--method", "pasta", "--task", "counterfact", "--caa-coefficient", "4"],
            "--caa-coefficient",
        ),
        (["eval", "--method", "caa", "--task", "counterfact", "--alpha", "0.01"], "--alpha is not used"),
        (["eval", "--method", "none", "--task", "counterfact", "--max-new-tokens", "48"], "--max-new-tokens"),
        (["report", "circuit", "--method", "eap", "--steps", "5", "--out", "c.html"], "--steps is not used"),
    ],
)
def test_unused_option_given_at_its_default_is_refused(no_load, tmp_path, monkeypatch, args, message):
    """An option the chosen method does not use is refused when the user gives it, even at its
    default value (click's parameter source, not a comparison with the default)."""
    monkeypatch.chdir(tmp_path)
    _one_line_error(runner.invoke(app, args), message)


def test_eval_method_options_cover_every_option():
    import inspect

    from viz.cli.eval import METHOD_OPTIONS, eval_command

    common = {
        "run",
        "method",
        "task",
        "split",
        "limit",
        "batch_size",
        "out",
        "max_new_tokens",
        "prompt",
        "baselines",
    }
    opts = set(inspect.signature(eval_command).parameters) - common
    assert opts == {o for used in METHOD_OPTIONS.values() for o in used}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "vhr", "--vhr-alpha", "1e300"], "alpha must be <= 1e4"),
        (["--method", "vhr", "--vhr-alpha", "0"], "alpha must be > 0"),
        (["--method", "var", "--var-p", "nan"], "--var-p must be in [0, 1]"),
        (["--method", "instaboost", "--multiplier", "1e300"], "multiplier"),
    ],
)
def test_eval_library_bounds_before_load(no_load, tmp_path, args, message):
    r = runner.invoke(app, ["eval", "--task", "counterfact", "--out", str(tmp_path / "e.csv"), *args])
    _one_line_error(r, message)


@pytest.mark.parametrize("steer", ["pasta", "instaboost"])
@pytest.mark.parametrize("value", ["", "   "])
def test_generate_empty_emphasize(no_load, steer, value):
    r = runner.invoke(app, ["generate", "Hi there", "--steer", steer, "--emphasize", value])
    _one_line_error(r, "--emphasize is empty")


@pytest.mark.parametrize("text", ['{"0": [-1]}', '{"-2": [0]}'])
def test_negative_head_file_before_load(no_load, tmp_path, text):
    f = tmp_path / "h.json"
    f.write_text(text)
    _one_line_error(runner.invoke(app, ["generate", "a **b**", "--pasta-heads", str(f)]), "negative")
    r = runner.invoke(
        app, ["eval", "--method", "pasta", "--task", "counterfact", "--pasta-heads", str(f),
              "--out", str(tmp_path / "e.csv")],
    )  # fmt: skip
    _one_line_error(r, "negative")


@pytest.mark.parametrize("report", ["patching", "circuit"])
def test_bad_pairs_files_before_load(no_load, tmp_path, report):
    out = str(tmp_path / "r.html")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x81\n")
    _one_line_error(
        runner.invoke(app, ["report", report, "--task", str(binary), "--out", out]), "not valid UTF-8"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(REC) + "\n{oops\n")
    _one_line_error(runner.invoke(app, ["report", report, "--task", str(bad), "--out", out]), "line 2")


BIG = "7" * 5000


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "a **b**", "--pasta-heads"],
        ["eval", "--method", "pasta", "--task", "counterfact", "--pasta-heads"],
        ["eval", "--method", "act", "--task", "counterfact", "--act-heads"],
    ],
)
def test_head_file_with_a_5000_digit_integer_is_one_line(no_load, tmp_path, args):
    f = tmp_path / "h.json"
    f.write_text('{"0": [' + BIG + "]}")
    r = runner.invoke(
        app, [*args, str(f), *(["--out", str(tmp_path / "e.csv")] if args[0] == "eval" else [])]
    )
    _one_line_error(
        r, f"a number in {str(f)!r} is too large: an integer of 5000 digits, more than the limit of 4300"
    )
    assert "set_int_max_str_digits" not in r.output


@pytest.mark.parametrize("report", ["patching", "circuit"])
def test_task_file_with_a_5000_digit_integer_is_one_line(no_load, tmp_path, report):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(REC) + "\n" + json.dumps({**REC, "id": 0}).replace("0}", BIG + "}") + "\n")
    r = runner.invoke(app, ["report", report, "--task", str(f), "--out", str(tmp_path / "r.html")])
    _one_line_error(r, f"a number in {str(f)!r} line 2 is too large: an integer of 5000 digits")
    assert "set_int_max_str_digits" not in r.output


def test_circuit_steps_checks(no_load, tmp_path):
    out = str(tmp_path / "c.html")
    r = runner.invoke(app, ["report", "circuit", "--method", "eap", "--steps", "7", "--out", out])
    _one_line_error(r, "--steps is not used by --method eap")
    r = runner.invoke(app, ["report", "circuit", "--steps", "1000", "--out", out])
    _one_line_error(r, "--steps: steps must be an int in 1..100, got 1000")


def test_edge_scores_bounds_steps():
    from heads.errors import HeadsteerValueError
    from heads.scorers.circuits.scores import MAX_STEPS, edge_scores

    with pytest.raises(HeadsteerValueError, match="steps"):
        edge_scores(None, None, steps=MAX_STEPS + 1)


def test_patching_split_on_a_file(no_load, tmp_path):
    from viz.reports.patching import resolve_pairs

    f = tmp_path / "p.jsonl"
    rows = [{**REC, "answer": f" {i}", "split": "train" if i % 2 else "test"} for i in range(4)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.answer for p in resolve_pairs(f, split="train", n=8)] == [" 1", " 3"]
    assert len(resolve_pairs(f, n=8)) == 4
    r = runner.invoke(
        app,
        ["report", "patching", "--task", str(f), "--split", "validation", "--out", str(tmp_path / "r.html")],
    )
    _one_line_error(r, "with split 'validation'")


def _loader_never_called(monkeypatch):
    """`Run.load` (the model load of every command) fails the test: the command must stop first."""
    from viz.cli.common import Run

    monkeypatch.setattr(Run, "load", lambda *a, **k: pytest.fail("the model loader was called"))


@pytest.mark.parametrize("command", ["serve", "explore"])
def test_a_port_in_use_is_refused_before_the_model_loads(no_load, monkeypatch, command):
    pytest.importorskip("uvicorn")
    _loader_never_called(monkeypatch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = runner.invoke(app, [command, "--port", str(port)])
        _one_line_error(r, f"--port {port} cannot be bound on 127.0.0.1:{port}: ")
        assert "in use" in r.stderr, r.stderr


def test_explore_host_before_load(no_load, monkeypatch):
    pytest.importorskip("uvicorn")
    _loader_never_called(monkeypatch)
    _one_line_error(runner.invoke(app, ["explore", "--host", "not a host"]), "does not resolve")
    _one_line_error(runner.invoke(app, ["serve", "--port", "70000"]), "--port must be in 0..65535, got 70000")


def test_listen_socket_port_0_holds_a_real_port():
    from viz.cli.listen import host_port, listen_socket, url_of

    with listen_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0 and url_of(sock) == f"http://127.0.0.1:{port}"
        with socket.socket() as other:  # held: nobody else can take it while the model loads
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # listening already: the connection is queued in the backlog
    assert host_port("::1", 8000) == "[::1]:8000" and host_port("localhost", 1) == "localhost:1"
    try:
        six = listen_socket("::1", 0)
    except HeadsteerValueError as exc:  # a machine without IPv6: said, never a silent pass
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with six:
        assert url_of(six) == f"http://[::1]:{six.getsockname()[1]}"


@pytest.mark.parametrize(("command", "path"), [("serve", "/v1"), ("explore", "/")])
def test_port_0_prints_the_real_port(tiny_llama, monkeypatch, command, path):
    """`--port 0 --json` prints the port the system chose (the socket handed to uvicorn is the
    one bound before the load), never `:0`."""
    pytest.importorskip("uvicorn")
    import viz.cli.explore
    import viz.cli.listen
    from viz.cli.common import Run

    monkeypatch.setattr(Run, "load", lambda *a, **k: tiny_llama)
    served = []

    def fake_run(app_, sock, **kw):
        served.append(sock.getsockname()[1])
        sock.close()

    monkeypatch.setattr(viz.cli.listen, "run_uvicorn", fake_run)
    monkeypatch.setattr(viz.cli.explore, "run_uvicorn", fake_run)
    r = runner.invoke(app, [command, "--port", "0", "--json"])
    assert r.exit_code == 0, r.output
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(served) == 1 and served[0] > 0
    assert line["url"] == f"http://127.0.0.1:{served[0]}{path}"


def test_run_gave_falls_back_to_the_default_outside_click():
    from viz.cli.common import Run

    assert not Run().gave("alpha", 0.01, 0.01) and Run().gave("alpha", 0.5, 0.01)
    given = Run(user_set=frozenset({"alpha"}))
    assert given.gave("alpha", 0.01, 0.01) and not given.gave("tau", 0.3, 0.1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--max-new-tokens", "100000"],
            "--max-new-tokens 100000 does not fit: the model has 8192 positions",
        ),
        (["--steer", "instaboost", "--max-new-tokens", "9000"], "--max-new-tokens 9000 does not fit"),
        (["--emphasize", "zzz"], "--emphasize 'zzz' is not in the prompt"),
        (["--model", ""], "--model is empty"),
        (["--model", "  "], "--model is empty"),
    ],
)
def test_generate_checks_before_load(no_load, args, message):
    """Found by a breaker: each of these was refused only after the model had loaded (or, for
    an empty --model, announced the embedded model and then refused '')."""
    r = runner.invoke(app, ["generate", "Bio: Ann is a **nurse**. Job?", *args])
    _one_line_error(r, message)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("Bio **\udcff nurse** x", "prompt is not valid UTF-8: byte 0xff at character 6"),
        ("Bio **\udced\udca0\udc80 nurse** x", "prompt is not valid UTF-8: byte 0xed at character 6"),
        ("Bio **\ud800 nurse** x", "prompt has a lone surrogate"),
    ],
)
def test_prompt_bytes_that_are_not_utf8_are_named_before_load(no_load, prompt, message):
    """Bytes that are not UTF-8 on the command line reach Python as U+DC80..U+DCFF (surrogate
    escapes): named as bytes, not as a "lone surrogate" of "prompt 0", before the model loads."""
    r = runner.invoke(app, ["generate", prompt])
    _one_line_error(r, message)


@pytest.mark.parametrize("seed", [str(2**64), "-1"])
@pytest.mark.parametrize(
    "command", [["build", "refusal-model"], ["report", "probes", "--out", "p.html"]], ids=["build", "probes"]
)
def test_seed_out_of_range_before_load(no_load, tmp_path, monkeypatch, command, seed):
    """`--seed 2**64` was an "internal error" after the model loaded (torch's overflow)."""
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, [*command, "--seed", seed])
    _one_line_error(r, "--seed must be")


def test_library_seeds_are_checked():
    from heads import SweepOptions
    from heads.scorers.controls import random_head_draws

    for seed in (2**64, -1, True, 1.5):
        with pytest.raises((ValueError, TypeError), match="seed"):
            SweepOptions(seed=seed)
        with pytest.raises((ValueError, TypeError), match="seed"):
            random_head_draws([(0, 0), (0, 1)], 1, 1, seed, generator="python")


@pytest.mark.parametrize(
    "args",
    [
        ["build", "refusal-model", "--out", ""],
        ["report", "attention", "--prompt", "a **b**", "--out", ""],
        ["eval", "--task", "counterfact", "--out="],
    ],
)
def test_an_empty_path_option_is_refused(no_load, args):
    """click reads `--out ''` as the current folder: `build refusal-model` then started a
    fine-tune writing into the working folder (found by a breaker)."""
    r = runner.invoke(app, args)
    _one_line_error(r, "--out is empty: give a path")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1e-30", "--max-memory must be at least 1.05 MB"),
        ("0", "at least"),
        ("24XB", "--max-memory must be a size"),
    ],
)
def test_circuit_max_memory_refusals(no_load, tmp_path, value, message):
    r = runner.invoke(app, ["report", "circuit", "--max-memory", value, "--out", str(tmp_path / "c.html")])
    _one_line_error(r, message)


def test_circuit_max_memory_takes_plan_forms(no_load, tmp_path):
    """`24GB` (plan's form) is accepted: the command goes on to load the model."""
    r = runner.invoke(app, ["report", "circuit", "--max-memory", "24GB", "--out", str(tmp_path / "c.html")])
    assert "the model was loaded" in r.output and "max-memory" not in r.output


def test_parse_gib_reads_gib_and_units():
    from heads.planning.units import parse_gib

    assert parse_gib(2) == 2.0 and parse_gib("0.5") == 0.5
    assert parse_gib("24GB") == 24e9 / 2**30 and parse_gib("512MiB") == 0.5
    with pytest.raises(HeadsteerValueError, match="at least"):
        parse_gib(1e-30)


@pytest.mark.parametrize("value", ["9" * 5000, "12345"])
def test_plan_devices_odd_digits_are_named(value):
    from viz.cli.plan import _devices

    with pytest.raises(HeadsteerValueError, match="--devices"):
        _devices(value)
