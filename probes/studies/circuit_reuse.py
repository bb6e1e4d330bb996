"""Circuit reuse across tasks (Merullo et al., ICLR 2024) on the embedded model: IOI against
Colored Objects, and the repair experiment.

`python -m probes.studies.circuit_reuse --out reuse.json [--n-pairs 16] [--n-eval 80]` runs:

1. **Circuits found the same way** on both tasks: EAP-IG edge scores on `n_pairs` test pairs
   (`find_circuit`, the top `size` % of the edges, evaluated exactly). Overlap of the two
   circuits: their heads (Jaccard; weighted `sum min / sum max` of the heads' summed |edge score|
   inside each circuit) and their edges by name (Jaccard; weighted on |score|), with
   `heads.dynamics.overlap`.
2. **Per-role overlap** from the head atlas (roles are a property of the head, not of the task):
   per role, how many heads of each circuit hold it and how many both circuits share.
3. **Heads whose behaviour differs**: Merullo et al. find that Colored Objects reuses IOI's
   circuit except that the inhibition heads do not do their job (in IOI they attend from the
   last token to the repeated subject, whose copy the movers then avoid). Here, per head, the
   attention of the last position to the distractor — IOI: the second subject mention; Colored
   Objects: the two other colours — on `n_pairs` prompts of each task; the `k` heads of the two
   circuits with the largest (IOI - Colored Objects) difference.
4. **Repair**: PASTA (`steer.Pasta`, alpha 0.01: the heads' attention moved onto the span) on
   those `k` heads, with the two other colours as the span — the heads now attend to the
   distractors as they do in IOI — on `n_eval` Colored Objects test prompts other than the
   `n_pairs` the circuits and the head choice used; accuracy (the
   answer colour has the highest logit of the three colours) and the mean logit difference
   (answer - queried-other colour), with 95 % Wilson intervals, a paired bootstrap interval of
   the change, and the same intervention on `controls` draws of `k` random heads of the same
   layers. A result, not a promise: the 135M model barely solves Colored Objects.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from heads.dynamics import overlap
from heads.engine.context import editing
from heads.engine.forward import forward
from heads.engine.options import SweepOptions
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import encode_prompts
from heads.model.adapter import HeadModel
from heads.scorers.attention_mass import span_attention
from heads.scorers.circuits import Circuit, find_circuit
from heads.scorers.patching.pairs import PromptPair, encode_pairs
from probes.datasets.make_pairs import COLORS
from probes.datasets.pairs import load_task_pairs
from probes.metrics.tasks import wilson_interval

__all__ = ["circuit_overlap", "differing_heads", "main", "repair", "role_overlap", "run_study"]


def _head_name(la: int, h: int) -> str:
    return f"L{la}.H{h}"


def circuit_overlap(a: Circuit, b: Circuit) -> dict[str, Any]:
    """Heads and edges shared by two circuits of one model (Jaccard and weighted overlap)."""
    ha = a.head_scores(in_circuit=True).scores
    hb = b.head_scores(in_circuit=True).scores
    heads_a = {_head_name(la, h): float(ha[la, h]) for la, h in a.heads}
    heads_b = {_head_name(la, h): float(hb[la, h]) for la, h in b.heads}
    fa, fb = a.to_frame(), b.to_frame()
    edges_a = dict(zip(fa["edge"], fa["score"], strict=True))
    edges_b = dict(zip(fb["edge"], fb["score"], strict=True))
    jh, wh = overlap(heads_a, heads_b)
    je, we = overlap(edges_a, edges_b)
    top = {}
    for k in (10, 20):
        ta = sorted(heads_a, key=lambda n: -heads_a[n])[:k]
        tb = sorted(heads_b, key=lambda n: -heads_b[n])[:k]
        j, _ = overlap({n: heads_a[n] for n in ta}, {n: heads_b[n] for n in tb})
        top[f"top{k}"] = {"jaccard": j, "shared": sorted(set(ta) & set(tb)), "a": ta, "b": tb}
    return {
        "heads": {"a": len(heads_a), "b": len(heads_b), "shared": sorted(set(heads_a) & set(heads_b))},
        "heads_jaccard": jh,
        "heads_weighted": wh,
        "heads_by_importance": top,
        "edges": {"a": len(edges_a), "b": len(edges_b), "shared": len(set(edges_a) & set(edges_b))},
        "edges_jaccard": je,
        "edges_weighted": we,
    }


def role_overlap(roles: dict[str, str], a: Circuit, b: Circuit) -> list[dict[str, Any]]:
    """Per atlas role: heads of circuit a / b / both holding it (`roles`: `"L1.H2"` -> role)."""
    ha = {_head_name(la, h) for la, h in a.heads}
    hb = {_head_name(la, h) for la, h in b.heads}
    out = []
    for role in sorted(set(roles.values())):
        ra = {h for h in ha if roles.get(h) == role}
        rb = {h for h in hb if roles.get(h) == role}
        union = ra | rb
        out.append(
            {
                "role": role,
                "a": len(ra),
                "b": len(rb),
                "both": len(ra & rb),
                "jaccard": (len(ra & rb) / len(union)) if union else None,
            }
        )
    return out


def _ioi_marked(pair: PromptPair) -> str:
    s = str(pair.meta["s"]) if "s" in pair.meta else str(pair.counterfactual).strip()
    text = pair.clean
    i = text.rfind(s)
    return text[:i] + f"**{s}**" + text[i + len(s) :]


def _co_colours(text: str) -> list[str]:
    items = text.split(" I see ", 1)[1].split(". What", 1)[0]
    return [w for w in re.findall(r"[a-z]+", items) if w in COLORS]


def _co_marked(pair: PromptPair) -> str:
    answer = str(pair.answer).strip()
    text = pair.clean
    for c in _co_colours(text):
        if c != answer:
            text = re.sub(rf"\b{c}\b", f"**{c}**", text, count=1)
    return text


def differing_heads(
    model: HeadModel, ioi: list, co: list, candidates: Sequence[tuple[int, int]], k: int
) -> tuple[list[tuple[int, int]], list[dict[str, Any]]]:
    """The `k` candidate heads whose last-position attention to the distractor is most higher
    in IOI (second subject mention) than in Colored Objects (the two other colours), and the
    table of every candidate's two shares."""
    a = span_attention(model, [_ioi_marked(p) for p in ioi], chat=False).scores
    b = span_attention(model, [_co_marked(p) for p in co], chat=False).scores
    order = sorted(candidates, key=lambda lh: -float(a[lh] - b[lh]))
    rows: list[dict[str, Any]] = [
        {
            "head": _head_name(la, h),
            "ioi": float(a[la, h]),
            "colored_objects": float(b[la, h]),
            "difference": float(a[la, h] - b[la, h]),
        }
        for la, h in order
    ]
    return [(int(la), int(h)) for la, h in order[:k]], rows


@torch.no_grad()
def _co_eval(model: HeadModel, pairs: list, heads: Sequence[tuple[int, int]] | None, alpha: float) -> dict:
    from steer.pasta.method import Pasta

    tok = model.tokenizer
    if tok is None:
        raise HeadsteerValueError("the repair experiment needs a model with a tokenizer")
    correct, diffs = [], []
    for start in range(0, len(pairs), 16):
        chunk = pairs[start : start + 16]
        enc = encode_prompts(tok, [_co_marked(p) for p in chunk], chat=False)
        edits = [] if heads is None else Pasta(heads=list(heads), alpha=alpha).edits(model, enc)
        with editing(model, edits):
            logits = forward(model, enc)[:, -1].float()
        for row, p in zip(logits, chunk, strict=True):
            cols = {c: tok(" " + c, add_special_tokens=False)["input_ids"][0] for c in _co_colours(p.clean)}
            ans, cf = p.answer.strip(), p.counterfactual.strip()
            best = max(cols, key=lambda c: float(row[cols[c]]))
            correct.append(best == ans)
            diffs.append(float(row[cols[ans]] - row[cols[cf]]))
    n, hits = len(correct), sum(correct)
    lo, hi = wilson_interval(hits, n)
    return {
        "n": n,
        "accuracy": hits / n,
        "accuracy_ci": [lo, hi],
        "logit_diff": sum(diffs) / n,
        "correct": correct,
        "diffs": diffs,
    }


def _paired_ci(base: list[bool], new: list[bool], *, seed: int = 0, draws: int = 2000) -> list[float]:
    rng = random.Random(seed)
    n = len(base)
    d = [int(b) - int(a) for a, b in zip(base, new, strict=True)]
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(draws))
    return [means[int(0.025 * draws)], means[int(0.975 * draws) - 1]]


def repair(
    model: HeadModel,
    pairs: list,
    heads: Sequence[tuple[int, int]],
    *,
    alpha: float = 0.01,
    controls: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Colored Objects accuracy with no steering, with PASTA on `heads` (span: the two other
    colours), and with PASTA on `controls` draws of as many random heads of the same layers."""
    base = _co_eval(model, pairs, None, alpha)
    steered = _co_eval(model, pairs, heads, alpha)
    rng = random.Random(seed)
    ctrl = []
    for _ in range(controls):
        pick = [(la, rng.randrange(model.n_heads)) for la, _ in heads]
        r = _co_eval(model, pairs, pick, alpha)
        ctrl.append(
            {
                "heads": [_head_name(*h) for h in pick],
                "accuracy": r["accuracy"],
                "accuracy_ci": r["accuracy_ci"],
                "logit_diff": r["logit_diff"],
            }
        )

    def public(r: dict) -> dict:
        return {k: v for k, v in r.items() if k not in ("correct", "diffs")}

    return {
        "heads": [_head_name(*h) for h in heads],
        "alpha": alpha,
        "none": public(base),
        "steered": public(steered),
        "change": steered["accuracy"] - base["accuracy"],
        "change_ci": _paired_ci(base["correct"], steered["correct"], seed=seed),
        "controls": ctrl,
    }


def run_study(
    model: HeadModel,
    *,
    n_pairs: int = 16,
    n_eval: int = 80,
    size: float = 5.0,
    k: int = 3,
    alpha: float = 0.01,
    controls: int = 5,
    seed: int = 0,
    log: Callable[[str], None] = print,
    save_dir: str | None = None,
) -> dict[str, Any]:
    """Every part of the module docstring; one JSON-ready dict (`save_dir`: also write the two
    circuits there as `<task>.circuit.json`)."""
    from heads.scorers.roles.atlas import head_atlas
    from heads.scorers.roles.detectors import detect_roles

    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "schema": "headsteer/circuit-reuse",
        "model": model.name,
        "n_pairs": n_pairs,
        "n_eval": n_eval,
        "size_percent": size,
        "method": "eap-ig",
    }

    def done(what: str) -> None:
        res["seconds"] = round(time.perf_counter() - t0, 1)
        log(f"[{res['seconds']:7.1f}s] {what}")

    ioi = load_task_pairs("ioi", "test", n=n_pairs)
    co = load_task_pairs("colored_objects", "test", n=n_pairs)
    circuits = {}
    for name, pairs in (("ioi", ioi), ("colored_objects", co)):
        c = find_circuit(
            model,
            encode_pairs(model, pairs),
            method="eap-ig",
            size=size,
            curve=False,
            options=SweepOptions(progress=False),
        )
        circuits[name] = c
        res[name] = {"edges": c.n_edges, "heads": len(c.heads), "faithfulness": c.faithfulness}
        done(f"{name} circuit: {c.n_edges} edges, {len(c.heads)} heads, faithfulness {c.faithfulness:.3f}")
    if save_dir is not None:
        for name, c in circuits.items():
            c.save(f"{save_dir}/{name}.circuit.json", overwrite=True)
    res["overlap"] = circuit_overlap(circuits["ioi"], circuits["colored_objects"])
    atlas = head_atlas(model, detectors=detect_roles(model, seed=seed), thumbnails=False, seed=seed)
    roles = {
        _head_name(int(a), int(b)): str(r)
        for a, b, r in atlas.frame[["layer", "head", "role"]].itertuples(index=False)
    }
    res["roles"] = role_overlap(roles, circuits["ioi"], circuits["colored_objects"])
    done("atlas roles")
    cand = sorted(set(circuits["ioi"].heads) | set(circuits["colored_objects"].heads))
    heads, table = differing_heads(model, ioi, co, cand, k)
    res["differing_heads"] = table[: max(10, k)]
    done(f"differing heads {heads}")
    # evaluated on test pairs the circuits and the head choice did not see
    eval_pairs = load_task_pairs("colored_objects", "test")[n_pairs : n_pairs + n_eval]
    res["repair"] = repair(model, eval_pairs, heads, alpha=alpha, controls=controls, seed=seed)
    done(f"repair: {res['repair']['none']['accuracy']:.3f} -> {res['repair']['steered']['accuracy']:.3f}")
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write (must not exist unless --force)")
    ap.add_argument("--n-pairs", type=int, default=16)
    ap.add_argument("--n-eval", type=int, default=80)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    from heads import load_model
    from heads._util.files import check_output, write_text

    check_output(args.out, overwrite=args.force)
    res = run_study(
        load_model(),
        n_pairs=args.n_pairs,
        n_eval=args.n_eval,
        k=args.k,
        log=lambda m: print(m, flush=True),
        save_dir=str(Path(args.out).parent),
    )
    write_text(args.out, json.dumps(res, indent=1) + "\n", overwrite=args.force)


if __name__ == "__main__":
    main()
