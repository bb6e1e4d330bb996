"""Head-output patching and path patching on the embedded model vs TransformerLens and a plain loop.

Pairs: `--pairs` (default 32) IOI-like prompt pairs built here from one template with single-token
names ("When A and B went to the P, B gave a O to" -> answer A, counterfactual B; corrupted by
the ABC distribution: the second B replaced by a third name C), all of the same token length, so
neither side pads.

Figures (one JSON line, every ratio measured in this run, on the same load):

* `speedup_vs_transformer_lens`: TransformerLens' `patching.get_act_patch_attn_head_out_by_pos`
  (on a `TransformerBridge` of the same weights; its clean cache included) over headsteer's
  `patch(model, pairs, "head_out_by_pos")` (its clean and corrupted runs included), both for
  every head x every position x every layer. With `--layer-step` / `--pos-step` > 1 the engine
  runs on that strided subset of cells and TransformerLens on `--tl-cells` of them (spread); each
  side's sweep time is then extrapolated to the whole grid — TransformerLens per cell (one full
  forward per cell), the engine through the work lower bound below (engine time / lower bound
  is measured on the subset) — and the line says so (`extrapolated_from`).
* `max_abs_diff_vs_transformer_lens`: largest |difference| of the raw metric (logit difference,
  per pair) on the cells both ran.
* `engine_over_lower_bound`: engine sweep time over the work lower bound. A variant (layer l,
  head, position p) on N pairs must recompute layers l..L-1 at positions p..T-1 (earlier layers
  and, under causal attention, earlier positions equal the base run). The bound is the sum over
  variants of `N * (L - l) / L` forward-equivalents, each priced at one *unedited* forward's
  measured time per row at the same batch shape: `--max-rows` rows of the `T - p` columns after
  a `p`-column KV cache (`run_rows(..., past=...)`, last position unembedded), measured once per
  distinct `p` (best of two). Pricing per row of a full `--max-rows` batch makes the bound
  conservative for smaller final chunks. For the full-grid extrapolation the per-row time of an
  unmeasured `p` is interpolated linearly between the measured ones (`lower_bound_shapes`).
  Rows whose clean and corrupted head outputs are bitwise equal (every position before the
  first token where the prompts differ: 9 of the 14 here) patch nothing and must recompute
  nothing, so the bound counts only the changed rows (`changed_rows_share` of all);
  `engine_over_bound_of_every_variant` counts every row (the definition before the engine
  skipped those rows), and `speedup_if_every_row_changed` is the speedup the same engine speed
  would give on pairs that differ from their first token (every row then changes).
* `engine_over_tight_bound`: the same over a tighter bound: a patch of layer l's head output at
  column p changes only column p of that layer's output, so the bound counts layer l at column
  p alone (one layer of a one-column forward, `per_row(T - 1) / L`) and layers l+1..L-1 at
  columns p..T-1 — what `patch(..., "head_out_by_pos")` now recomputes.
* `path_patching_speedup`: the three-run loop written plainly (one whole forward per sender with
  every other head frozen by hooks; its two base runs counted once) over `path_patch(model,
  pairs)` (all senders -> logits, MLPs recomputed); with `--loop-senders` < 270 the loop runs on
  that many senders (spread) and is extrapolated per sender. `path_max_abs_diff` compares them.

`--clock process` times every side in CPU seconds of this process (`time.process_time`): with
`OMP_NUM_THREADS=1` on a shared CPU machine the other jobs then do not enter the ratios (they
still share caches and memory bandwidth); the default `wall` is what a GPU run needs.

Usage: `OMP_NUM_THREADS=1 python benchmarks/patching.py --tl-cells 12 --loop-senders 6
--max-rows 288 --clock process` (the engine on the full grid, TransformerLens and the loop on a
few cells / senders: about 6 CPU minutes); `--layer-step 10 --pos-step 3 --tl-cells 3
--loop-senders 2 --pairs 8` for a quick look. Without `--tl-cells` TransformerLens runs every
cell (one forward each: hours on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import SweepOptions, load_model
from heads.engine.variants import run_rows
from heads.inputs.prompts import position_ids
from heads.scorers.patching import PromptPair, encode_pairs, path_patch
from heads.scorers.patching.activation import patch, record_run

NAMES = [" Mary", " John", " Anna", " Tom", " James", " Sarah", " David", " Emma", " Paul", " Lisa", " Mark"]
PLACES = [" store", " park", " school", " beach"]
OBJECTS = [" drink", " book", " ball", " gift"]


def ioi_pairs(n: int) -> list[PromptPair]:
    """`n` IOI-like pairs (deterministic), ABC corruption."""
    out: list[PromptPair] = []
    k = 0
    while len(out) < n:
        a, b, c = NAMES[k % 11], NAMES[(k * 3 + 1) % 11], NAMES[(k * 7 + 2) % 11]
        k += 1
        if len({a, b, c}) < 3:
            continue
        p, o = PLACES[k % 4], OBJECTS[(k // 4) % 4]
        clean = f"When{a} and{b} went to the{p},{b} gave a{o} to"
        corrupt = f"When{a} and{b} went to the{p},{c} gave a{o} to"
        out.append(PromptPair(clean, corrupt, a, b))
    return out


CLOCK = time.perf_counter  # --clock process: time.process_time (CPU seconds of this process)


def timed(fn):
    t0 = CLOCK()
    out = fn()
    return out, CLOCK() - t0


@torch.no_grad()
def three_run_loop(model, pairs, senders):
    """Per sender, the plain procedure: base = clean run, sender's output from the corrupted run,
    every other head frozen to the clean run (hooks on every `o_proj` input), MLPs recomputed."""
    H, d = model.n_heads, model.d_head
    mask = pairs.attention_mask
    pos = position_ids(mask)

    def run(ids, z_fn=None):
        seen, hs = {}, []
        for la in range(model.n_layers):

            def pre(mod, args, la=la):
                x = args[0].reshape(*args[0].shape[:-1], H, d)
                if z_fn is not None:
                    x = z_fn(la, x)
                seen[la] = x
                return (x.reshape(args[0].shape),)

            hs.append(model.out_projs[la].register_forward_pre_hook(pre))
        try:
            out = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
        finally:
            for h in hs:
                h.remove()
        return out.logits[:, -1].float(), seen

    _, z_clean = run(pairs.clean_ids)
    _, z_corrupt = run(pairs.corrupted_ids)
    res = {}
    for ls, hs_ in senders:

        def z2(la, z, ls=ls, hs_=hs_):
            z = z_clean[la].clone()
            if la == ls:
                z[:, :, hs_] = z_corrupt[la][:, :, hs_]
            return z

        res[(ls, hs_)] = run(pairs.clean_ids, z2)[0]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--layer-step", type=int, default=1)
    ap.add_argument("--pos-step", type=int, default=1)
    ap.add_argument("--tl-cells", type=int, default=0, help="TransformerLens cells (0 = every engine cell)")
    ap.add_argument("--loop-senders", type=int, default=0, help="senders in the three-run loop (0 = all)")
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--skip-path", action="store_true", help="leave out the path-patching comparison")
    ap.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="wall: time.perf_counter; process: CPU seconds of this process (time.process_time), "
        "insensitive to other jobs on a shared CPU machine when run with one thread (CPU only)",
    )
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "process" else time.perf_counter

    model = load_model()
    tl = load_model(backend="transformer_lens")
    bridge: Any = tl.backend.native
    pairs = encode_pairs(model.tokenizer, ioi_pairs(args.pairs))
    assert bool(pairs.attention_mask.all()), "the template pairs must share one token length"
    L, H, T, N = model.n_layers, model.n_heads, pairs.width, pairs.n
    rows = torch.arange(N)
    c, w = pairs.answers[:, 0], pairs.counterfactuals[:, 0]

    def ld(logits):  # TransformerLens metric: [N, T, V] -> [N]
        last = logits[:, -1].float()
        return last[rows, c] - last[rows, w]

    # one forward of the pairs (the unit of the lower bound): best of 2
    fwd = min(timed(lambda: run_rows(model, pairs.clean_ids, pairs.attention_mask, []))[1] for _ in range(2))

    layers = list(range(0, L, args.layer_step))
    positions = list(range(0, T, args.pos_step))
    if positions[-1] != T - 1:
        positions.append(T - 1)
    opts = SweepOptions(max_rows=args.max_rows, progress=False)
    ((rec_clean, rec_corrupt), t_rec) = timed(
        lambda: (
            record_run(model, pairs.clean_ids, pairs.attention_mask),
            record_run(model, pairs.corrupted_ids, pairs.attention_mask),
        )
    )
    # [L, T, H]: pairs whose clean and corrupted head output differ there (the others are no-ops)
    changed = torch.stack(
        [(rec_clean.z[la] != rec_corrupt.z[la]).any(-1).sum(0).float().cpu() for la in range(L)]
    )
    res, t_engine = timed(
        lambda: patch(model, pairs, "head_out_by_pos", layers=layers, positions=positions, options=opts)
    )
    t_sweep = max(t_engine - t_rec, 1e-9)  # the sweep without its two recorded runs

    # the lower bound's unit: one unedited forward per row at the sweep's batch shape, per p
    R = args.max_rows
    rep = torch.arange(R) % N
    ids_r, mask_r = pairs.corrupted_ids[rep], pairs.attention_mask[rep]
    base_kv = record_run(model, ids_r, mask_r).kv
    row_time: dict[int, float] = {}
    for p in positions:
        past = [(k[:, :, :p], v[:, :, :p]) for k, v in base_kv] if p else None
        row_time[p] = (
            min(
                timed(lambda p=p, past=past: run_rows(model, ids_r[:, p:], mask_r, [], past=past))[1]
                for _ in range(2)
            )
            / R
        )

    def per_row(p: int) -> float:
        if p in row_time:
            return row_time[p]
        ks = sorted(row_time)
        lo = max([k for k in ks if k <= p], default=ks[0])
        hi = min([k for k in ks if k >= p], default=ks[-1])
        if lo == hi:
            return row_time[lo]
        return row_time[lo] + (row_time[hi] - row_time[lo]) * (p - lo) / (hi - lo)

    def work(lays, poss, every=False):  # seconds; rows: the changed (head, pair)s, or every one
        return sum(
            (N * H if every else float(changed[la, p].sum())) * (L - la) / L * per_row(p)
            for la in lays
            for p in poss
        )

    def tight_work(lays, poss):  # layer l at column p only (what head_out_by_pos now runs)
        last = per_row(T - 1) / L
        return sum(
            float(changed[la, p].sum())
            * ((L - la - 1) / L * per_row(p) + (last if la < L - 1 or p == T - 1 else 0.0))
            for la in lays
            for p in poss
        )

    lb_sub = work(layers, positions)
    engine_over_lb = t_sweep / max(lb_sub, 1e-9)
    engine_over_tight = t_sweep / max(tight_work(layers, positions), 1e-9)
    engine_over_every = t_sweep / work(layers, positions, every=True)

    cells = [(la, p, h) for la in layers for p in positions for h in range(H)]
    n_tl = len(cells) if args.tl_cells <= 0 else min(args.tl_cells, len(cells))
    pick = [cells[round(i * (len(cells) - 1) / max(n_tl - 1, 1))] for i in range(n_tl)]
    import pandas as pd
    import transformer_lens.patching as P

    (_, clean_cache), t_cache = timed(lambda: bridge.run_with_cache(pairs.clean_ids))
    tl_res, t_tl = timed(
        lambda: P.get_act_patch_attn_head_out_by_pos(
            bridge,
            pairs.corrupted_ids,
            clean_cache,
            ld,
            index_axis_names=None,
            index_df=pd.DataFrame(pick, columns=["layer", "pos", "head"]),
            reduce="none",
        )
    )
    tl_vals = tl_res.values.cpu()
    diff = max(
        float((tl_vals[i] - res.raw[layers.index(la), h, positions.index(p)]).abs().max())
        for i, (la, p, h) in enumerate(pick)
    )
    per_cell = t_tl / n_tl
    full_cells = L * H * T
    tl_full = t_cache + per_cell * full_cells
    engine_full = t_rec + engine_over_lb * work(range(L), range(T))
    subset = len(cells) < full_cells or n_tl < len(cells)

    # path patching: all senders -> logits vs the plain three-run loop
    path: dict = {}
    if not args.skip_path:
        senders = [(la, h) for la in range(L) for h in range(H)]
        pres, t_path = timed(
            lambda: path_patch(
                model, pairs, options=SweepOptions(max_rows=max(args.max_rows, 512), progress=False)
            )
        )
        n_loop = len(senders) if args.loop_senders <= 0 else args.loop_senders
        loop_s = [senders[round(i * (len(senders) - 1) / max(n_loop - 1, 1))] for i in range(n_loop)]
        (loop, t_loop) = timed(lambda: three_run_loop(model, pairs, loop_s))
        idx = torch.arange(N)
        from heads.scorers.patching.metrics import get_metric

        met = get_metric()
        clean_logits = record_run(model, pairs.clean_ids, pairs.attention_mask).logits
        path_diff = max(
            float((pres.raw[s] - met(loop[s], pairs, idx, clean_logits)).abs().max()) for s in loop_s
        )
        # the loop's two base runs are 2 of its n_loop + 2 forwards; the rest scales per sender
        t_loop_full = t_loop * (len(senders) + 2) / (n_loop + 2)

        path = {
            "path_patching_speedup": round(t_loop_full / t_path, 2),
            "path_max_abs_diff": path_diff,
            "path_engine_s": round(t_path, 2),
            "path_loop_s": round(t_loop, 2),
            "path_loop_senders": n_loop,
        }
    line = {
        "benchmark": "patching",
        "model": model.name,
        "pairs": N,
        "tokens_per_prompt": T,
        "cells_full_grid": full_cells,
        "speedup_vs_transformer_lens": round(tl_full / engine_full, 2),
        "max_abs_diff_vs_transformer_lens": diff,
        "engine_over_lower_bound": round(engine_over_lb, 3),
        "engine_over_tight_bound": round(engine_over_tight, 3),
        "engine_over_bound_of_every_variant": round(engine_over_every, 3),
        "changed_rows_share": round(float(changed.sum()) / (L * T * H * N), 3),
        "speedup_if_every_row_changed": round(
            tl_full / (t_rec + engine_over_lb * work(range(L), range(T), every=True)), 2
        ),
        **{k: v for k, v in path.items() if k in ("path_patching_speedup", "path_max_abs_diff")},
        "forward_s": round(fwd, 3),
        "engine_s": round(t_engine, 2),
        "engine_cells": len(cells),
        "tl_s": round(t_tl + t_cache, 2),
        "tl_cells": n_tl,
        **{
            k: v
            for k, v in path.items()
            if k.startswith("path_") and k not in ("path_patching_speedup", "path_max_abs_diff")
        },
        "lower_bound_shapes": {str(p): round(t * R, 3) for p, t in sorted(row_time.items())},
        "max_rows": R,
        "torch_threads": torch.get_num_threads(),
        "clock": args.clock,
    }
    n_loop = int(path.get("path_loop_senders", 270))
    if subset or n_loop < L * H:
        line["tl_extrapolated_from"] = (
            f"engine on layers every {args.layer_step} x positions every {args.pos_step} (+ last) "
            "x all heads "
            f"({len(cells)} cells), TransformerLens on {n_tl} of those cells, each extrapolated to the "
            f"{full_cells}-cell grid (TL per cell, engine by its measured time over the work lower bound); "
            f"three-run loop on {n_loop} of {L * H} senders, extrapolated per sender"
        )
        line["speedup_on_subset_cells"] = round((t_cache + per_cell * len(cells)) / t_engine, 2)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
