"""Generation throughput: unsteered (SDPA) vs PASTA through headsteer vs a reference-style PASTA;
also InstABoost (all layers and heads, fused per-column bias) and CAA (one residual vector added at
layer 15's output from the last prompt token on) over unsteered.

Embedded SmolLM2-135M-Instruct, a ~256-token prompt, 64 new tokens, greedy, batch 1.
The reference-style implementation does what the PASTA reference code does: eager
attention in every layer, with the additive mask copied per head ([B, H, T, T]) and
log(alpha) added on the steered heads' columns. Variants run interleaved, `--repeats`
times each; the median wall time counts. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from heads import SweepOptions, load_model, span_attention
from steer import Caa, InstaBoost, Pasta, SteeredModel
from steer.pasta.method import pasta_column_bias

BIO = (
    "Maria Gonzalez was born in 1978 in Valencia, Spain. She studied marine biology at the University of "
    "Barcelona and spent ten years on research ships in the Atlantic, where she tracked migrating whales. "
    "In 2015 she moved to Lisbon and founded a small company that builds underwater microphones. "
)
_REF: dict = {}


def reference_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """PASTA reference style: per-head copy of the additive mask, eager softmax in every layer."""
    groups = module.num_key_value_groups
    key = key.repeat_interleave(groups, 1)
    value = value.repeat_interleave(groups, 1)
    b, h, q, _ = query.shape
    k = key.shape[2]
    mask = attention_mask[..., :k].expand(b, h, q, k).clone()  # the reference's (B, H, T, T) copy
    heads = _REF["heads"].get(module.layer_idx)
    if heads:
        cb = _REF["column_bias"]
        n = min(k, cb.shape[1])
        mask[:, heads, :, :n] += cb[:, None, None, :n]
    w = torch.softmax(query @ key.transpose(-1, -2) * scaling + mask, dim=-1, dtype=torch.float32)
    return (w.to(value.dtype) @ value).transpose(1, 2).contiguous(), w


AttentionInterface.register("pasta_reference", reference_attention)
AttentionMaskInterface.register("pasta_reference", eager_mask)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--heads", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    hm = load_model()
    sm = SteeredModel(hm)
    tok = hm.tokenizer
    text = BIO
    while len(tok(text)["input_ids"]) < args.prompt_tokens - 40:
        text += BIO
    prompt = f"{text}\n**Answer in JSON with the keys name and occupation.**\nWhat does Maria do?"
    heads = span_attention(hm, prompt).top(args.heads)
    pasta = Pasta(heads)
    enc = sm.encode(prompt)
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    boost = InstaBoost()
    pairs = [("I love it, wonderful", "I hate it, terrible"), ("Yes, gladly", "No, never")]
    caa = Caa.from_pairs(hm, pairs, layer=15, coefficient=4.0, options=SweepOptions(progress=False))

    def unsteered():
        return sm.generate(prompt, **gen)

    def headsteer():
        return sm.generate(prompt, steer=[pasta], **gen)

    def reference():
        _REF["heads"] = heads.by_layer()
        _REF["column_bias"] = pasta_column_bias(enc, pasta.alpha)
        cfg = hm.model.config
        old = cfg._attn_implementation
        cfg._attn_implementation_internal = "pasta_reference"
        try:
            return sm.generate(prompt, **gen)
        finally:
            cfg._attn_implementation_internal = old

    def instaboost():
        return sm.generate(prompt, steer=[boost], **gen)

    def caa_steer():
        return sm.generate(prompt, steer=[caa], **gen)

    variants = {
        "unsteered": unsteered,
        "headsteer": headsteer,
        "reference": reference,
        "instaboost": instaboost,
        "caa": caa_steer,
    }
    times = {k: [] for k in variants}
    outs = {}
    for fn in variants.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: args.new_tokens / v for k, v in med.items()}
    print(
        json.dumps(
            {
                "steered_over_unsteered": round(tps["headsteer"] / tps["unsteered"], 3),
                "reference_over_unsteered": round(tps["reference"] / tps["unsteered"], 3),
                "instaboost_over_unsteered": round(tps["instaboost"] / tps["unsteered"], 3),
                "caa_over_unsteered": round(tps["caa"] / tps["unsteered"], 3),
                "tokens_per_s": {k: round(v, 2) for k, v in tps.items()},
                "prompt_tokens": enc.length,
                "new_tokens": args.new_tokens,
                "heads": len(heads),
                "layers_steered": len(heads.by_layer()),
                "same_tokens_as_reference": outs["headsteer"].token_ids == outs["reference"].token_ids,
                "log_alpha": math.log(pasta.alpha),
            }
        )
    )


if __name__ == "__main__":
    main()
