"""The measured effect of pattern injection on a task (docs/methods/pattern_injection.md, "Results").

Task: induction on repeated random tokens (`[BOS] + R + R`, `heads.scorers.roles.detectors.
repeated_tokens`): at each token of the second copy of R (but its last) the model should predict
the token that followed it in the first copy. Metric: top-1 accuracy over those positions, per
sequence; the reported interval is a Student-t 95 % interval of the per-sequence values (and of the
paired differences to no injection).

Protocol (`injection_effect`):

1. discovery: `pattern_clusters` on `discover_seqs` sequences (seed `seed`) clusters the heads;
   the heads the task uses for `pattern` are the cluster(s) named `pattern` (default
   `previous-token`: induction rests on previous-token heads, Olsson et al. 2022);
2. evaluation on `n_seqs` fresh sequences (seed `seed + 1`): no injection, the pattern injected into
   those heads at each weight of `weights`, and a control: the same pattern at the largest weight
   injected into as many heads drawn at random from the other clusters (seed `seed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_int, check_number, check_seed
from heads.engine.context import editing
from heads.engine.edits import Edit
from heads.engine.forward import forward
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.model.adapter import HeadModel
from heads.results.scores import HeadSet
from heads.scorers.roles.clusters import pattern_clusters
from heads.scorers.roles.detectors import repeated_tokens
from heads.scorers.roles.named import check_pattern_name
from probes.metrics.tasks import mean_interval
from steer.pattern_injection import PatternInjection

__all__ = ["induction_accuracy", "injection_effect"]


@torch.no_grad()
def induction_accuracy(
    model: HeadModel,
    enc: EncodedPrompts,
    edits_for: Callable[[EncodedPrompts], Sequence[Edit]] | None = None,
    *,
    batch_size: int = 16,
) -> torch.Tensor:
    """`[B]` per-sequence top-1 accuracy on the second copy of R (module docstring).

    `edits_for(sub)`: the engine edits for a sub-batch (None: unsteered).
    """
    out = []
    for s in range(0, enc.batch, batch_size):
        ids = enc.input_ids[s : s + batch_size]
        mask = enc.attention_mask[s : s + batch_size]
        sub = EncodedPrompts(ids, mask, [[]] * len(ids), [""] * len(ids), [[]] * len(ids))
        edits = [] if edits_for is None else edits_for(sub)
        with editing(model, edits):
            pred = forward(model, sub).argmax(-1)
        for b in range(len(ids)):
            real = ids[b][mask[b].bool()]
            n = (len(real) - 1) // 2 if len(real) % 2 else len(real) // 2  # R's length
            start = len(real) - n  # the second copy's first position
            p = pred[b][mask[b].bool()]
            hit = p[start : len(real) - 1] == real[start + 1 :]
            out.append(hit.float().mean())
    return torch.stack(out)


def injection_effect(
    model: HeadModel,
    *,
    pattern: str = "previous-token",
    weights: Sequence[float] = (0.5, 1.0),
    n_seqs: int = 64,
    discover_seqs: int = 8,
    length: tuple[int, int] = (20, 30),
    n_clusters: int = 8,
    seed: int = 0,
    batch_size: int = 16,
    progress: ProgressArg = None,
) -> dict:
    """Discover the heads of `pattern` on the induction task, inject the pattern there, measure.

    Returns:
        A dict: `heads` (the injected `{layer: [heads]}`), `clusters` (name -> size), and one entry
        per run (`none`, `w=<weight>`, `control`) with `accuracy`, `interval` (95 %), and for the
        steered runs `delta` and `delta_interval` (paired, per sequence).

    Raises:
        ValueError: a bad pattern, weight, count or seed (before any forward), or no cluster named
            `pattern` on this model.
    """
    check_pattern_name(pattern)
    ws = [check_number("weight", w, lo=0, hi=1, lo_open=True) for w in weights]
    if not ws:
        raise HeadsteerValueError("weights is empty: give at least one weight in (0, 1]")
    n_seqs = check_int("n_seqs", n_seqs, lo=2)
    discover_seqs = check_int("discover_seqs", discover_seqs, lo=1)
    seed = check_seed("seed", seed)
    disc = repeated_tokens(model, n_seqs=discover_seqs, length=length, seed=seed)
    evals = repeated_tokens(model, n_seqs=n_seqs, length=length, seed=seed + 1)
    with progress_callback(progress, "pattern injection", "runs") as report:
        pc = pattern_clusters(model, disc, n_clusters=n_clusters, seed=seed, batch_size=batch_size)
        names = [n for n in pc.names if n == pattern or n.startswith(pattern + "-")]
        if not names:
            raise HeadsteerValueError(f"no head cluster is named {pattern!r} on this model: {pc.names}")
        chosen = HeadSet(h for n in names for h in pc.heads(n).heads)
        others = [
            h for h in pc.frame[["layer", "head"]].itertuples(index=False, name=None) if h not in chosen.heads
        ]
        g = torch.Generator().manual_seed(seed)
        pick = torch.randperm(len(others), generator=g)[: len(chosen)].tolist()
        control = HeadSet(others[i] for i in sorted(pick))
        total = 2 + len(ws)
        base = induction_accuracy(model, evals, batch_size=batch_size)
        if report is not None:
            report(1, total)
        result: dict = {
            "task": "induction (repeated random tokens)",
            "pattern": pattern,
            "n_seqs": n_seqs,
            "heads": chosen.to_dict(),
            "control_heads": control.to_dict(),
            "clusters": {
                str(n): int(s) for n, s in zip(pc.centroids["name"], pc.centroids["size"], strict=True)
            },
        }

        def row(acc: torch.Tensor) -> dict:
            lo, hi = mean_interval(acc.numpy())
            out = {"accuracy": round(float(acc.mean()), 4), "interval": [round(lo, 4), round(hi, 4)]}
            if acc is not base:
                d = (acc - base).numpy()
                dlo, dhi = mean_interval(d) if d.std() > 0 else (float(d.mean()), float(d.mean()))
                out |= {"delta": round(float(d.mean()), 4), "delta_interval": [round(dlo, 4), round(dhi, 4)]}
            return out

        result["none"] = row(base)
        for i, w in enumerate(ws):
            pi = PatternInjection(chosen, pattern, weight=w)
            acc = induction_accuracy(model, evals, partial(pi.edits, model), batch_size=batch_size)
            result[f"w={w:g}"] = row(acc)
            if report is not None:
                report(2 + i, total)
        ctl = PatternInjection(control, pattern, weight=max(ws))
        acc = induction_accuracy(model, evals, partial(ctl.edits, model), batch_size=batch_size)
        result["control"] = row(acc)
        if report is not None:
            report(total, total)
    return result
