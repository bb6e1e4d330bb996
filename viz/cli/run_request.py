"""`headsteer run REQUEST.json`: run any analysis request written as JSON (`Request.to_json`).

The request is read and checked (`Request.from_json`: its name, its version, every field) and
then checked against `--model`'s config (`Request.check_config`), the inputs file is read and
encoded with the tokenizer (an answer of several tokens, pair prompts of different token
lengths, a prompt longer than the model's positions are refused) and the output path checked:
all before any weight loads. The model then runs it through
`heads.run` and the result is saved (`Result.save`) to `--out`, never over an existing file
without `--force`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from heads.errors import HeadsteerValueError
from viz.cli.common import Run, _positive

__all__ = ["NO_INPUT", "PAIRS", "PROMPTS", "check_inputs", "run_request"]

PAIRS = ("patch", "path_patch", "direct_logit_attribution", "logit_lens", "knockout", "find_circuit")
"""Requests whose input is prompt pairs: `--inputs` is a shipped pair set or a pairs JSONL file."""
PROMPTS = (
    "ships",
    "dataset_ships",
    "sahara",
    "attribution_patching",
    "sink_stats",
    "find_sink_dims",
    "qk_attribution",
    "train_lens",
    "composition_scores",
)
"""Requests whose input is text prompts: `--inputs` is a prompt file (one per line, or JSONL with
`"prompt"` / `"text"`); `composition_scores` only with `method="data"`."""
NO_INPUT = ("detect_roles", "maps_scores", "composition_scores")
"""Requests run without `--inputs`: the detectors' own sequences, MAPS on the shipped relations,
composition scores from the weights."""


def _read_inputs(name: str, inputs: str | None, n: int, needs: bool) -> Any:
    """The inputs of request `name` read from `inputs` (no model needed), or None."""
    if not needs:
        if inputs is not None:
            raise typer.BadParameter(f"a {name} request takes no inputs here", param_hint="--inputs")
        return None
    if inputs is None:
        raise typer.BadParameter(f"a {name} request needs its inputs", param_hint="--inputs")
    if name in PAIRS:
        from viz.reports.patching import resolve_pairs

        return resolve_pairs(inputs, n=n, option="--inputs")
    from viz.reports.qk import read_prompt_file

    return read_prompt_file(inputs)[:n]


def check_inputs(
    model: str | None,
    given: Any,
    *,
    pairs: bool,
    option: str = "--inputs",
    template: str | None = None,
    chat: bool | None = False,
    markup: bool = False,
) -> Any:
    """Check `given` (prompt pairs when `pairs`, else text prompts) with `model`'s tokenizer and
    config alone, before any weight is read: a pair's answer that is not one token, clean and
    corrupted prompts of different token lengths (`encode_pairs`, plain text), a prompt longer
    than the model's positions (the message names `option`, the flag the inputs came from).
    Text prompts are counted as the analysis encodes them: put into `template` (a `{query}`
    template, as the safety analyses do), rendered with the chat template when `chat` (None:
    when the tokenizer has one), `**markup**` read when `markup` (`encode_prompts`).
    Returns the pairs as the tokenizer encodes them (a `PairBatch`), or the text prompts' token
    lengths (a list).

    Raises:
        HeadsteerValueError: the first of these, as the analysis would raise it after loading.
    """
    from heads.model.loading import load_tokenizer, read_max_positions

    tok = load_tokenizer(model)
    limit = read_max_positions(model)
    if pairs:
        from heads.scorers.patching.pairs import encode_pairs

        encoded = encode_pairs(tok, given)
        lengths = [int(encoded.clean_ids.shape[1])]
    else:  # as the analysis encodes them: its template, its chat template, its markup
        from heads.inputs.prompts import encode_prompts
        from heads.scorers.safety.common import fill_template

        texts = fill_template(template, [str(p) for p in given])
        lengths = [int(encode_prompts(tok, [t], chat=chat, markup=markup).input_ids.shape[1]) for t in texts]
    longest = max(lengths, default=0)
    if limit is not None and longest > limit:
        raise HeadsteerValueError(
            f"{option}: a sequence of {longest} tokens exceeds the model's limit of {limit} positions"
        )
    return encoded if pairs else lengths


def check_budget(run: Run, req: Any, checked: Any, options: Any) -> None:
    """Refuse `--max-memory` below the request's minimum from the config alone, before the weights
    load (`heads.planning.budget.check_budget`): the inputs' longest row (`checked`: the encoded
    pairs or the prompts' lengths; None: inputs of no known length, one token) and their count."""
    if options.max_memory is None:
        return
    from heads.model.loading import check_dtype
    from heads.planning.budget import check_budget as check
    from heads.planning.requests import NO_PLAN

    if req.NAME in NO_PLAN:  # refused by name before the weights (heads.run refuses it after)
        raise HeadsteerValueError(f"a {req.NAME} request takes no --max-memory: {NO_PLAN[req.NAME]}")

    if checked is None:
        tokens, rows = 1, 1
    elif isinstance(checked, list):
        tokens, rows = max(checked, default=1), max(1, len(checked))
    else:
        tokens, rows = int(checked.width), int(checked.n)
    dtype = check_dtype(run.dtype)
    check(run.model, req, tokens, options.max_memory, rows, dtype, run.device, "--max-memory")


def run_request(
    run: Run,
    request: Annotated[Path, typer.Argument(help="the request as JSON (Request.to_json), a file")],
    out: Annotated[Path, typer.Option(help="file the result is saved to (the result's save format)")],
    inputs: Annotated[
        str | None,
        typer.Option(
            help="the analysis' input: for pair analyses (patch, path_patch, DLA, lens, knockout, "
            "find_circuit) a shipped pair set (ioi, colored_objects, comp_mech; its test split, "
            "the first --n pairs) or a pairs JSONL file (every record, whatever its split); "
            "for prompt analyses (ships, sahara, sinks, qk_attribution, train_lens, "
            "composition_scores method=data, ...) a prompt file; none for detect_roles, "
            "maps_scores (the shipped relations) and composition_scores from the weights"
        ),
    ] = None,
    n: Annotated[
        int, typer.Option(help="the first N pairs or prompts of --inputs, at most (all of a shorter file)")
    ] = 16,
    max_rows: Annotated[
        int, typer.Option(help="rows per forward of the analyses that sweep (SweepOptions.max_rows)")
    ] = 64,
    max_memory: Annotated[
        str | None,
        typer.Option(help="memory budget of a sweep: 24GB, 512MiB or bytes (SweepOptions.max_memory)"),
    ] = None,
) -> dict:
    """Run an analysis request written as JSON and save its result."""
    from heads.scorers.request_base import Request
    from viz.cli.requests import check_request, sweep_options

    _positive(n=n)
    options = sweep_options(
        {"max_rows": "--max-rows", "max_memory": "--max-memory"},
        max_rows=max_rows, max_memory=max_memory, progress=not run.quiet,
    )  # fmt: skip
    if not request.is_file():
        raise typer.BadParameter(f"no request file {str(request)!r}", param_hint="REQUEST")
    from heads._util.validation import read_text_file

    req = Request.from_json(read_text_file(request))  # a bad request (or not UTF-8): one line, exit 2
    name = req.NAME
    if name not in (*PAIRS, *PROMPTS, *NO_INPUT):
        raise HeadsteerValueError(
            f"a {name} request is not run by `headsteer run` (its inputs are Python objects): run it "
            f"with heads.run(model, request, inputs)"
            + ("; or `headsteer report atlas`" if name == "head_atlas" else "")
        )
    weights_only = name == "composition_scores" and getattr(req, "method", None) == "weights"
    needs = name in PAIRS or (name in PROMPTS and not weights_only)
    given = _read_inputs(name, inputs, n, needs)
    out = run.output(out)
    check_request(run, {}, req)  # against the model's config, before the weights
    encoded: Any = None
    if given is not None:
        template = getattr(req, "template", None)  # the safety analyses' `{query}` template
        encoded = check_inputs(  # tokenizer + config only, the prompts as the analysis encodes them
            run.model,
            given,
            pairs=name in PAIRS,
            template=template if isinstance(template, str) else None,
            chat=getattr(req, "chat", False),
            markup=bool(getattr(req, "markup", False)),
        )
        check_pairs = getattr(req, "check_pairs", None)
        if name in PAIRS and check_pairs is not None:
            check_pairs(encoded)  # e.g. DLA / lens positions against the pairs' width, before the weights
    check_budget(run, req, encoded, options)  # --max-memory: the config only, before the weights
    hm = run.load()
    from heads import run as run_analysis

    if name in PAIRS:
        from heads.scorers.patching.pairs import encode_pairs

        given = encode_pairs(hm, given)
    elif name == "maps_scores":
        from probes.datasets.relations import load_relations

        given = load_relations(hm.tokenizer, d_vocab=hm.d_vocab).relations
    with run.status(f"running {name}…"):
        args = () if given is None else (given,)
        result = run_analysis(hm, req, *args, options=options)
    save = getattr(result, "save", None)
    if save is None:  # pragma: no cover - every result follows heads.results.protocol.Result
        raise HeadsteerValueError(f"the {name} result ({type(result).__name__}) cannot be saved")
    path = save(out, overwrite=run.force)
    return {"request": name, "result": str(path), "model": hm.name}
