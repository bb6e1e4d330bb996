"""Evaluation harness: one steering method on one task, with the task's metrics and 95% intervals.

Methods: `none` (the unsteered model), `pasta`, `spotlight`, `instaboost`, `var`, `vhr`, `adaptvis`,
`scalingvis` (these seven need the task's emphasized span; the VAR, VHR, AdaptVis and ScalingVis
text variants treat it as the "image"), `act`, `iti` (probes fitted on the task's train split) and
`caa` (a CAA vector from contrastive pairs of the task's train split, `fit_caa`; choice tasks).
Choice tasks are scored from last-position log-probs (argmax over each choice's first token,
`steer.act.calibration.choice_ids`);
generate tasks by greedy generation through `SteeredModel.generate` (KV cache on) and the
task's text metrics:

| task | metrics |
|---|---|
| json_format | `json_valid` (a parseable JSON object), `field_accuracy` (name and occupation right) |
| pronoun_change | `no_she_he` (no she/he/her/his/him left), `occupation_named` |
| occupation | `top1` over the 15 occupations |
| counterfact | `efficacy` (P(new fact) > P(old fact)) |
| sentiment | `accuracy` |
| context_qa | `context_accuracy` (P(passage's value) > P(true value)) |

Binary metrics get a Wilson interval, means a Student-t interval (`probes.metrics.tasks`, through
scipy); the table's `interval` column names the method.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import pandas as pd
import torch

from heads import HeadModel, encode_prompts, forward
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_bool, check_int, short_repr
from heads.engine.context import editing
from heads.errors import HeadsteerValueError
from heads.results.scores import HeadSet, HeadSpec
from probes.datasets.tasks import TaskExample, load_task
from probes.metrics.tasks import (
    INTERVAL_METHODS,
    choice_correct,
    json_metrics,
    mean_interval,
    no_pronoun,
    wilson_interval,
)

__all__ = ["METHODS", "EvalResult", "caa_pairs", "evaluate", "fit_caa", "method_steer"]

METHODS = (
    "none", "pasta", "spotlight", "instaboost", "act", "var", "vhr", "iti", "adaptvis", "scalingvis", "caa",
)  # fmt: skip
SPAN_METHODS = ("pasta", "spotlight", "instaboost", "var", "vhr", "adaptvis", "scalingvis")
"""Methods that steer towards the task's emphasized span (a task without one is refused)."""
CAA_COEFFICIENT = 4.0
"""`fit_caa` / `headsteer eval --method caa` default coefficient (docs/methods/caa.md: picked on
the validation splits of counterfact and sentiment from 1, 2, 4, 8 on the embedded model)."""


@dataclass
class EvalResult:
    """`table`: one row per metric (`task, method, prompt, split, metric, value, n, low, high,
    interval`; `prompt` True for the prompting baseline (`evaluate(prompt=True)`); `interval`
    names how low/high were computed: "Wilson 95%" for rates, "Student t 95%" for means);
    `examples`: one row per example (id, per-example metric values, output text if generated)."""

    table: pd.DataFrame
    examples: pd.DataFrame

    def __repr__(self) -> str:
        t = self.table
        if t.empty:
            return "EvalResult(no metrics)"
        method = t.method.iloc[0]
        if "prompt" in t and bool(t.prompt.iloc[0]):
            method = "prompt" if method == "none" else f"prompt + {method}"
        head = f"{t.task.iloc[0]} / {method} ({t.split.iloc[0]}, n={t.n.iloc[0]})"
        metrics = "; ".join(
            f"{r.metric} {r.value:.3f} [{r.low:.3f}, {r.high:.3f}] ({r.interval})" for r in t.itertuples()
        )
        return f"EvalResult({head}: {metrics})"

    def _repr_html_(self) -> str:
        table = self.table.to_html(index=False, float_format="%.3f")
        return f"<div><b>{html.escape(repr(self))}</b>{table}</div>"


def method_steer(
    model: HeadModel,
    method: str,
    *,
    pasta_heads: HeadSpec | None = None,
    alpha: float = 0.01,
    tau: float = 0.1,
    act_heads: HeadSpec | None = None,
    beta: float = 0.4,
    iti=None,
    var_p: float = 0.6,
    var_rho: float = 0.5,
    vhr_alpha: float = 2.0,
    multiplier: float | None = None,
    weight: float | None = None,
    weight1: float | None = None,
    weight2: float | None = None,
    threshold: float | None = None,
    caa=None,
) -> list:
    """The interventions of `method` (a list, empty for `none`).

    `pasta_heads` / `act_heads`: any head selection (`heads.HeadSpec`), or None for the
    shipped profile of the embedded model (`steer.profiles`). `iti`: a fitted `steer.Iti`
    (`evaluate` fits one on the task's train split, `probes.head_probes.fit_iti`). `weight`
    (ScalingVis), `weight1`, `weight2`, `threshold` (AdaptVis): None for the method's defaults.
    `caa`: a `steer.Caa` (`evaluate` fits one on the task's train split, `fit_caa`).

    Raises:
        ValueError: unknown method, or no head selection and no shipped profile for this model.
    """
    from steer import Pasta, Spotlight
    from steer.act.method import Act
    from steer.profiles import shipped_profile

    if method not in METHODS:
        raise HeadsteerValueError(f"unknown method {short_repr(method)}: use one of {', '.join(METHODS)}")
    if method == "none":
        return []
    if method == "spotlight":
        return [Spotlight(tau=tau)]
    if method == "instaboost":
        from steer.instaboost import DEFAULT_MULTIPLIER, InstaBoost

        return [InstaBoost(multiplier=DEFAULT_MULTIPLIER if multiplier is None else multiplier)]
    if method == "iti":
        if iti is None:
            raise HeadsteerValueError(
                "method 'iti' needs a fitted steer.Iti (iti=...; see probes.head_probes.fit_iti)"
            )
        return [iti]
    if method in ("adaptvis", "scalingvis"):
        from steer.adaptvis import AdaptVis, ScalingVis

        given = dict(weight=weight, weight1=weight1, weight2=weight2, threshold=threshold)
        keys = ("weight",) if method == "scalingvis" else ("weight1", "weight2", "threshold")
        kw = {k: given[k] for k in keys if given[k] is not None}
        return [ScalingVis(**kw)] if method == "scalingvis" else [AdaptVis(**kw)]
    if method == "caa":
        if caa is None:
            raise HeadsteerValueError("method 'caa' needs a steer.Caa (caa=...; see fit_caa)")
        return [caa]
    if method in ("var", "vhr"):
        from steer import Var, Vhr

        return [Var(p=var_p, rho=var_rho)] if method == "var" else [Vhr(alpha=vhr_alpha)]
    kind = "pasta" if method == "pasta" else "act"
    heads = pasta_heads if method == "pasta" else act_heads
    if heads is None:
        heads = shipped_profile(kind, model.name)
    heads = HeadSet.parse(heads, model.n_layers, model.n_heads)
    return [Pasta(heads=heads, alpha=alpha)] if method == "pasta" else [Act(heads=heads, beta=beta)]


def caa_pairs(task: str, split: str = "train", limit: int | None = None) -> list[tuple[str, str]]:
    """Contrastive pairs of a choice task: `(prompt + " " + right choice, prompt + " " + a wrong one)`.

    The wrong choice of example i is `choices[(label + 1 + i % (n - 1)) % n]` (the other one of
    two; cycling through the wrong ones of more). The right answer is each example's own, so
    across examples the answer words are balanced (the paper's A/B design) and the mean difference
    is the direction of answering right, not of one answer word.

    Raises:
        ValueError: an unknown task or split, or a task scored by generation.
    """
    examples = load_task(task, split).examples[:limit]
    if examples[0].choices is None:
        raise HeadsteerValueError(
            f"CAA needs a choice task (contrastive answers), {short_repr(task)} is scored by generation"
        )
    pairs = []
    for i, e in enumerate(examples):
        assert e.choices is not None and e.label is not None  # every example of a choice task
        n = len(e.choices)
        wrong = (e.label + 1 + i % (n - 1)) % n
        pairs.append((f"{e.prompt} {e.choices[e.label]}", f"{e.prompt} {e.choices[wrong]}"))
    return pairs


def fit_caa(
    model: HeadModel,
    task: str,
    *,
    layer: int | None = None,
    coefficient: float = CAA_COEFFICIENT,
    batch_size: int = 8,
    limit: int | None = None,
    progress: ProgressArg = False,
):
    """`steer.Caa` from the train split of a choice task (`caa_pairs`; never its test split).

    Args:
        layer: the decoder block whose output is read and steered (default `n_layers // 2`).
        coefficient: the multiplier (default `CAA_COEFFICIENT`).

    Raises:
        ValueError: a task without choices, a bad layer or coefficient (see `steer.Caa`).

    Source: Rimsky et al. 2024 §3 (mean difference at the answer token over A/B pairs).
    """
    from steer.caa import Caa

    pairs = caa_pairs(task, "train", limit)
    layer = model.n_layers // 2 if layer is None else layer
    from heads.engine.options import SweepOptions

    options = SweepOptions(max_rows=2 * batch_size, progress=progress)  # two rows per pair
    return Caa.from_pairs(model, pairs, layer, coefficient, chat=False, options=options)


def _choice_rows(model: HeadModel, examples: list[TaskExample], steer: list, batch_size: int, step):
    from steer.act.calibration import choice_ids

    rows = []
    for a in range(0, len(examples), batch_size):
        chunk = examples[a : a + batch_size]
        emph = [[e.emphasize] for e in chunk] if all(e.emphasize for e in chunk) else None
        enc = encode_prompts(
            model.tokenizer, [e.prompt for e in chunk], emphasize=emph, chat=chunk[0].chat, markup=False
        )
        ids = choice_ids(model.tokenizer, [e.choices for e in chunk])
        edits = [e for s in steer for e in s.edits(model, enc)]
        with editing(model, edits):
            out = forward(model, enc, logits_to_keep=1)
        lp = torch.log_softmax(out.logits[:, -1].float().cpu(), -1).gather(1, ids)
        for e, row in zip(chunk, lp, strict=True):
            ok = choice_correct(row.tolist(), e.label)  # ties count as wrong
            rows.append({"id": e.id, "correct": ok, "predicted": e.choices[int(row.argmax())]})
        step(len(chunk))
    return rows


def _generate_rows(model: HeadModel, task: str, examples, steer, batch_size, max_new_tokens, step, partial):
    from steer import SteeredModel

    sm = SteeredModel(model)
    rows = []
    for a in range(0, len(examples), batch_size):
        chunk = examples[a : a + batch_size]
        m = len(chunk)
        gen = sm.generate(
            [e.prompt for e in chunk],
            steer,
            emphasize=[[e.emphasize] for e in chunk],
            chat=chunk[0].chat,
            markup=False,
            max_new_tokens=max_new_tokens,
            # evaluate's own bar counts examples: a batch's count grows with its decoding steps
            progress=lambda d, t, m=m: partial(m * d // t),
        )
        for e, text in zip(chunk, gen.texts, strict=True):
            row = {"id": e.id, "output": text}
            if task == "json_format":
                m = json_metrics(text, e.fields)
                row |= {"json_valid": bool(m["json_valid"]), "field_accuracy": float(m["field_accuracy"])}
            else:
                row |= {
                    "no_she_he": no_pronoun(text),
                    "occupation_named": e.fields["occupation"].lower() in text.lower(),
                }
            rows.append(row)
        step(len(chunk))
    return rows


_METRICS = {
    "json_format": [("json_valid", "binary"), ("field_accuracy", "mean")],
    "pronoun_change": [("no_she_he", "binary"), ("occupation_named", "binary")],
    "occupation": [("top1", "correct")],
    "counterfact": [("efficacy", "correct")],
    "sentiment": [("accuracy", "correct")],
    "context_qa": [("context_accuracy", "correct")],
}


def evaluate(
    model: HeadModel,
    task: str,
    method: str = "none",
    *,
    split: str = "test",
    limit: int | None = None,
    batch_size: int = 16,
    max_new_tokens: int = 48,
    progress: ProgressArg = True,
    prompt: bool = False,
    **method_options,
) -> EvalResult:
    """Run `method` on `task` (`probes.datasets.tasks.TASKS`) and score it.

    Args:
        split: "train", "validation" or "test" (default).
        limit: the first `limit` examples of the split (default all).
        batch_size: prompts per forward / generate call.
        max_new_tokens: generation length for generate tasks (greedy).
        prompt: the prompting baseline: every prompt gets the task's instruction asking for the
            steered behaviour (`probes.datasets.instructions`; default False). With a method:
            "prompt + method" (the method's vectors, probes and head profiles are the same).
        progress: True (default: a tqdm bar), False / None (off) or `progress(done, total)`
            after each batch (`heads._util.progress`), in examples: `total` is the number of
            examples evaluated; on generate tasks a batch's examples are counted in step
            with its decoding steps.
        **method_options: `pasta_heads`, `alpha`, `tau`, `multiplier` (InstABoost), `act_heads`,
            `beta`, `var_p`, `var_rho`, `vhr_alpha`, `weight` (ScalingVis), `weight1`, `weight2`,
            `threshold` (AdaptVis), `iti`, `caa` (see `method_steer`); `iti_k`, `iti_alpha`,
            `iti_direction` for the ITI fitted when no `iti` is given (`probes.head_probes.fit_iti`);
            `caa_layer`, `caa_coefficient` for the CAA fitted when no `caa` is given (`fit_caa`).

    Raises:
        ValueError: unknown task / split / method, bad limit, or pasta/spotlight on a task
            without an emphasized span.
    """
    check_int("batch_size", batch_size, lo=1)
    check_bool("prompt", prompt)
    examples = load_task(task, split).examples
    if limit is not None:
        check_int("limit", limit, lo=1)
        examples = examples[:limit]
    if prompt:
        from probes.datasets.instructions import with_instruction

        examples = tuple(with_instruction(e, task) for e in examples)
    if method in SPAN_METHODS and not all(e.emphasize for e in examples):
        raise HeadsteerValueError(f"{method} needs an emphasized span, and task {short_repr(task)} has none")
    keys = ("iti_k", "iti_alpha", "iti_direction")
    iti_opts = {k[4:]: method_options.pop(k) for k in keys if k in method_options}
    if method == "iti" and method_options.get("iti") is None:  # probes on the train split only
        from probes.head_probes import fit_iti

        method_options["iti"] = fit_iti(model, task, batch_size=batch_size, **iti_opts)
    caa_opts = {k[4:]: method_options.pop(k) for k in ("caa_layer", "caa_coefficient") if k in method_options}
    if method == "caa" and method_options.get("caa") is None:  # pairs from the train split only
        if caa_opts.get("coefficient") is None:
            caa_opts.pop("coefficient", None)
        method_options["caa"] = fit_caa(model, task, **caa_opts)
    steer = method_steer(model, method, **method_options)
    finished = [0]
    with progress_callback(progress, f"eval {task} / {method}", "examples") as report:

        def step(n: int) -> None:
            finished[0] += n
            if report is not None:
                report(finished[0], len(examples))

        def partial(n: int) -> None:  # n examples of the running batch, counted as it decodes
            if report is not None:
                report(finished[0] + n, len(examples))

        if examples[0].scoring == "choice":
            rows = _choice_rows(model, examples, steer, batch_size, step)
        else:
            rows = _generate_rows(model, task, examples, steer, batch_size, max_new_tokens, step, partial)
    frame = pd.DataFrame(rows)
    out = []
    for name, kind in _METRICS[task]:
        col = "correct" if kind == "correct" else name
        vals = frame[col].astype(float).to_numpy()
        if kind == "mean":
            low, high = mean_interval(vals) if len(vals) > 1 else (float("nan"), float("nan"))
            low, high = max(0.0, low), min(1.0, high)  # every metric here is a share in [0, 1]
        else:
            low, high = wilson_interval(int(vals.sum()), len(vals))
        out.append(
            {
                "task": task,
                "method": method,
                "prompt": prompt,
                "split": split,
                "metric": name,
                "value": float(vals.mean()),
                "n": len(vals),
                "low": low,
                "high": high,
                "interval": INTERVAL_METHODS["mean" if kind == "mean" else "rate"],
            }
        )
    return EvalResult(pd.DataFrame(out), frame)
