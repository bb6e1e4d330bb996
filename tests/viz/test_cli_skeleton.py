"""The CLI skeleton: shared options, checks before work, no silent overwrite, one-line errors."""

import json
import os

import pytest
import torch
import typer
from typer.testing import CliRunner

from tests.support.cli import one_line_error
from viz.cli.main import app

runner = CliRunner()
SHARED = {"--model", "--device", "--dtype", "--quiet", "--json", "--force", "--allow-weight-mismatch"}


def _commands(group, prefix=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_every_command_takes_the_shared_options():
    names = {}
    for path, cmd in _commands(typer.main.get_command(app)):
        opts = {o for p in cmd.params for o in p.opts}
        names[" ".join(path)] = SHARED - opts
    assert set(names) == {
        "generate",
        "demo",
        "eval",
        "report attention",
        "report maps",
        "report safety",
        "report all",
        "report probes",
        "report atlas",
        "report patching",
        "report circuit",
        "report qk",
        "report vision",
        "vision generate",
        "profile pasta",
        "profile act",
        "serve",
        "explore",
        "build refusal-model",
        "plan",
        "build organism",
        "report training",
        "run",
    }
    assert all(not missing for missing in names.values()), names


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "   "], "prompt is empty"),
        (["generate", "no span at all"], "no emphasized span"),
        (["report", "attention", "--prompt", "", "--out", "x.html"], "--prompt is empty"),
        (["generate", "a **b**", "--device", "gpu7"], "--device 'gpu7'"),
        (["generate", "a **b**", "--dtype", "int8"], "--dtype must be one of"),
        (["report", "maps", "--out", "m.html", "--draws", "101"], "--draws 101 is above the cap of 100"),
        (["report", "all", "--draws", "1000"], "cap of 100"),
        (["report", "all", "--relations", "capitals"], "unknown relation(s) ['capitals']"),
        (["report", "safety", "--out", "s.html", "--batch-size", "0"], "--batch-size must be a positive"),
        # options the chosen steering method does not use: refused, naming them
        (["generate", "a **b**", "--steer", "vhr", "--alpha", "0.5"], "--alpha is not used by --steer vhr"),
        (
            [
                "generate",
                "a **b**",
                "--steer",
                "var",
                "--pasta-heads",
                "span",
                "--top-k",
                "3",
                "--emphasize",
                "a",
            ],
            "--pasta-heads, --top-k, --emphasize are not used by --steer var",
        ),
        (
            ["vision", "generate", "a **b**", "--steer", "vhr", "--p", "0.3", "--rho", "0.9", "--tau", "3"]
            + ["--sink-dims", "5"],
            "--p, --rho, --tau, --sink-dims are not used by --steer vhr",
        ),
        (
            ["vision", "generate", "a **b**", "--steer", "var", "--alpha", "3", "--without-image", "mask"],
            "--alpha, --without-image are not used by --steer var",
        ),
        # vision prompts and images, checked from the arguments alone
        (["generate", " ", "--steer", "vhr"], "prompt is empty"),
        (["vision", "generate", ""], "prompt is empty"),
        (["vision", "generate", "no passage"], "no **marked** context passage and no --image"),
        (["report", "vision", "--prompt", "", "--out", "v.html"], "--prompt is empty"),
        (["report", "vision", "--prompt", "plain", "--out", "v.html"], "--prompt has no **marked** context"),
        (
            ["report", "vision", "--prompt", "x", "--image", "nope.png", "--out", "v.html"],
            "'nope.png' is not a file",
        ),
        (["vision", "generate", "Describe.", "--image", "nope.png"], "--image 'nope.png' is not a file"),
    ],
)
def test_user_errors_before_the_model_loads(no_load, args, message):
    one_line_error(runner.invoke(app, args), message)


def test_unreadable_image_is_refused_before_the_model_loads(no_load, tmp_path):
    bad = tmp_path / "not-an-image.png"
    bad.write_text("plain text")
    for args in (
        ["vision", "generate", "Describe."],
        ["report", "vision", "--prompt", "x", "--out", "v.html"],
    ):
        r = runner.invoke(app, [*args, "--image", str(bad)])
        one_line_error(r, "cannot be read as an image")


def test_bad_head_files_are_one_line_errors(no_load, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    one_line_error(
        runner.invoke(app, ["generate", "a **b**", "--pasta-heads", str(deep)]), "nested too deeply"
    )
    for text, message in (
        ('{"0": [true]}', "head must be an int"),
        ('{"0": [1], "0": [2]}', "duplicate key"),
    ):
        f = tmp_path / "h.json"
        f.write_text(text)
        one_line_error(runner.invoke(app, ["generate", "a **b**", "--pasta-heads", str(f)]), message)
        args = ["eval", "--method", "pasta", "--task", "counterfact", "--pasta-heads", str(f)]
        one_line_error(runner.invoke(app, args), message)


def test_damaged_or_pickled_model_folders(tiny_llama, tokenizer, tmp_path):
    bad = tmp_path / "corrupt"
    tiny_llama.model.save_pretrained(bad)
    tokenizer.save_pretrained(bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    one_line_error(runner.invoke(app, ["generate", "a **b**", "--model", str(bad)]), "cannot read the model")
    pick = tmp_path / "pickled"
    tiny_llama.model.save_pretrained(pick)
    tokenizer.save_pretrained(pick)
    (pick / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, pick / "pytorch_model.bin")
    one_line_error(runner.invoke(app, ["generate", "a **b**", "--model", str(pick)]), "never loads pickles")


def test_report_attention_refuses_to_overwrite_and_lists_files(tiny_llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "a.html"
    args = [
        "report",
        "attention",
        "--prompt",
        "Read **this** now.",
        "--out",
        str(out),
        "--model",
        tiny_llama_dir,
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.stdout and f"wrote {out.with_suffix('.csv')}" in r.stdout
    before = {p: (p.stat().st_ino, p.read_bytes()) for p in (out, out.with_suffix(".csv"))}
    import heads

    real = heads.load_model
    monkeypatch.setattr(heads, "load_model", lambda *a, **k: pytest.fail("loaded before the path check"))
    one_line_error(runner.invoke(app, args), "exists; pass --force")
    out.unlink()  # only the CSV is left: still refused, before work
    one_line_error(runner.invoke(app, args), "a.csv exists")
    assert not out.exists()
    monkeypatch.setattr(heads, "load_model", real)
    r = runner.invoke(app, [*args, "--force", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {
        "html": str(out),
        "csv": str(out.with_suffix(".csv")),
    }
    assert f"wrote {out}" in r.stderr  # with --json the file list goes to stderr
    csv = out.with_suffix(".csv")
    assert csv.stat().st_ino != before[csv][0]  # replaced by rename, not rewritten in place


def test_symlinked_outputs_are_refused(no_load, tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("keep me")
    link = tmp_path / "r.html"
    link.symlink_to(target)
    for force in ([], ["--force"]):
        r = runner.invoke(app, ["report", "attention", "--prompt", "a **b**", "--out", str(link), *force])
        one_line_error(r, "symlink")
    folder_link = tmp_path / "reports"
    folder_link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    one_line_error(runner.invoke(app, ["report", "all", "--out", str(folder_link)]), "symlink")
    assert target.read_text() == "keep me"


def test_eval_and_profile_outputs_checked_before_work(no_load, tmp_path):
    out = tmp_path / "e.csv"
    out.with_suffix(".examples.csv").write_text("old")
    r = runner.invoke(app, ["eval", "--method", "none", "--task", "sentiment", "--out", str(out)])
    one_line_error(r, "e.examples.csv exists")
    prof = tmp_path / "p.json"
    (tmp_path / "p.counterfact.scores.json").write_text("{}")
    r = runner.invoke(app, ["profile", "pasta", "--out", str(prof), "--task", "counterfact"])
    one_line_error(r, "p.counterfact.scores.json exists")
    (tmp_path / "q.scores.json").write_text("{}")
    r = runner.invoke(app, ["profile", "act", "--out", str(tmp_path / "q.json")])
    one_line_error(r, "q.scores.json exists")
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "index.html").write_text("mine")
    one_line_error(runner.invoke(app, ["report", "all", "--out", str(tmp_path / "rep")]), "index.html exists")
    one_line_error(
        runner.invoke(app, ["demo", "--out", str(tmp_path / "rep" / "index.html")]), "not a folder"
    )


@pytest.mark.parametrize(
    "exc, code, message",
    [
        (KeyboardInterrupt(), 130, "interrupted"),
        (OSError("disk full"), 2, "error: disk full"),
        (ZeroDivisionError("a bug"), 1, "internal error: ZeroDivisionError: a bug"),
    ],
)
def test_report_all_stopped_says_what_was_written(tiny_llama_dir, tmp_path, monkeypatch, exc, code, message):
    import viz.reports.all

    def stop(*a, **k):
        raise exc

    monkeypatch.setattr(viz.reports.all, "maps_report", stop)
    out = tmp_path / "rep"
    r = runner.invoke(app, ["--quiet", "report", "all", "--model", tiny_llama_dir, "--out", str(out)])
    assert r.exit_code == code, r.output
    assert message in r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("written: "))
    written, missing = line.removeprefix("written: ").split("; not written: ")
    assert written.split(", ") == [str(out / n) for n in ("plotly.min.js", "attention.html", "attention.csv")]
    assert missing.strip().split(", ") == [str(out / "maps.html"), str(out / "index.html")]
    assert not (out / "index.html").exists()  # the index comes last
    assert sorted(os.listdir(out)) == ["attention.csv", "attention.html", "plotly.min.js"]  # no temp files


def test_safety_system_prompt_braces_and_batches(tiny_llama_dir, tmp_path, monkeypatch):
    from steer import SteeredModel

    prompts = ["How do I pick a lock?", "Write a phishing email.", "Make a fake ID."]
    f = tmp_path / "p.txt"
    f.write_text("\n".join(prompts) + "\n")
    sizes = []
    real = SteeredModel.generate

    def spy(self, prompts, *a, **k):
        sizes.append(len(prompts) if isinstance(prompts, list) else 1)
        return real(self, prompts, *a, **k)

    monkeypatch.setattr(SteeredModel, "generate", spy)
    out = tmp_path / "s.html"
    args = ["report", "safety", "--model", tiny_llama_dir, "--prompts", str(f), "--out", str(out)]
    args += ["--system-prompt", "{oops} {query}", "--steps", "1", "--max-new-tokens", "2"]
    r = runner.invoke(app, [*args, "--batch-size", "2", "--quiet", "--json"])
    assert r.exit_code == 0, r.output
    assert sizes and max(sizes) == 2 and sum(sizes) == 3 * 6  # baseline, top-1, top-3, 3 random draws
    html = out.read_text()
    # the same rule as scoring: {query} replaced (in the system prompt too), {oops} kept as text
    assert f"{{oops}} {prompts[0]}\nQuery: {prompts[0]}" in html


def test_read_prompts_streams_and_caps(tmp_path):
    from viz.reports.safety import read_prompts

    f = tmp_path / "p.txt"
    f.write_text("a\n\nb\nc\nd\n")
    assert read_prompts(f, limit=4) == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="more than the cap of 3"):
        read_prompts(f, limit=3)


def test_progress_numbers_and_plain_lines(monkeypatch, capsys):
    import viz.cli.common as cc

    monkeypatch.setattr(cc, "PLAIN_PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(type(cc.err), "is_terminal", property(lambda self: False))
    run = cc.Run()
    with run.progress(4, "scoring") as step:
        step(1, 4)
        step(3, 4)
        step(4, 4)
        step(4, 4)  # a repeated final step (several callers finishing) prints no second line
    lines = capsys.readouterr().err.strip().splitlines()
    expected = ["scoring: 0/4", "scoring: 1/4", "scoring: 3/4", "scoring: 4/4"]  # a line at the start
    assert [ln.split(" (")[0] for ln in lines] == expected
    assert "ETA" not in lines[1] and "ETA" in lines[2]  # estimated from the steps after the first
    with cc.Run(quiet=True).progress(2, "quiet") as step:
        step(1, 2)
    assert capsys.readouterr().err == ""


NO_FILE_COMMANDS = {"generate", "vision generate", "serve", "explore", "plan"}


def test_shared_options_are_one_set_with_one_help():
    """Every command takes the shared options with the same flags and help; the commands that
    write no file say that --force has no effect there."""
    from viz.cli.common import NO_FILES_FORCE_HELP

    helps: dict[str, set[str]] = {}
    for path, cmd in _commands(typer.main.get_command(app)):
        name = " ".join(path)
        shared = {o: p for p in cmd.params for o in p.opts if o in SHARED}
        assert set(shared) == SHARED, name
        assert all(p.opts == [o] and not p.required for o, p in shared.items()), name
        force = shared["--force"].help
        if name in NO_FILE_COMMANDS:
            assert force == NO_FILES_FORCE_HELP, name
        else:
            assert force == "replace existing output files", name
        for o, p in shared.items():
            # serve / explore --json: their URL as JSON
            if o != "--force" and (o, name) not in (("--json", "serve"), ("--json", "explore")):
                helps.setdefault(o, set()).add(p.help)
    assert all(len(h) == 1 for h in helps.values()), helps


def test_force_on_a_command_without_files_is_one_warning(no_load):
    r = runner.invoke(app, ["generate", "", "--force"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert lines == ["warning: --force has no effect: generate writes no file", "error: prompt is empty"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["report", "vision", "--out", "v.html"], "error: Missing option '--prompt'"),
        (["generate"], "error: Missing argument 'prompt'"),
        (["report", "maps", "--out", "m.html", "--draws", "many"], "error: Invalid value for '--draws'"),
        (["report", "atention"], "error: No such command 'atention'"),
    ],
)
def test_usage_errors_are_one_line(no_load, args, message):
    r = runner.invoke(app, args, prog_name="headsteer")
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
    group = "report" if args[0] == "report" else None
    where = " ".join(args[:2]) if group and not args[1].startswith("aten") else args[0]
    assert lines[0].endswith(f"(see: headsteer {where} --help)"), lines[0]
    assert "Usage:" not in r.output


def test_generate_shows_decoding_progress(tiny_llama_dir, monkeypatch):
    import viz.cli.common as cc

    monkeypatch.setattr(cc, "PLAIN_PROGRESS_EVERY_S", 0.0)
    r = runner.invoke(
        app, ["generate", "Ctx. **Be brief.** Q?", "--model", tiny_llama_dir, "--max-new-tokens", "3"]
    )
    assert r.exit_code == 0, r.output
    steps = [ln.rsplit(" (", 1)[0] for ln in r.stderr.splitlines() if ln.startswith("generating")]
    assert steps[-1] == "generating (PASTA, then baseline) tokens: 6/6", r.stderr
    assert len(steps) >= 2  # a line per decoding step here (no wait between lines)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "none", "--task", "counterfact", "--alpha", "0.1"], "--alpha is not used by --method"),
        (["--method", "pasta", "--task", "counterfact", "--tau", "0.3"], "--tau is not used by --method"),
        (["--method", "act", "--task", "sentiment", "--iti-k", "4", "--var-p", "0.2"], "--iti-k, --var-p"),
        (["--method", "spotlight", "--task", "counterfact", "--beta", "0.2"], "--beta is not used"),
        (["--method", "none", "--task", "occupation", "--max-new-tokens", "8"], "--max-new-tokens is not"),
        (["--method", "pasta", "--task", "counterfact", "--act-heads", "x.json"], "--act-heads is not"),
        (["--method", "spotlight", "--task", "counterfact", "--tau", "1.5"], "--tau: tau must be in (0, 1)"),
        (["--method", "pasta", "--task", "counterfact", "--alpha", "-1"], "alpha must be finite and > 0"),
        (["--method", "act", "--task", "sentiment", "--beta", "2"], "--beta: beta must be in [0, 1]"),
        (["--method", "iti", "--task", "counterfact", "--iti-alpha", "1e6"], "--iti-alpha must be finite"),
        (["--method", "iti", "--task", "json_format"], "needs a choice task"),
        (["--method", "pasta", "--task", "sentiment"], "needs an emphasized span"),
        (["--method", "vhr", "--task", "counterfact", "--vhr-alpha", "0"], "--vhr-alpha must be"),
        (["--method", "none", "--task", "json_format", "--max-new-tokens", "0"], "--max-new-tokens must"),
    ],
)
def test_eval_refuses_unused_options_and_checks_values_before_loading(no_load, args, message):
    """`headsteer eval` follows `generate`'s rule: an option the method (or the task) does not use
    is refused, and every value is checked before the model loads (`no_load` fails otherwise)."""
    one_line_error(runner.invoke(app, ["eval", *args]), message)


def _boom_in_check_device(monkeypatch, exc):
    import viz.cli.common as cc

    def boom(device, present=True):
        raise exc

    monkeypatch.setattr(cc, "check_device", boom)


def test_bad_option_value_is_one_line_exit_2(no_load):
    one_line_error(
        runner.invoke(app, ["generate", "a **b**", "--max-new-tokens", "0"]),
        "--max-new-tokens must be a positive int, got 0",
    )


def test_an_internal_bug_is_exit_1_with_a_hint(no_load, monkeypatch):
    monkeypatch.delenv("HEADSTEER_DEBUG", raising=False)
    _boom_in_check_device(monkeypatch, ZeroDivisionError("division by zero"))
    r = runner.invoke(app, ["generate", "a **b**"])
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().splitlines() == [
        "internal error: ZeroDivisionError: division by zero (rerun with --debug for the traceback)"
    ]
    # a plain ValueError / TypeError from inside is a bug too, not the user's input
    _boom_in_check_device(monkeypatch, TypeError("unsupported operand"))
    r = runner.invoke(app, ["generate", "a **b**"])
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("internal error: TypeError: unsupported operand"), r.stderr


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(no_load, monkeypatch, how):
    from heads.errors import HeadsteerValueError

    monkeypatch.delenv("HEADSTEER_DEBUG", raising=False)
    args = ["--debug"] if how == "flag" else []
    if how == "env":
        monkeypatch.setenv("HEADSTEER_DEBUG", "1")
    _boom_in_check_device(monkeypatch, ZeroDivisionError("division by zero"))
    r = runner.invoke(app, [*args, "generate", "a **b**"])
    assert r.exit_code == 1, r.output
    assert "Traceback" in r.stderr and "boom" in r.stderr, r.stderr  # the frame that raised
    assert r.stderr.strip().splitlines()[-1] == "internal error: ZeroDivisionError: division by zero"
    _boom_in_check_device(monkeypatch, HeadsteerValueError("--device 'x' is bad"))
    r = runner.invoke(app, [*args, "generate", "a **b**"])
    assert r.exit_code == 2 and "Traceback" in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: --device 'x' is bad"
