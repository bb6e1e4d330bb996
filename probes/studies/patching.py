"""Causal-analysis studies on the embedded model (IOI, Colored Objects, competition of mechanisms).

`python -m probes.studies.patching --out study.json [--n-patch 8] [--n-eval 80]` runs, on the
shipped pair sets (`probes.datasets.pairs`), test split:

1. IOI (ABC corruption): share of pairs with a positive clean logit difference (indirect object
   minus subject), the top heads by head-output activation patching (denoising, all positions)
   with 95% intervals over pairs, the top heads by path patching to the logits (noising: the
   name-mover candidates), and the top heads by direct logit attribution;
2. Colored Objects: the same accuracy numbers and top patching heads, and the overlap of its
   top-k heads with IOI's (|top_k(CO) & top_k(IOI)| / k; Merullo et al. 2024 report ~78% shared
   circuit heads on GPT-2 medium, with a different head selection);
3. competition of mechanisms: per layer (logit lens), the share of pairs where the current value
   beats the earlier one, and the heads writing most for either token (per-head direct logits).

Small by default so that it finishes on a loaded 2-core CPU; every number is written with the
number of pairs it comes from. The JSON is one object (schema `headsteer/patching-study`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from heads._util.validation import short_repr
from heads.engine.options import SweepOptions
from heads.model.adapter import HeadModel
from heads.scorers.patching.activation import PatchResult, patch
from heads.scorers.patching.evaluate import evaluate_pairs
from heads.scorers.patching.logit import direct_logit_attribution, logit_inspection
from heads.scorers.patching.pairs import PairBatch, encode_pairs
from probes.datasets.pairs import load_task_pairs

__all__ = [
    "clean_accuracy",
    "colored_objects_patching",
    "comp_mech_layers",
    "knockout_experiment",
    "main",
    "run_study",
    "top_heads",
    "wilson_interval",
]


def clean_accuracy(model: HeadModel, pairs: PairBatch, chunk: int = 16) -> dict[str, float]:
    """Share of pairs with a positive clean / corrupted logit difference, their mean logit
    differences and top-1 accuracy (`heads.evaluate_pairs` on the clean and corrupted prompts)."""
    clean = evaluate_pairs(model, pairs, options=SweepOptions(max_rows=chunk))
    corr = evaluate_pairs(model, pairs, which="corrupted", options=SweepOptions(max_rows=chunk))
    return {
        "n": int(pairs.n),
        "clean_ld_positive": clean.accuracy,
        "clean_ld_mean": clean.mean_logit_diff,
        "corrupted_ld_positive": corr.accuracy,
        "corrupted_ld_mean": corr.mean_logit_diff,
        "clean_top1": clean.top1_accuracy,
    }


def top_heads(result: PatchResult, k: int = 10) -> list[dict[str, Any]]:
    """The `k` heads with the largest mean normalised score, with 95% intervals over pairs."""
    m = result.mean
    lo, hi = result.interval()
    flat = m.nan_to_num(float("-inf")).flatten()
    idx = flat.topk(k).indices.tolist()
    h = m.shape[1]
    return [
        {
            "head": f"L{result.layer_ids[i // h]}H{i % h}",  # the model's layer, also for a subset
            "score": round(float(m.flatten()[i]), 4),
            "ci": [round(float(lo.flatten()[i]), 4), round(float(hi.flatten()[i]), 4)],
        }
        for i in idx
    ]


def _dla_top(model: HeadModel, pairs: PairBatch, k: int) -> list[dict[str, Any]]:
    dla = direct_logit_attribution(model, pairs)
    last = dla.heads[..., -1]  # [N, L, H]
    m = last.mean(0)
    se = last.std(0) / max(1, last.shape[0]) ** 0.5
    idx = m.abs().flatten().topk(k).indices.tolist()
    h = m.shape[1]
    return [
        {
            "head": f"L{i // h}H{i % h}",
            "dla": round(float(m.flatten()[i]), 4),
            "ci": [
                round(float((m - 1.96 * se).flatten()[i]), 4),
                round(float((m + 1.96 * se).flatten()[i]), 4),
            ],
        }
        for i in idx
    ]


def wilson_interval(wins: torch.Tensor, n: int, z: float = 1.96) -> tuple[torch.Tensor, torch.Tensor]:
    """`(low, high)` Wilson score interval (default 95%) of the share `wins / n`, elementwise.

    `wins` any shape (counts, float); `n` > 0 trials. Wilson (1927); unlike the normal
    approximation it stays inside [0, 1] and is not degenerate at 0 or n wins."""
    p = wins.float() / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * torch.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return centre - half, centre + half


def comp_mech_layers(model: HeadModel, pairs: PairBatch, k: int = 10) -> dict[str, Any]:
    """Competition of mechanisms per layer (Ortu et al. 2024, Sec. 4: logit inspection).

    Per layer l (0 = embeddings, `L` = the output), over the N pairs: the share where the
    current (factual, in-context) token out-scores the earlier (counterfactual) one with its 95%
    Wilson interval, the mean logits of both and their difference with 95% normal intervals, and
    the `k` heads whose direct logit most favours either token. Every list has `L + 1` entries."""
    insp = logit_inspection(model, pairs)
    n = int(insp.logit_diff.shape[0])
    wins = (insp.logit_diff > 0).float().sum(0)
    lo, hi = wilson_interval(wins, n)

    def mean_ci(x: torch.Tensor) -> dict[str, list[float]]:
        m, se = x.mean(0), x.std(0) / n**0.5
        return {
            "mean": [round(float(v), 4) for v in m],
            "ci_low": [round(float(v), 4) for v in m - 1.96 * se],
            "ci_high": [round(float(v), 4) for v in m + 1.96 * se],
        }

    out: dict[str, Any] = {
        "n": n,
        "current_wins_share": [round(float(x), 4) for x in wins / n],
        "current_wins_ci": [[round(float(a), 4), round(float(b), 4)] for a, b in zip(lo, hi, strict=True)],
        "current_logit": mean_ci(insp.answer_logit),
        "earlier_logit": mean_ci(insp.counterfactual_logit),
        "logit_diff": mean_ci(insp.logit_diff),
    }
    assert insp.head_answer is not None and insp.head_counterfactual is not None
    diff = (insp.head_answer - insp.head_counterfactual).mean(0)
    h = diff.shape[1]
    for key, sign in (("heads_for_current", 1), ("heads_for_earlier", -1)):
        out[key] = [
            {"head": f"L{i // h}H{i % h}", "dla": round(float(diff.flatten()[i]), 4)}
            for i in (sign * diff).flatten().topk(k).indices.tolist()
        ]
    return out


def colored_objects_patching(
    model: HeadModel, n_patch: int, ioi_top: Sequence[str], k: int = 10, options: SweepOptions | None = None
) -> dict[str, Any]:
    """Head-output activation patching (denoising, all positions) on `n_patch` Colored Objects
    test pairs: the top `k` heads with 95% intervals and the overlap `|top_k(CO) & ioi_top| / k`
    with IOI's top heads by the same patching (Merullo et al. 2024, Sec. 4)."""
    co = encode_pairs(model, load_task_pairs("colored_objects", "test", n=n_patch))
    cp = patch(model, co, "head_out", options=options or SweepOptions(max_rows=64, progress=False))
    top = top_heads(cp, k)
    shared = sorted(set(ioi_top) & {h["head"] for h in top})
    return {
        "n": int(co.n),
        "head_out_top": top,
        "head_out_mean": cp.mean.tolist(),
        "overlap_with_ioi": {"k": k, "shared": shared, "share": len(shared) / k},
    }


def run_study(
    model: HeadModel,
    *,
    n_patch: int = 8,
    n_eval: int = 80,
    k: int = 10,
    log: Callable[[str], object] = print,
    checkpoint: Callable[[dict[str, Any]], object] | None = None,
) -> dict:
    """Run every part (see the module docstring) and return the results as one dict;
    `checkpoint(res)` (optional) is called with the partial results after every step."""
    opts = SweepOptions(max_rows=64, progress=False)
    res: dict[str, Any] = {
        "schema": "headsteer/patching-study",
        "model": model.name,
        "n_patch": n_patch,
        "k": k,
    }
    t0 = time.perf_counter()

    def done(what: str) -> None:
        res["seconds"] = round(time.perf_counter() - t0, 1)
        log(f"[{res['seconds']:7.1f}s] {what}")
        if checkpoint is not None:
            checkpoint(res)

    # cheap parts first (one or two forwards each), then the sweeps; `checkpoint` sees each step
    ioi_eval = encode_pairs(model, load_task_pairs("ioi", "test", n=n_eval))
    res["ioi"] = {"accuracy": clean_accuracy(model, ioi_eval)}
    done(f"IOI accuracy {res['ioi']['accuracy']}")
    res["ioi"]["dla_top"] = _dla_top(model, ioi_eval, k)
    done("IOI DLA")
    co_eval = encode_pairs(model, load_task_pairs("colored_objects", "test", n=n_eval))
    res["colored_objects"] = {"accuracy": clean_accuracy(model, co_eval)}
    done(f"Colored Objects accuracy {res['colored_objects']['accuracy']}")
    cm = encode_pairs(model, load_task_pairs("comp_mech", "test", n=n_eval))
    res["comp_mech"] = {"accuracy": clean_accuracy(model, cm)}
    cm_layers = comp_mech_layers(model, cm, k)
    res["comp_mech"]["heads_for_current"] = cm_layers.pop("heads_for_current")
    res["comp_mech"]["heads_for_earlier"] = cm_layers.pop("heads_for_earlier")
    res["comp_mech"]["layers"] = cm_layers
    done("comp-mech logit inspection")
    try:
        half = list(range(model.n_layers // 2, model.n_layers))
        res["ioi"]["knockout"] = knockout_experiment(model, ioi_eval, half)
        done("IOI knockout")
    except ImportError:  # steer.knockout not available in this checkout
        res["ioi"]["knockout"] = None
    ioi = encode_pairs(model, load_task_pairs("ioi", "test", n=n_patch))
    try:
        from heads.scorers.patching.path import path_patch

        pp = path_patch(model, ioi, receivers="logits", options=opts)
        res["ioi"]["path_logits_top"] = top_heads(pp, k)
        res["ioi"]["path_logits_mean"] = pp.mean.tolist()
        done("IOI path patching to the logits")
    except ImportError:  # path patching not available in this checkout
        res["ioi"]["path_logits_top"] = None
    hp = patch(model, ioi, "head_out", options=opts)
    res["ioi"]["head_out_top"] = top_heads(hp, k)
    res["ioi"]["head_out_mean"] = hp.mean.tolist()
    done("IOI head_out patching")
    ioi_top = [h["head"] for h in res["ioi"]["head_out_top"]]
    res["colored_objects"].update(colored_objects_patching(model, n_patch, ioi_top, k, opts))
    done("Colored Objects head_out patching")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


@torch.no_grad()
def knockout_experiment(model: HeadModel, pairs: PairBatch, layers: Sequence[int]) -> dict[str, Any]:
    """Attention knockout (Geva et al. 2023) on IOI clean prompts: in `layers` (every head),
    block the last position's attention to the indirect-object token, to both subject tokens,
    or to the token before the indirect object (a control of one key, like the IO knockout);
    the mean clean logit difference (IO - S) with 95% intervals in each case."""
    from heads.engine.context import editing
    from heads.inputs.prompts import EncodedPrompts, position_ids
    from steer.knockout import Knockout

    n = pairs.n
    enc = EncodedPrompts(pairs.clean_ids, pairs.attention_mask, [[] for _ in range(n)], [""] * n, [[]] * n)
    io_pos, s_pos, ctrl = [], [], []
    for i in range(n):
        row = pairs.clean_ids[i].tolist()
        io, sub = int(pairs.answers[i, 0]), int(pairs.counterfactuals[i, 0])
        io_pos.append([j for j, t in enumerate(row) if t == io][:1])
        s_pos.append([j for j, t in enumerate(row) if t == sub])
        ctrl.append([io_pos[-1][0] - 1])

    def ld(keys: list[list[int]] | None) -> torch.Tensor:
        edits = (
            [] if keys is None else Knockout(keys=keys, queries=[-1], layers=list(layers)).edits(model, enc)
        )
        with editing(model, edits):
            lg = (
                model.model(
                    input_ids=pairs.clean_ids,
                    attention_mask=pairs.attention_mask,
                    position_ids=position_ids(pairs.attention_mask),
                )
                .logits[:, -1]
                .float()
            )
        margin: torch.Tensor = (
            lg.gather(1, pairs.answers[:, :1])[:, 0] - lg.gather(1, pairs.counterfactuals[:, :1])[:, 0]
        )
        return margin

    def summary(x: torch.Tensor) -> dict[str, Any]:
        se = float(x.std()) / max(1, len(x)) ** 0.5
        m = float(x.mean())
        ci = [round(m - 1.96 * se, 4), round(m + 1.96 * se, 4)]
        return {"mean": round(m, 4), "ci": ci, "positive": round(float((x > 0).float().mean()), 4)}

    return {
        "n": n,
        "layers": [int(x) for x in layers],
        "none": summary(ld(None)),
        "block_io": summary(ld(io_pos)),
        "block_s": summary(ld(s_pos)),
        "block_token_before_io": summary(ld(ctrl)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write (must not exist unless --force)")
    ap.add_argument("--n-patch", type=int, default=8)
    ap.add_argument("--n-eval", type=int, default=80)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--force", action="store_true")
    ap.add_argument(
        "--parts",
        default="all",
        help="'all' (default), or a comma list of co_patch,comp_mech: recompute only those parts "
        "into the existing --out (needs --force; co_patch reads IOI's head_out_top from it)",
    )
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",")]
    if parts != ["all"] and any(p not in ("co_patch", "comp_mech") for p in parts):
        raise SystemExit(
            f"--parts must be 'all' or a comma list of co_patch, comp_mech; got {short_repr(args.parts)}"
        )
    from heads import load_model
    from heads._util.files import check_output, write_text

    check_output(args.out, overwrite=args.force)
    model = load_model()

    def save(res: dict) -> None:
        write_text(args.out, json.dumps(res, indent=1) + "\n", overwrite=True)

    if parts != ["all"]:
        from heads._util.validation import read_json_file

        res = read_json_file(args.out)  # one line: not JSON (line, column), a number too large
        t0 = time.perf_counter()
        if "comp_mech" in parts:
            cm = encode_pairs(model, load_task_pairs("comp_mech", "test", n=args.n_eval))
            cm_layers = comp_mech_layers(model, cm, args.k)
            res["comp_mech"]["heads_for_current"] = cm_layers.pop("heads_for_current")
            res["comp_mech"]["heads_for_earlier"] = cm_layers.pop("heads_for_earlier")
            res["comp_mech"]["layers"] = cm_layers
            print(f"[{time.perf_counter() - t0:7.1f}s] comp-mech layers", flush=True)
            save(res)
        if "co_patch" in parts:
            ioi_top = [h["head"] for h in res["ioi"]["head_out_top"]]
            res["colored_objects"].update(colored_objects_patching(model, args.n_patch, ioi_top, args.k))
            print(f"[{time.perf_counter() - t0:7.1f}s] Colored Objects head_out patching", flush=True)
            save(res)
        res.setdefault("parts_seconds", {})[args.parts] = round(time.perf_counter() - t0, 1)
        save(res)
        return
    res = run_study(
        model,
        n_patch=args.n_patch,
        n_eval=args.n_eval,
        k=args.k,
        log=lambda m: print(m, flush=True),
        checkpoint=save,
    )
    save(res)
    print(json.dumps({k: v for k, v in res.items() if k in ("model", "seconds")}))


if __name__ == "__main__":
    main()
