"""PASTA profiling of every head on 32 examples of one task: batched engine vs one head at a time.

The loop is what a practitioner writes: for each head, one forward of all examples with PASTA
on that head alone (`Pasta(heads=[h])`, the same engine edits), only the last position
unembedded (`logits_to_keep=1`), and the mean change of the target token's log-prob. It is
timed on `--loop-heads` heads spread over all layers and extrapolated to all heads;
`same_ranking` compares the two rankings of those heads.

The engine (`steer.pasta.profiling.profile_heads`) packs heads into batch rows, starts each batch at
its heads' layer from the clean residual stream, takes positions before the span from the
clean KV cache, and unembeds only the last position.

Prints one JSON line: {"speedup", "same_ranking", ...}. `--save DIR` also writes the engine's
profile (HeadScores JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import SweepOptions, editing, encode_prompts, forward, load_model
from probes.datasets.tasks import load_task
from steer.pasta.method import Pasta
from steer.pasta.profiling import profile_heads, target_ids


def task_inputs(name: str, split: str, n: int) -> tuple[list[str], list[str], list[str], bool]:
    """Prompts, emphasized substrings, targets and the chat flag of the first `n` examples."""
    task = load_task(name, split)
    ex = task.examples[:n]
    return [e.prompt for e in ex], [e.emphasize for e in ex], [e.answer for e in ex], task.chat


def _last_logits(hm, enc) -> torch.Tensor:
    """`[B, V]` last-position logits, unembedding only that position (`logits_to_keep=1`, as a
    user who needs one position writes it)."""
    return forward(hm, enc, logits_to_keep=1).logits[:, -1].float()


@torch.no_grad()
def loop_profile(hm, prompts, emphasize, targets, chat, heads) -> list[float]:
    enc = encode_prompts(hm.tokenizer, prompts, emphasize=emphasize, chat=chat)
    tgt = target_ids(hm.tokenizer, targets)[:, None]
    base = torch.log_softmax(_last_logits(hm, enc), -1).gather(1, tgt)[:, 0]
    out = []
    for h in heads:
        with editing(hm, Pasta(heads=[h]).edits(hm, enc)):
            lp = torch.log_softmax(_last_logits(hm, enc), -1).gather(1, tgt)[:, 0]
        out.append((lp - base).mean().item())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="json_format")
    ap.add_argument("--examples", type=int, default=32)
    ap.add_argument("--loop-heads", type=int, default=27)
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    hm = load_model()
    prompts, emphasize, targets, chat = task_inputs(args.task, "train", args.examples)
    t0 = time.perf_counter()
    prof = profile_heads(
        hm,
        prompts,
        targets,
        emphasize=emphasize,
        chat=chat,
        task=args.task,
        options=SweepOptions(max_rows=args.max_rows),
    )
    engine_s = time.perf_counter() - t0
    if args.save:
        # --save names a folder of benchmark outputs: a rerun replaces them
        prof.save(os.path.join(args.save, f"{args.task}.json"), overwrite=True)
    n_heads = hm.n_layers * hm.n_heads
    step = max(1, n_heads // args.loop_heads)
    sample = [divmod(i, hm.n_heads) for i in range(0, n_heads, step)][: args.loop_heads]
    t0 = time.perf_counter()
    loop = loop_profile(hm, prompts, emphasize, targets, chat, sample)
    loop_s = (time.perf_counter() - t0) / len(sample) * n_heads
    engine = [prof.scores[la, h].item() for la, h in sample]

    def rank(values: list[float]) -> list[int]:
        return sorted(range(len(values)), key=lambda i: (-values[i], i))

    print(
        json.dumps(
            {
                "speedup": round(loop_s / engine_s, 2),
                "same_ranking": rank(engine) == rank(loop),
                "max_abs_diff": max(abs(a - b) for a, b in zip(engine, loop, strict=True)),
                "engine_seconds": round(engine_s, 1),
                "loop_seconds_extrapolated": round(loop_s, 1),
                "loop_heads_timed": len(sample),
                "heads": n_heads,
                "examples": len(prompts),
                "task": args.task,
                "loop_logits": "last position only (logits_to_keep=1)",
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
