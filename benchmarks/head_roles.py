"""Head-role detectors on every head of the embedded model vs TransformerLens' `detect_head` loop;
Attention Lens training cost and quality.

Detectors: TransformerLens 4.3's `transformer_lens.head_detector.detect_head` runs on a
`TransformerBridge` (it needs only `cfg`, `to_tokens` and `run_with_cache`): for each of its
three heads (previous-token, duplicate-token, induction) and each text it runs one cached
forward and loops over the 270 heads. headsteer's `pattern_scores` computes all five pattern
detectors of every head from one batched forward, reducing the pattern inside the forward.
Both score the same token rows (the bridge's `to_tokens` of each text: BOS + the text, the text
being a corpus sentence repeated twice so that induction and duplicate tokens occur), with
`rows="all"`, TransformerLens' normalisation.

Lens: `train_lens` on `--lens-heads` heads (one per layer, spread over the model), the shipped
corpus, default settings; seconds per head and the median held-out KL ratio (lens / untrained).

Prints one JSON line: {"speedup_vs_transformer_lens", "max_abs_diff_vs_transformer_lens",
"lens_seconds_per_head", "lens_kl_ratio_median", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import SweepOptions, load_model
from heads.scorers.roles import detect_roles, pattern_scores, train_lens
from probes.datasets.corpus import load_corpus

TL_NAMES = {
    "previous_token": "previous_token_head",
    "duplicate_token": "duplicate_token_head",
    "induction": "induction_head",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--lens-heads", type=int, default=6)
    ap.add_argument("--lens-epochs", type=int, default=4)
    args = ap.parse_args()
    from transformer_lens.head_detector import detect_head
    from transformer_lens.model_bridge import TransformerBridge

    torch.manual_seed(0)
    hm = load_model()
    corpus = load_corpus()
    texts = [f"{s} {s}" for s in corpus[: args.texts]]

    tl_model = load_model()
    bridge = TransformerBridge.boot_transformers(
        tl_model.name, hf_model=tl_model.model, tokenizer=tl_model.tokenizer
    )
    rows = [bridge.to_tokens(t)[0] for t in texts]
    detect_head(bridge, texts[0], "previous_token_head")  # warm-up
    t0 = time.perf_counter()
    tl = {ours: detect_head(bridge, texts, name).float() for ours, name in TL_NAMES.items()}
    tl_s = time.perf_counter() - t0

    pattern_scores(hm, rows[:1])  # warm-up
    t0 = time.perf_counter()
    mine = pattern_scores(hm, rows, rows="all")
    ours_s = time.perf_counter() - t0
    diff = max(float((mine[n].scores - tl[n]).abs().max()) for n in TL_NAMES)

    t0 = time.perf_counter()
    roles = detect_roles(hm)
    roles_s = time.perf_counter() - t0

    step = max(1, hm.n_layers // args.lens_heads)
    heads = [(la, (la * 4) % hm.n_heads) for la in range(0, hm.n_layers, step)][: args.lens_heads]
    lens = train_lens(
        hm, corpus, heads, epochs=args.lens_epochs, max_positions=2048, options=SweepOptions(progress=False)
    )
    ratio = lens.held_out_kl / lens.untrained_kl

    def top(name: str, k: int = 5) -> list:
        s = roles.head_scores(name)
        return [[la, h, round(float(s.scores[la, h]), 3)] for la, h in s.ranked(k)]

    print(
        json.dumps(
            {
                "speedup_vs_transformer_lens": round(tl_s / ours_s, 2),
                "max_abs_diff_vs_transformer_lens": diff,
                "lens_seconds_per_head": round(lens.params["seconds"] / len(heads), 2),
                "lens_kl_ratio_median": round(float(ratio.median()), 4),
                "lens_share_improved": float((ratio < 1).float().mean()),
                "lens_heads": [list(h) for h in heads],
                "lens_epochs_run": lens.params["epochs_run"],
                "texts": len(texts),
                "heads": hm.n_layers * hm.n_heads,
                "ours_seconds": round(ours_s, 2),
                "transformer_lens_seconds": round(tl_s, 2),
                "all_detectors_seconds": round(roles_s, 1),
                "top_induction": top("induction"),
                "top_previous_token": top("previous_token"),
                "top_duplicate_token": top("duplicate_token"),
                "top_successor": top("successor"),
                "top_retrieval": top("retrieval"),
                "top_copying": top("copying"),
                "n_induction_gt_0.5": int((roles.head_scores("induction").scores > 0.5).sum()),
            }
        )
    )


if __name__ == "__main__":
    main()
