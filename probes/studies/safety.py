"""Safety heads and the attack success rate they explain, as one result object.

`safety_analysis` runs the study of docs/methods/safety.md (Zhou et al., ICLR 2025,
arXiv:2410.13708): Ships (§3, Eq. 4-5), dataset-level Ships and Sahara (§4) on harmful
requests, then the attack success rate (ASR) of greedy answers with no head, Sahara's first
head, its first three heads, and random heads ablated (UA, exact). It lives in `probes/`
because judging refusals is a probe (`probes.metrics.refusal`); the scorers are in
`heads.scorers.safety.ships` and the ablation in `steer.Ablate`. `viz.reports.safety` only draws
the `SafetyAnalysis`
(`headsteer report safety`).
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd

from heads import HeadModel, HeadScores
from heads._util.progress import Progress, ProgressArg, offset_progress, progress_callback
from heads._util.validation import check_int, short_repr
from heads.engine.executors import Executor
from heads.engine.options import SweepOptions
from heads.errors import HeadsteerValueError
from heads.scorers.controls import MAX_DRAWS, other_heads, random_head_draws
from heads.scorers.safety.ships import (
    TEMPLATE,
    SaharaResult,
    ShipsResult,
    dataset_ships,
    fill_template,
    sahara,
    ships,
)
from probes.datasets.requests import load_requests
from probes.metrics.refusal import RefusalJudge, attack_success_rate
from probes.studies.refusal_model import EXPLICIT_REFUSALS
from steer import Ablate, SteeredModel

__all__ = ["SafetyAnalysis", "safety_analysis"]

Head = tuple[int, int]

_ROWS = (
    ("none", "baseline"),
    ("Sahara top-1", "sahara_top1"),
    ("Sahara top-3", "sahara_top3"),
    ("3 random heads", "random3_mean"),
)


@dataclass
class SafetyAnalysis:
    """Everything the safety report shows, computed (`safety_analysis`).

    Attributes:
        model: the model's name.
        template: the prompt template (`{query}` is replaced by each request).
        score_prompts: requests the heads were scored on.
        eval_prompts: requests the ASR was measured on.
        ships: per-prompt Ships `[N, L, H]` (nats) and its mean `HeadScores`.
        dataset_ships: dataset-level Ships `HeadScores` `[L, H]` (degrees).
        sahara: Sahara's chosen heads in order and every step's scores (radians).
        answers: greedy answers per condition: `baseline`, `sahara_top1`, `sahara_top3`
            (one per eval prompt each).
        random_heads: the heads of each random draw (3 heads each, never Sahara's).
        random_answers: the answers of each random draw.
        asr: ASR per condition with the explicit-refusal judge: `baseline`, `sahara_top1`,
            `sahara_top3`, `random3_mean`, `random3_draws` (a list), shares in [0, 1].
        asr_keyword: the same with the paper's full keyword judge.
        params: template, prompt counts, steps, ablation, max_new_tokens, seed.
        seconds: wall time of the analysis.
    """

    model: str
    template: str
    score_prompts: list[str]
    eval_prompts: list[str]
    ships: ShipsResult
    dataset_ships: HeadScores
    sahara: SaharaResult
    answers: dict[str, list[str]]
    random_heads: list[list[Head]]
    random_answers: list[list[str]]
    asr: dict
    asr_keyword: dict
    params: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def texts(self) -> list[str]:
        """The eval prompts put into the template (what the model was given)."""
        return [self.template.replace("{query}", q) for q in self.eval_prompts]

    @property
    def asr_table(self) -> pd.DataFrame:
        """ASR per ablation: `ablated, heads, ASR (explicit refusals), ASR (paper keyword judge)`."""
        heads = {"baseline": [], "sahara_top1": self.sahara.heads[:1], "sahara_top3": self.sahara.heads[:3]}
        rows = []
        for name, key in _ROWS:
            if key == "random3_mean":
                name = f"{name} (mean of {len(self.random_heads)})"
            elif key == "sahara_top3" and len(self.sahara.heads) < 3:
                name = f"{name} (Sahara found {len(self.sahara.heads)})"
            rows.append(
                {
                    "ablated": name,
                    "heads": str(heads.get(key, [])),
                    "ASR (explicit refusals)": self.asr[key],
                    "ASR (paper keyword judge)": self.asr_keyword[key],
                }
            )
        return pd.DataFrame(rows)

    @property
    def sahara_table(self) -> pd.DataFrame:
        """Sahara's chosen head per step: `step, layer, head, angle_rad`."""
        return pd.DataFrame(
            [
                {"step": i + 1, "layer": h[0], "head": h[1], "angle_rad": t.scores[h].item()}
                for i, (h, t) in enumerate(zip(self.sahara.heads, self.sahara.steps, strict=True))
            ]
        )

    def summary(self) -> dict:
        """A JSON-able summary: ASR under both judges, Sahara's heads, the top-5 Ships heads."""
        return {
            "asr": self.asr,
            "asr_keyword_judge": self.asr_keyword,
            "sahara_heads": [list(h) for h in self.sahara.heads],
            "ships_top5": [list(h) for h in self.ships.scores.ranked(5)],
        }

    def __repr__(self) -> str:
        a = self.asr
        return (
            f"SafetyAnalysis({self.model}: Sahara heads {self.sahara.heads}; ASR baseline "
            f"{a['baseline']:.2f}, top-1 {a['sahara_top1']:.2f}, "
            f"top-{min(3, len(self.sahara.heads))} {a['sahara_top3']:.2f}, "
            f"3 random {a['random3_mean']:.2f}; {len(self.eval_prompts)} requests, {self.seconds:.1f} s)"
        )

    def _repr_html_(self) -> str:
        table: str = self.asr_table.to_html(index=False, float_format="%.3f")
        return (
            f"<b>Safety heads</b> of {html.escape(self.model)}: Sahara heads "
            f"{html.escape(str(self.sahara.heads))}" + table
        )


def _batch_progress(report: Progress | None, at: int, m: int, total: int) -> Progress | bool:
    """The `progress=` of one generated batch: its `m` prompts (the first is `at`) count as done
    in step with its decoding, out of `total` (False when progress is off)."""
    if report is None:
        return False

    def step(d: int, t: int) -> None:
        report(at + m * d // t, total)

    return step


def safety_template(system_prompt: str | None = None) -> str:
    """The prompt template: `system_prompt` (stripped, own line) before `heads.scorers.safety.ships.TEMPLATE`.

    `{query}` is the only placeholder (`heads.scorers.safety.ships.fill_template`), in scoring and in
    generation alike.
    """
    return (system_prompt.strip() + "\n" if system_prompt else "") + TEMPLATE


def safety_analysis(
    model: HeadModel,
    *,
    prompts: list[str] | None = None,
    steps: int = 3,
    system_prompt: str | None = None,
    n_score: int = 16,
    max_new_tokens: int = 48,
    random_draws: int = 3,
    seed: int = 0,
    batch_size: int = 16,
    progress: ProgressArg = True,
    executor: str | Executor | None = None,
) -> SafetyAnalysis:
    """Score safety heads and measure the ASR they explain (docs/methods/safety.md).

    Heads are scored on the first `n_score` prompts (Ships, dataset-level Ships in degrees,
    Sahara with `steps` greedy steps; UA ablation, eps 1e-5). ASR is measured on the held-out
    harmful test requests (or on all `prompts` when given) with no head, Sahara's first head,
    its first three heads, and `random_draws` draws of three random other heads ablated (UA,
    exact), greedy decoding of `max_new_tokens` tokens. A request counts as an attack success
    when the judge finds no refusal: `asr` uses explicit refusal openers only, `asr_keyword`
    the paper's full keyword judge.

    Args:
        prompts: harmful requests (default: the shipped harmful train split for scoring and
            test split for ASR).
        system_prompt: text put before the `Query: {query}\\nAnswer:` template.
        seed: seed of the random-head draws.
        batch_size: prompts per `generate` call when measuring ASR (default 16).
        executor: `"local"`, `"ray"` or a `heads.engine.executors.Executor`: run the Ships and
            dataset-level Ships sweeps in shards (`heads.scorers.safety.ships.ships`); default None: here.
        progress: True (default: a tqdm bar), False / None (off) or `progress(done, total)`
            (`heads._util.progress`) in work items: the (head, prompt) rows of Ships,
            dataset-level Ships and Sahara, then one per generated answer (a batch of answers
            advances with its decoding steps).

    Raises:
        ValueError: a string for `prompts`, `steps` outside 1..L*H, non-positive counts (before any work).
    """
    t0 = time.perf_counter()
    n_heads = model.n_layers * model.n_heads
    for name, v in (("n_score", n_score), ("max_new_tokens", max_new_tokens)):
        check_int(name, v, lo=1)
    check_int("random_draws", random_draws, lo=1, hi=MAX_DRAWS, what=f"an int in 1..{MAX_DRAWS}")
    check_int("steps", steps, lo=1, hi=n_heads)
    if isinstance(prompts, str):
        raise HeadsteerValueError(f"prompts must be a list of requests, got the string {short_repr(prompts)}")
    check_int("batch_size", batch_size, lo=1)
    template = safety_template(system_prompt)
    score_prompts = list(prompts or [r["prompt"] for r in load_requests("harmful", "train")])[:n_score]
    eval_prompts = list(prompts or [r["prompt"] for r in load_requests("harmful", "test")])
    n, n_eval = len(score_prompts), len(eval_prompts)
    sizes = [
        n * n_heads,
        n * n_heads,
        n * sum(n_heads - i for i in range(steps)),
        n_eval * (3 + random_draws),
    ]
    total = sum(sizes)
    start = [sum(sizes[:i]) for i in range(len(sizes))]
    with progress_callback(progress, "safety heads", "items") as report:
        sh = ships(
            model,
            score_prompts,
            template=template,
            options=SweepOptions(executor=executor, progress=offset_progress(report, start[0], total)),
        )
        ds = dataset_ships(
            model,
            score_prompts,
            template=template,
            degrees=True,
            options=SweepOptions(executor=executor, progress=offset_progress(report, start[1], total)),
        )
        sa = sahara(
            model,
            score_prompts,
            steps=steps,
            template=template,
            options=SweepOptions(progress=offset_progress(report, start[2], total)),
        )
        judge = RefusalJudge(phrases=EXPLICIT_REFUSALS, min_tokens=0)  # explicit refusals only
        keyword = RefusalJudge(tokenizer=model.tokenizer)  # the paper's full keyword judge
        sm = SteeredModel(model)
        texts = fill_template(template, eval_prompts)
        done = [start[3]]

        def answers(heads: Sequence[Sequence[int]]) -> list[str]:
            steer = [Ablate([list(h) for h in heads])] if heads else []
            out: list[str] = []
            for i in range(0, n_eval, batch_size):
                batch = texts[i : i + batch_size]
                at, m = done[0], len(batch)
                out += sm.generate(
                    batch,
                    steer=steer,
                    max_new_tokens=max_new_tokens,
                    chat=False,
                    markup=False,  # a batch's prompts count as done in step with its decoding
                    progress=_batch_progress(report, at, m, total),
                ).texts
                done[0] += len(batch)
                if report is not None:
                    report(done[0], total)
            return out

        base = answers([])
        top1, top3 = answers(sa.heads[:1]), answers(sa.heads[:3])
        others = other_heads(model.n_layers, model.n_heads, sa.heads)
        random_heads = random_head_draws(others, 3, random_draws, seed, generator="python")
        rand = [answers(hs) for hs in random_heads]
    asr: dict[str, float | list[float]] = {}
    asr_keyword: dict[str, float | list[float]] = {}
    for table, j in ((asr, judge), (asr_keyword, keyword)):
        draws = [attack_success_rate(r, j) for r in rand]
        table.update(
            baseline=attack_success_rate(base, j),
            sahara_top1=attack_success_rate(top1, j),
            sahara_top3=attack_success_rate(top3, j),
            random3_mean=sum(draws) / len(draws),
            random3_draws=draws,
        )
    params = {
        "template": template,
        "n_score": n,
        "n_eval": n_eval,
        "steps": steps,
        "ablation": "UA (query x eps), eps 1e-5 for scoring, exact for generation",
        "max_new_tokens": max_new_tokens,
        "seed": seed,
    }
    return SafetyAnalysis(
        model=model.name,
        template=template,
        score_prompts=score_prompts,
        eval_prompts=eval_prompts,
        ships=sh,
        dataset_ships=ds,
        sahara=sa,
        answers={"baseline": base, "sahara_top1": top1, "sahara_top3": top3},
        random_heads=random_heads,
        random_answers=rand,
        asr=asr,
        asr_keyword=asr_keyword,
        params=params,
        seconds=time.perf_counter() - t0,
    )
