"""Long-context analyses: time and peak memory of each analysis against a plain forward, per length.

Embedded SmolLM2-135M (30 layers, 9 query heads over 3 KV heads), one prompt of 1k, 2k, 4k
tokens (random token ids, seeded). Each (analysis, length) runs in a fresh subprocess with glibc
returning every block of 64 KiB or more to the OS when freed (`MALLOC_MMAP_THRESHOLD_=65536`, so
RSS follows live memory): load the model, one untimed plain forward at that length (warm-up),
then the plain forward (`logits_to_keep=1`, no gradients), the analysis and `model(ids)` as a
user calls it (the logits at every position: `<analysis>_memory_ratio_all_logits`, a second,
looser baseline; the ratios and maxima use the first), each measured as the
peak RSS above the RSS just before it (`/proc/self/clear_refs` 5 resets the peak, `VmHWM` reads
it; on CUDA `torch.cuda.max_memory_allocated` above the allocation before) with its wall and CPU
time. Ratios are analysis over plain forward in the same process; `memory_exponent_<analysis>`
is the slope of log(peak memory) against log(length). Prints one JSON line (and the load
average at the start and the end).

Sections (`--analyses`; another section is one function in `ANALYSES` and its kind):

* gradient-based: `eap` (edge attribution patching, `edge_scores(method="eap")`, one pair whose
  prompts differ in two tokens), `eap-ig` (EAP-IG over the inputs, `--ig-steps` points),
  `eap-lean` / `eap-ig-lean` (the same with `max_memory`: the differences recomputed, not held;
  `eap` / `eap-ig` take that lean path by default on long prompts), `eap-default` (`eap` on the
  default path, forced: every difference held),
  `atp` (AtP of head outputs, Ships' KL with 4 tokens, `attribute(ablation="sc")`), `atp-ld`
  (the same AtP to one scalar, the logit difference of the pair's two answer tokens: one gradient
  flow, the metric of AtP as Kramar et al. and attribution patching use it), `atp_star`
  (AtP*: UA with the exact pattern change and GradDrop, `attribute(ablation="ua",
  saturation_fix=True, graddrop=True)`; GradDrop adds L / 2 walks down the layers, so its
  default lengths are the short ones: `--atp-star-max`), `atp_star-ld` (AtP* to the logit
  difference of `atp-ld`: 1 + 3 flows per walk, 8 walks on SmolLM2, against KL's 30 of 4),
  `atp-pairs` (attribution patching on the pair: `patch(kind="head_out", method="attribution")`,
  every head over all positions, the logit difference, denoising).

* forward-only readers: `sinks` (`sink_stats`), `detectors` (`pattern_scores`, every detector),
  `qrhead` (`qr_tokens`: query and null-query prefills, the haystack cut into passages),
  `span_attention` (the needle marked as the span), `knockout` (the needle's columns blocked from
  every row in every layer; the fused kernel from 2k tokens on, compiled by an untimed run at
  the same length first), all on a needle-in-a-haystack task of that length
  (`probes.datasets.needle`);
* forward-only, measured as they are: `dla` (`direct_logit_attribution`), `lens` (`logit_lens`)
  and `patch` (`patch(kind="resid_pre")` of one layer at one position), on one pair;
  `patch-<kind>` (every site kind at the middle layer, the by-position kinds at the last position);
* exact edge patching: `circuit` (`evaluate`: one circuit's exact faithfulness on the pair, every
  non-circuit edge corrupted; its maximum is `max_memory_ratio_circuit`, apart from the
  forward-only goal, since it keeps the corrupted run's activations at every layer).

Every run has a memory cap (`--cap-gb` above the loaded model, `RLIMIT_AS`): an analysis that
would exceed it fails with an allocation error in its own process and is reported as failed at
that length (its longer lengths are skipped), so nothing takes the machine down.

`--peers` runs TransformerLens (`run_with_cache` on a `TransformerBridge` of the same model) and
nnsight (a trace saving every layer's attention pattern, eager attention) on the same token ids
and lengths under the same cap: their peak memory, or the first length at which they fail
(`peer_fail_length_transformer_lens`, `peer_fail_length_nnsight`; null: none failed).

`--plan-check` compares `heads.plan_memory` with the measured peak (weights + activations, RSS) of
random-weight models built from published configs with about 0.1B (SmolLM2-135M), 0.5B
(Qwen2.5-0.5B) and 1B (Llama-3.2-1B) parameters, fp32 and bf16: `plan_error_max` is the largest
|plan - measured| / measured (`plan_error_max_activations` the same for the activations alone).

`--gemma 16384 32768` runs `atp` and `dla` on Gemma-3-270m (its context is 32k) beside a plain
forward (slow: minutes per length); `--gemma-analyses dla` runs DLA alone beside the forward,
`--gemma-analyses atp-ld` AtP to one logit difference (one gradient flow, against `atp`'s four).
E.g. `--lengths 1024 2048 4096 8192 --peers --plan-check`.

Each child's measurement goes to stderr as `<analysis> <length>: {...}` (`gemma <run> <length>:
{...}` for Gemma) with the load average at its end; `--from-log LOG...` prints the JSON line from
such logs (a run stopped early, or several merged: a later entry replaces an earlier one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules below

from long_context_common import ANSWERS, cap, child, guarded, pair, prompt  # noqa: E402
from long_context_others import gemma, gemma_one, peer, peers, plan_check, plan_one  # noqa: E402
from long_context_summary import failure, from_logs, header, merge_with_line, summarise  # noqa: E402


def _edges(method: str, lean: bool = False, path: str = "auto") -> Callable:
    """`edge_scores` as a user calls it (the path `eap_path.choose_path` takes: lean on long
    prompts); `lean`: with `max_memory` the lean path's own one-pair plan, below the default
    path's, so that `edge_scores` takes the lean path (`eap_chunk_lean`); `path`: forced
    (`eap_path.forced`, e.g. `"default"`: every difference held)."""

    def build(hm, length: int, args) -> Callable[[], object]:
        from heads.engine.options import SweepOptions
        from heads.planning import plan_memory
        from heads.scorers.circuits import edge_scores
        from heads.scorers.circuits.eap_path import forced

        pairs, steps = pair(hm, length), {"steps": args.ig_steps} if method == "eap-ig" else {}
        budget = plan_memory(hm, "eap_lean", pairs.width).peak if lean else None
        opts = SweepOptions(progress=False, max_memory=budget)

        def run() -> object:
            with forced(path):
                return edge_scores(hm, pairs, method=method, options=opts, **steps)

        return run

    return build


def _atp(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.safety.attribution import attribute

    text = prompt(hm, length)
    return lambda: attribute(hm, [text], ablation="sc", template=None)


def _atp_ld(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.safety.attribution import attribute, logit_diff

    text = prompt(hm, length)
    metric = logit_diff([ANSWERS[0]], [ANSWERS[1]])
    return lambda: attribute(hm, [text], ablation="sc", metric=metric, template=None)


def _atp_star(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.safety.attribution import attribute

    text = prompt(hm, length)
    return lambda: attribute(hm, [text], ablation="ua", saturation_fix=True, graddrop=True, template=None)


def _atp_star_ld(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.safety.attribution import attribute, logit_diff

    text = prompt(hm, length)
    metric = logit_diff([ANSWERS[0]], [ANSWERS[1]])
    return lambda: attribute(
        hm, [text], ablation="ua", saturation_fix=True, graddrop=True, metric=metric, template=None
    )


def _atp_pairs(hm, length: int, args) -> Callable[[], object]:
    from heads.engine.options import SweepOptions
    from heads.scorers.patching.activation import patch

    pairs, opts = pair(hm, length), SweepOptions(progress=False)
    return lambda: patch(hm, pairs, "head_out", method="attribution", options=opts)


def _task(hm, length: int):
    from probes.datasets.needle import needle_task

    return needle_task(hm.tokenizer, length, depth=0.5, seed=0)


def _sinks(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.sinks import sink_stats

    text = _task(hm, length).text(hm.tokenizer)
    return lambda: sink_stats(hm, [text], chat=False, markup=False)


def _detectors(hm, length: int, args) -> Callable[[], object]:
    import torch

    from heads.scorers.roles.detectors import pattern_scores

    ids = torch.tensor([_task(hm, length).input_ids])
    return lambda: pattern_scores(hm, ids)


def _qrhead(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.retrieval.qrhead import qr_prompt, qr_tokens
    from probes.datasets.needle import needle_task

    # the QRHead prompt adds its instructions and passage numbers to the haystack: a shorter
    # haystack, so that the prompt is at most `length` tokens (at 8192, the model's context)
    size = length
    while True:
        task = needle_task(hm.tokenizer, size, depth=0.5, seed=0)
        text = qr_prompt(task.question, task.passages).replace("**", "")
        n = len(hm.tokenizer(text)["input_ids"])
        if n <= length:
            break
        size -= n - length + 8
    return lambda: qr_tokens(hm, task.question, task.passages, chat=False)


def _span_attention(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.attention_mass import span_attention

    task = _task(hm, length)
    text = task.text(hm.tokenizer)
    needle = f"The secret code of the {task.key} is {task.code}."
    marked = text.replace(needle, f"**{needle}**", 1)
    return lambda: span_attention(hm, marked, chat=False)


def _knockout(hm, length: int, args) -> Callable[[], object]:
    import torch

    from heads import editing
    from heads.inputs.prompts import EncodedPrompts
    from steer import Knockout

    task = _task(hm, length)
    ids = torch.tensor([task.input_ids])
    enc = EncodedPrompts(ids, torch.ones_like(ids), [[]], [""], [[]])
    keys = list(range(*task.needle))

    def run() -> None:
        with torch.no_grad(), editing(hm, Knockout(keys=keys).edits(hm, enc)):
            hm.model(input_ids=ids.to(hm.device), use_cache=False, logits_to_keep=1)

    return run


def _dla(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.patching.activation import patch
    from heads.scorers.patching.logit import direct_logit_attribution, logit_lens

    pairs = pair(hm, length)
    return {
        "dla": lambda: direct_logit_attribution(hm, pairs),
        "lens": lambda: logit_lens(hm, pairs),
        "patch": lambda: patch(hm, pairs, "resid_pre", layers=[hm.n_layers // 2], positions=[length // 3]),
    }[args.section]


def _patch_site(kind: str) -> Callable:
    """`patch(kind)` at the middle layer (the by-position kinds at the last position: the spec the
    fast path's full caches took by default before the lean path became the long-prompt default)."""

    def build(hm, length: int, args) -> Callable[[], object]:
        from heads.scorers.patching.activation import patch

        pairs = pair(hm, length)
        by_pos = kind in ("resid_pre", "attn_out", "mlp_out", "head_out_by_pos")
        where = {"layers": [hm.n_layers // 2], "positions": [-1] if by_pos else None}
        return lambda: patch(hm, pairs, kind, **where)

    return build


def _circuit(hm, length: int, args) -> Callable[[], object]:
    """`evaluate`: the exact faithfulness of one circuit (2,000 random edges, pruned: about 1.4k
    edges over most upstream nodes, the worst case for what a row keeps) on the pair."""
    import torch

    from heads import SweepOptions
    from heads.scorers.circuits import evaluate, graph_of, prune

    pairs = pair(hm, length)
    g = graph_of(hm)
    edges = torch.nonzero(g.valid)
    pick = edges[torch.randperm(len(edges), generator=torch.Generator().manual_seed(0))[:2000]]
    mask = torch.zeros_like(g.valid)
    mask[pick[:, 0], pick[:, 1]] = True
    circuit = prune(g, mask)
    return lambda: evaluate(hm, pairs, circuit[None], options=SweepOptions(progress=False))


PATCH_SITES = ("resid_pre", "attn_out", "mlp_out", "head_out", "head_out_by_pos", "q", "k", "v", "pattern")

ANALYSES: dict[str, tuple[str, Callable]] = {
    "eap": ("gradient", _edges("eap")),
    "eap-ig": ("gradient", _edges("eap-ig")),
    "eap-lean": ("gradient", _edges("eap", lean=True)),
    "eap-ig-lean": ("gradient", _edges("eap-ig", lean=True)),
    "eap-default": ("reference", _edges("eap", path="default")),  # not in the maxima
    "atp": ("gradient", _atp),
    "atp-ld": ("gradient", _atp_ld),
    "atp_star": ("gradient", _atp_star),
    "atp_star-ld": ("gradient", _atp_star_ld),
    "atp-pairs": ("gradient", _atp_pairs),
    "sinks": ("forward", _sinks),
    "detectors": ("forward", _detectors),
    "qrhead": ("forward", _qrhead),
    "span_attention": ("forward", _span_attention),
    "knockout": ("forward", _knockout),
    "dla": ("forward", _dla),
    "lens": ("forward", _dla),
    "patch": ("forward", _dla),
    **{f"patch-{kind}": ("forward", _patch_site(kind)) for kind in PATCH_SITES},
    "circuit": ("circuit", _circuit),
}
"""name -> (kind: "gradient" or "forward"; "circuit", exact edge patching, which keeps the corrupted
run's activations at every layer: its own maximum; or "reference": a forced path a user does not
get by default, out of the maxima; builder `(model, length, args) -> run`)."""
KINDS = {name: kind for name, (kind, _) in ANALYSES.items()}


def _one(name: str, length: int, args) -> dict:
    import torch

    from heads import load_model

    torch.manual_seed(0)
    hm = load_model(device=args.device)
    args.section = name
    run = ANALYSES[name][1](hm, length, args)
    ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(2)).to(hm.device)

    def plain(n: int = length) -> None:
        with torch.no_grad():
            hm.model(input_ids=ids[:, :n], use_cache=False, logits_to_keep=1)

    plain(128)  # warm-up (lazy buffers, kernels) at a short length
    if name == "knockout" and length >= 2048:
        run()  # the fused kernel compiles for this length's bucket: not timed
    cap(args.cap_gb)
    forward = guarded(plain, args.device)
    analysis = guarded(run, args.device)

    def all_logits() -> None:  # `model(ids)` as a user calls it: the logits at every position
        with torch.no_grad():
            hm.model(input_ids=ids, use_cache=False)

    got = {"forward": forward, "analysis": analysis, "forward_all_logits": guarded(all_logits, args.device)}
    got["load_average_1m"] = [round(os.getloadavg()[0], 2)]
    if name in ("eap-ig", "eap-ig-lean"):
        got["ig_steps"] = args.ig_steps
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--analyses", nargs="*", default=list(ANALYSES), choices=list(ANALYSES))
    ap.add_argument("--ig-steps", type=int, default=5, help="EAP-IG interpolation points (default 5)")
    ap.add_argument("--atp-star-max", type=int, default=2048, help="longest length for atp_star")
    ap.add_argument("--gradient-max", type=int, default=None, help="longest length for eap/eap-ig/atp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cap-gb", type=float, default=6.0, help="memory cap per run above the loaded model")
    ap.add_argument("--peers", action="store_true", help="TransformerLens and nnsight on the same lengths")
    ap.add_argument("--plan-check", action="store_true", help="plan_memory against measured peaks")
    ap.add_argument("--gemma", type=int, nargs="*", default=[], help="Gemma-3-270m lengths for atp and dla")
    ap.add_argument(
        "--gemma-analyses",
        nargs="+",
        default=["atp", "dla"],
        choices=["atp", "atp-ld", "dla"],
        help="--gemma's runs",
    )
    ap.add_argument(
        "--from-log", nargs="+", metavar="LOG", help="print the line from earlier runs' stderr logs (merged)"
    )
    ap.add_argument(
        "--base-line",
        metavar="JSON",
        help="with --from-log: merge the logs into this printed line (its own logs not kept)",
    )
    ap.add_argument("--one", nargs=2, metavar=("ANALYSIS", "LENGTH"), help=argparse.SUPPRESS)
    ap.add_argument("--peer", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--plan-one", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--gemma-one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one[0], int(args.one[1]), args)))
        return
    if args.peer:
        print(json.dumps(peer(args.peer[0], int(args.peer[1]), args)))
        return
    if args.plan_one:
        m, dt, req, n = args.plan_one
        print(json.dumps(plan_one(m, dt, req, int(n), args)))
        return
    if args.gemma_one:
        print(json.dumps(gemma_one(args.gemma_one[0], int(args.gemma_one[1]), args)))
        return
    if args.from_log and args.base_line:
        with open(args.base_line) as f:
            print(json.dumps(merge_with_line(json.loads(f.read()), args.from_log, KINDS)))
        return
    if args.from_log:
        print(json.dumps(from_logs(args.from_log, KINDS)))
        return
    load_start = round(os.getloadavg()[0], 2)
    line = header(args.device, args.lengths, args.ig_steps, args.cap_gb)
    if args.plan_check:
        plan_check(args, line)
    results: dict[str, dict[int, dict]] = {}
    for name in args.analyses:
        kind = ANALYSES[name][0]
        most = args.gradient_max if kind in ("gradient", "reference") else None
        if name.startswith("atp_star"):
            most = args.atp_star_max
        wanted = [n for n in args.lengths if most is None or n <= most]
        results[name] = {}
        for length in wanted:
            res = child(["--one", name, str(length)], args)
            print(f"{name} {length}: {res}", file=sys.stderr, flush=True)
            results[name][length] = res
            if failure(res):  # out of memory under the cap (or an error): longer lengths are skipped
                break
    summarise(line, results, KINDS)
    if args.peers:
        peers(args, line)
    if args.gemma:
        gemma(args, line)
    line["load_average_1m"] = [load_start, round(os.getloadavg()[0], 2)]
    print(json.dumps(line))


if __name__ == "__main__":
    main()
