"""Per backend (hf, transformer_lens, nnsight) on the embedded model, fp32, default attention:

* `steered_over_unsteered`: PASTA-steered over unsteered greedy-generation throughput (tokens/s
  ratio; goal >= 0.9 on each backend): 4 prompts, `--new-tokens` forced (`min_new_tokens`, so
  both generate the same number), KV cache on, PASTA on every head of layers 8, 12 and 16.
* `ships_speedup`: a Ships sweep (UA ablation, query x 1e-5, KL at the last position) with the
  variant engine (`heads.scorers.safety.ships.ships`: head variants packed into batch rows, each
  batch starting at its layer from the clean residual stream, one unembedded position, length-sorted batches)
  over a per-head loop written with the backend's own tools (goal >= 3x). The sweep is sized
  like real use: every head of every `--layer-step`-th layer from layer 1 (default 1, 4, ..., 28:
  90 heads whose mean layer, 14.5, is the mean layer of the whole model, so the layer-prefix
  saving is that of a full sweep) x `--prompts` harmful prompts (default 8, keeping the whole
  run near 15 min on a quiet 2-core machine; `--prompts 16` as `benchmarks/head_scoring.py`
  gave CPU-time ratios within 0.11 of these). The loop is the one a practitioner writes: per head, one
  forward of all prompts with the head's query slice scaled by eps, then the last position of
  the logits:
  - hf: a forward hook on `q_proj` of the head's layer, `model(...)`;
  - transformer_lens: `bridge.run_with_hooks` with a hook on `blocks.{l}.attn.hook_q`;
  - nnsight: `lm.trace(...)` writing `self_attn.q_proj.output` in place.
  `ships_speedup_last_only` is against the same loop given `logits_to_keep=1` (only the last
  position unembedded: the engine's unembedding saving taken away, leaving its layer-prefix
  and batching savings). `ships_max_abs_diff` checks engine and loop give the same scores (nats).

Runs are interleaved (unsteered, steered, ... and engine, loop, ...) `--repeats` times and the
median counts; every ratio is also given from this process's CPU time (`*_cpu`), which other
jobs on a shared machine disturb less than the wall clock. On a loaded machine use `--threads 1`:
with more torch threads than free cores a single run can take several times its quiet time
(measured: the same HF generation took 20 s in one run and 70 s in another), which no repeat count fixes.

Prints one JSON line: {"steered_over_unsteered", "steered_over_unsteered_cpu", "ships_speedup",
"ships_speedup_cpu", "ships_speedup_last_only", "ships_speedup_last_only_cpu", "ships_seconds"
(median wall seconds of engine / loop / loop_last), "ships_max_abs_diff" (each keyed hf /
transformer_lens / nnsight), "heads", "layers", "prompts", "new_tokens", "repeats", "seconds",
"threads"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import HeadModel, SweepOptions, encode_prompts, load_model
from heads.scorers.safety.ships import TEMPLATE, ships
from probes.datasets.requests import load_requests
from steer import Pasta, SteeredModel

BACKENDS = ("hf", "transformer_lens", "nnsight")
PROMPTS = [
    "Answer in one word. The capital of **France** is",
    "Summarise: the **meeting moved to Friday** because the room was booked.",
    "Translate to French, **keeping it formal**: good morning",
    "List three colours, **in alphabetical order**:",
]


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(wall seconds, process CPU seconds, result) of one call."""
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t, time.process_time() - c, out


def interleaved(runs: dict[str, Callable[[], object]], repeats: int) -> tuple[dict, dict, dict]:
    """Median wall and CPU seconds per run name (runs alternate), and each run's last result."""
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    last: dict[str, object] = {}
    for _ in range(repeats):
        for name, fn in runs.items():
            w, c, last[name] = timed(fn)
            wall[name].append(w)
            cpu[name].append(c)
    med = statistics.median
    return {k: med(v) for k, v in wall.items()}, {k: med(v) for k, v in cpu.items()}, last


def _kl(base: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    return (base.exp() * (base - lp)).sum(-1).clamp(min=0.0)


@torch.no_grad()
def loop_ships(
    hm: HeadModel, enc, heads: list[tuple[int, int]], eps: float, last_only: bool = False
) -> torch.Tensor:
    """`[len(heads), N]` Ships from one forward per head, hooked with the backend's own tools
    (`last_only`: unembed only the last position)."""
    ids, mask, pos = enc.input_ids, enc.attention_mask, enc.position_ids()
    keep = {"logits_to_keep": 1} if last_only else {}
    d = hm.d_head
    kind = hm.backend.kind
    native: object = hm.backend.native

    def last_logp(layer: int | None, head: int = 0) -> torch.Tensor:
        sl = slice(head * d, (head + 1) * d)
        if kind == "transformer_lens":

            def scale_q(q, hook):  # [batch, pos, n_heads, d_head]
                q = q.clone()
                q[:, :, head] *= eps
                return q

            hooks = [] if layer is None else [(f"blocks.{layer}.attn.hook_q", scale_q)]
            logits = native.run_with_hooks(  # type: ignore[attr-defined]
                ids, fwd_hooks=hooks, attention_mask=mask, position_ids=pos, **keep
            )
        elif kind == "nnsight":
            lm: object = native
            with lm.trace(input_ids=ids, attention_mask=mask, position_ids=pos, **keep):  # type: ignore[attr-defined]
                if layer is not None:
                    q = lm.model.layers[layer].self_attn.q_proj.output  # type: ignore[attr-defined]
                    q[:, :, sl] *= eps
                saved = lm.output.logits.save()  # type: ignore[attr-defined]
            logits = saved
        else:
            handle = None
            if layer is not None:

                def scale_out(module, args, out):  # [batch, pos, n_heads * d_head]
                    out = out.clone()
                    out[:, :, sl] *= eps
                    return out

                handle = hm.attentions[layer].q_proj.register_forward_hook(scale_out)
            try:
                logits = hm.model(input_ids=ids, attention_mask=mask, position_ids=pos, **keep).logits
            finally:
                if handle is not None:
                    handle.remove()
        return torch.log_softmax(logits[:, -1].float(), dim=-1)

    base = last_logp(None)
    return torch.stack([_kl(base, last_logp(layer, head)) for layer, head in heads])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each timed run")
    ap.add_argument(
        "--layer-step", type=int, default=3, help="Ships over every head of layers 1, 1+STEP, ..."
    )
    ap.add_argument("--prompts", type=int, default=8, help="harmful prompts in the Ships sweep")
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: torch's default; 1 on a shared machine)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    start = time.perf_counter()
    queries = [r["prompt"] for r in load_requests("harmful", "train")[: args.prompts]]
    steered, steered_cpu, speedup, speedup_cpu, diff = {}, {}, {}, {}, {}
    last_only, last_only_cpu, seconds = {}, {}, {}
    heads: list[tuple[int, int]] = []
    layers: list[int] = []
    for name in args.backends.split(","):
        hm = load_model(backend=name)
        sm = SteeredModel(hm)
        pasta = Pasta(heads={layer: list(range(hm.n_heads)) for layer in (8, 12, 16)}, alpha=0.01)
        gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, chat=False)

        def plain(sm=sm, gen=gen):
            return sm.generate(PROMPTS, **gen)

        def steer(sm=sm, gen=gen, pasta=pasta):
            return sm.generate(PROMPTS, steer=[pasta], **gen)

        plain(), steer()  # warm-up
        wall, cpu, _ = interleaved({"plain": plain, "steer": steer}, args.repeats)
        steered[name] = round(wall["plain"] / wall["steer"], 3)
        steered_cpu[name] = round(cpu["plain"] / cpu["steer"], 3)

        layers = list(range(1, hm.n_layers, args.layer_step))
        heads = [(la, h) for la in layers for h in range(hm.n_heads)]
        spec = {la: list(range(hm.n_heads)) for la in layers}
        enc = encode_prompts(
            hm.tokenizer, [TEMPLATE.format(query=q) for q in queries], chat=False, markup=False
        )
        ships(hm, queries[:2], heads={layers[0]: [0]}, options=SweepOptions(progress=False))  # warm-up
        loop_ships(hm, enc, heads[:1], args.eps)

        def engine(hm=hm, spec=spec):
            quiet = SweepOptions(progress=False)
            return ships(hm, queries, heads=spec, eps=args.eps, options=quiet).per_prompt

        def loop(hm=hm, enc=enc, heads=heads):
            return loop_ships(hm, enc, heads, args.eps)

        def loop_last(hm=hm, enc=enc, heads=heads):
            return loop_ships(hm, enc, heads, args.eps, last_only=True)

        runs = {"engine": engine, "loop": loop, "loop_last": loop_last}
        wall, cpu, last = interleaved(runs, max(1, args.repeats - 1))
        speedup[name] = round(wall["loop"] / wall["engine"], 2)
        speedup_cpu[name] = round(cpu["loop"] / cpu["engine"], 2)
        last_only[name] = round(wall["loop_last"] / wall["engine"], 2)
        last_only_cpu[name] = round(cpu["loop_last"] / cpu["engine"], 2)
        seconds[name] = {k: round(v, 1) for k, v in wall.items()}
        per_prompt = last["engine"]
        assert isinstance(per_prompt, torch.Tensor)
        got = torch.stack([per_prompt[:, la, h] for la, h in heads])
        diff[name] = max(
            float((got - cast(torch.Tensor, last[k])).abs().max()) for k in ("loop", "loop_last")
        )
        del hm, sm
    print(
        json.dumps(
            {
                "steered_over_unsteered": steered,
                "steered_over_unsteered_cpu": steered_cpu,
                "ships_speedup": speedup,
                "ships_speedup_cpu": speedup_cpu,
                "ships_speedup_last_only": last_only,
                "ships_speedup_last_only_cpu": last_only_cpu,
                "ships_seconds": seconds,
                "ships_max_abs_diff": diff,
                "heads": len(heads),
                "layers": layers,
                "prompts": len(queries),
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "seconds": round(time.perf_counter() - start),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
