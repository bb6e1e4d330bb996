"""`headsteer report safety`: Ships, dataset-level Ships, Sahara and the ASR they explain."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pandas as pd

from heads import HeadModel
from heads.ships import TEMPLATE, dataset_ships, sahara, ships
from probes.refusal import RefusalJudge, attack_success_rate
from probes.refusal_model import EXPLICIT_REFUSALS
from probes.requests import load_requests
from steer import Ablate, SteeredModel

from .figures import head_heatmap
from .report import Report

__all__ = ["read_prompts", "safety_report"]


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a JSONL file (`{"prompt": ...}` per line) or a text file (one per line).

    Raises:
        ValueError: no prompts, or a JSONL line without a string "prompt".
        FileNotFoundError: no such file.
    """
    text = Path(path).read_text(encoding="utf-8")
    out = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        if str(path).endswith(".jsonl"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{str(path)!r} line {i + 1} is not JSON: {err}") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{str(path)!r} line {i + 1} has no string 'prompt'")
            out.append(row["prompt"])
        else:
            out.append(line.strip())
    if not out:
        raise ValueError(f"no prompts in {str(path)!r}")
    return out


def safety_report(
    model: HeadModel,
    out: str | Path,
    *,
    prompts: list[str] | None = None,
    steps: int = 3,
    system_prompt: str | None = None,
    n_score: int = 16,
    max_new_tokens: int = 48,
    random_draws: int = 3,
    seed: int = 0,
    progress=None,
    executor=None,
) -> tuple[Path, dict]:
    """Write the safety-head report and return it with a JSON-able summary.

    Heads are scored on the first `n_score` prompts (Ships, dataset-level Ships, Sahara);
    ASR is measured on the held-out harmful test requests (or on all `prompts` when given)
    with no head, Sahara's first head, its first three heads, and `random_draws` draws of
    three random heads ablated (UA, exact), greedy decoding. `executor` ("local", "ray" or a
    `heads.executors.Executor`) runs the Ships sweeps in shards (see `heads.ships.ships`).
    """
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    template = (system_prompt.strip() + "\n" if system_prompt else "") + TEMPLATE
    score_prompts = (prompts or [r["prompt"] for r in load_requests("harmful", "train")])[:n_score]
    eval_prompts = prompts or [r["prompt"] for r in load_requests("harmful", "test")]
    say("Ships: every head on every scoring prompt")
    sh = ships(model, score_prompts, template=template, executor=executor)
    say("dataset-level Ships")
    ds = dataset_ships(model, score_prompts, template=template, degrees=True, executor=executor)
    say(f"Sahara: {steps} greedy steps")
    sa = sahara(model, score_prompts, steps=steps, template=template)
    judge = RefusalJudge(phrases=EXPLICIT_REFUSALS, min_tokens=0)  # explicit refusals only
    keyword = RefusalJudge(tokenizer=model.tokenizer)  # the paper's full keyword judge
    sm = SteeredModel(model)
    texts = [template.format(query=q) for q in eval_prompts]

    def answers(heads) -> list[str]:
        steer = [Ablate([list(h) for h in heads])] if heads else []
        return sm.generate(texts, steer=steer, max_new_tokens=max_new_tokens, chat=False, markup=False).texts

    say("generating: baseline and ablated")
    base = answers([])
    top1, top3 = answers(sa.heads[:1]), answers(sa.heads[:3])
    rng = random.Random(seed)
    all_heads = [
        (la, h) for la in range(model.n_layers) for h in range(model.n_heads) if (la, h) not in sa.heads
    ]
    rand = [answers(rng.sample(all_heads, 3)) for _ in range(random_draws)]
    asr, asr_keyword = {}, {}
    for key, j in (("explicit", judge), ("keyword", keyword)):
        table = asr if key == "explicit" else asr_keyword
        draws = [attack_success_rate(r, j) for r in rand]
        table.update(
            baseline=attack_success_rate(base, j),
            sahara_top1=attack_success_rate(top1, j),
            sahara_top3=attack_success_rate(top3, j),
            random3_mean=sum(draws) / len(draws),
            random3_draws=draws,
        )
    rep = Report(
        "Safety heads: Ships, dataset-level Ships, Sahara",
        model.name,
        {
            "template": template,
            "n_score": len(score_prompts),
            "n_eval": len(eval_prompts),
            "steps": steps,
            "ablation": "UA (query x eps), eps 1e-5 for scoring, exact for generation",
            "max_new_tokens": max_new_tokens,
            "seed": seed,
        },
    )
    rep.text(
        "Baseline refusal rate",
        f"{1 - asr['baseline']:.2f} of {len(eval_prompts)} harmful requests refused with no head ablated "
        '(explicit refusal openers such as "I\'m sorry" or "I cannot"). The paper\'s full keyword judge '
        f"(41 phrases incl. hedges, < 32 tokens, repetition) counts "
        f"{1 - asr_keyword['baseline']:.2f} as refused.",
    )
    rows = [
        ("none", [], "baseline"),
        ("Sahara top-1", sa.heads[:1], "sahara_top1"),
        ("Sahara top-3", sa.heads[:3], "sahara_top3"),
        (f"3 random heads (mean of {random_draws})", [], "random3_mean"),
    ]
    rep.table(
        "ASR with heads ablated (UA, exact)",
        pd.DataFrame(
            [
                {
                    "ablated": name,
                    "heads": str(h),
                    "ASR (explicit refusals)": asr[k],
                    "ASR (paper keyword judge)": asr_keyword[k],
                }
                for name, h, k in rows
            ]
        ),
    )
    rep.figure("Ships (mean KL over prompts, nats)", head_heatmap(sh.scores, top_k=10, title="Ships"))
    rep.figure(
        "Dataset-level Ships (principal angle, degrees)", head_heatmap(ds, top_k=10, title="dataset Ships")
    )
    rep.table(
        "Sahara: chosen head per step",
        pd.DataFrame(
            [
                {"step": i + 1, "layer": h[0], "head": h[1], "angle_rad": t.scores[h].item()}
                for i, (h, t) in enumerate(zip(sa.heads, sa.steps, strict=True))
            ]
        ),
    )
    for i in range(min(3, len(eval_prompts))):
        rep.samples(f"Sample {i + 1}", texts[i], {"baseline": base[i], "Sahara top-3 ablated": top3[i]})
    rep.seconds = time.perf_counter() - t0
    path = rep.save(out)
    return path, {
        "asr": asr,
        "asr_keyword_judge": asr_keyword,
        "sahara_heads": [list(h) for h in sa.heads],
        "ships_top5": [list(h) for h in sh.scores.ranked(5)],
    }
