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
  `eap-lean` / `eap-ig-lean` (the same with `max_memory`: the differences recomputed, not held),
  `atp` (AtP of head outputs, Ships' KL with 4 tokens, `attribute(ablation="sc")`), `atp_star`
  (AtP*: UA with the exact pattern change and GradDrop, `attribute(ablation="ua",
  saturation_fix=True, graddrop=True)`; GradDrop adds L / 2 walks down the layers, so its
  default lengths are the short ones: `--atp-star-max`).

* forward-only readers: `sinks` (`sink_stats`), `detectors` (`pattern_scores`, every detector),
  `qrhead` (`qr_tokens`: query and null-query prefills, the haystack cut into passages),
  `span_attention` (the needle marked as the span), `knockout` (the needle's columns blocked from
  every row in every layer; the fused kernel from 2k tokens on, compiled by an untimed run at
  the same length first), all on a needle-in-a-haystack task of that length
  (`probes.datasets.needle`);
* forward-only, measured as they are: `dla` (`direct_logit_attribution`), `lens` (`logit_lens`)
  and `patch` (`patch(kind="resid_pre")` of one layer at one position), on one pair.

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
forward (slow: minutes per length); `--gemma-analyses dla` runs DLA alone beside the forward.
E.g. `--lengths 1024 2048 4096 8192 --peers --plan-check`.

Each child's measurement goes to stderr as `<analysis> <length>: {...}` (`gemma <run> <length>:
{...}` for Gemma) with the load average at its end; `--from-log LOG...` prints the JSON line from
such logs (a run stopped early, or several merged: a later entry replaces an earlier one).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's heads / steer


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _measure(fn: Callable[[], object], device: str) -> dict:
    """Peak memory above the start (RSS, or CUDA allocation), wall and CPU seconds of `fn()`."""
    import torch

    gc.collect()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) restarts from the current RSS
        base = _status("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")
    return {"memory_mb": (peak - base) / 2**20, "seconds": wall, "cpu_seconds": cpu}


# ------------------------------------------------------------------------------ the analyses
def _pair(hm, length: int):
    import torch

    from heads.scorers.patching import pairs_from_tokens

    g = torch.Generator().manual_seed(0)
    clean = torch.randint(100, 40000, (1, length), generator=g)
    corr = clean.clone()
    corr[0, length // 3] = 7777
    corr[0, length - 5] = 8888
    return pairs_from_tokens(clean.tolist(), corr.tolist(), [355], [1789])


def _prompt(hm, length: int) -> str:
    """A text of about `length` tokens (random words decoded from seeded ids)."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(100, 40000, (length,), generator=g).tolist()
    return hm.tokenizer.decode(ids)


def _edges(method: str, budget: str | None = None) -> Callable:
    """`edge_scores`; with a `budget` (`max_memory`), the lean path (`eap_chunk_lean`)."""

    def build(hm, length: int, args) -> Callable[[], object]:
        from heads.engine.options import SweepOptions
        from heads.scorers.circuits import edge_scores

        pairs, steps = _pair(hm, length), {"steps": args.ig_steps} if method == "eap-ig" else {}
        opts = SweepOptions(progress=False, max_memory=budget)
        return lambda: edge_scores(hm, pairs, method=method, options=opts, **steps)

    return build


def _atp(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.safety.attribution import attribute

    prompt = _prompt(hm, length)
    return lambda: attribute(hm, [prompt], ablation="sc", template=None)


def _atp_star(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.safety.attribution import attribute

    prompt = _prompt(hm, length)
    return lambda: attribute(hm, [prompt], ablation="ua", saturation_fix=True, graddrop=True, template=None)


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

    pairs = _pair(hm, length)
    return {
        "dla": lambda: direct_logit_attribution(hm, pairs),
        "lens": lambda: logit_lens(hm, pairs),
        "patch": lambda: patch(hm, pairs, "resid_pre", layers=[hm.n_layers // 2], positions=[length // 3]),
    }[args.section]


ANALYSES: dict[str, tuple[str, Callable]] = {
    "eap": ("gradient", _edges("eap")),
    "eap-ig": ("gradient", _edges("eap-ig")),
    "eap-lean": ("gradient", _edges("eap", "200GB")),
    "eap-ig-lean": ("gradient", _edges("eap-ig", "200GB")),
    "atp": ("gradient", _atp),
    "atp_star": ("gradient", _atp_star),
    "sinks": ("forward", _sinks),
    "detectors": ("forward", _detectors),
    "qrhead": ("forward", _qrhead),
    "span_attention": ("forward", _span_attention),
    "knockout": ("forward", _knockout),
    "dla": ("forward", _dla),
    "lens": ("forward", _dla),
    "patch": ("forward", _dla),
}
"""name -> (kind: "gradient" or "forward", builder `(model, length, args) -> run`)."""


def _cap(gb: float) -> None:
    """Cap this process's address space at its current size + `gb` GB (allocations beyond fail)."""
    import resource

    if gb <= 0:
        return
    limit = _status("VmSize") + int(gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _guarded(fn: Callable[[], object], device: str) -> dict:
    """`_measure(fn)`, or `{"failed": reason}` when it runs out of memory under the cap."""
    try:
        return _measure(fn, device)
    except (MemoryError, RuntimeError) as exc:  # the cap: "can't allocate memory" / "DefaultCPUAllocator"
        return {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


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
    _cap(args.cap_gb)
    forward = _guarded(plain, args.device)
    analysis = _guarded(run, args.device)

    def all_logits() -> None:  # `model(ids)` as a user calls it: the logits at every position
        with torch.no_grad():
            hm.model(input_ids=ids, use_cache=False)

    got = {"forward": forward, "analysis": analysis, "forward_all_logits": _guarded(all_logits, args.device)}
    got["load_average_1m"] = [round(os.getloadavg()[0], 2)]
    if name in ("eap-ig", "eap-ig-lean"):
        got["ig_steps"] = args.ig_steps
    return got


# ------------------------------------------------------------------------------ the peers
def _peer(name: str, length: int, args) -> dict:
    """TransformerLens `run_with_cache` or an nnsight pattern-saving trace on `length` token ids."""
    import torch

    from heads import load_model
    from heads.model.loading import wrap_backend

    hm = load_model(device=args.device, attn_implementation="eager" if name == "nnsight" else None)
    ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(2))
    if name == "transformer_lens":
        bridge = wrap_backend(
            hm.model, hm.tokenizer, "HuggingFaceTB/SmolLM2-135M-Instruct", "transformer_lens"
        )

        def run() -> None:
            with torch.no_grad():
                _, cache = bridge.run_with_cache(ids)
                del cache

        warm = ids[:, :128]
        with torch.no_grad():
            bridge.run_with_cache(warm)
    else:
        nn_model = wrap_backend(hm.model, hm.tokenizer, hm.name, "nnsight")
        layers = hm.model.model.layers

        def run() -> None:
            kept: list = []  # the saved patterns, alive until the trace returns them
            with torch.no_grad(), nn_model.trace(ids, output_attentions=True):
                kept.extend(layer.self_attn.output[1].save() for layer in nn_model.model.layers)
            assert len(kept) == hm.n_layers

        assert len(layers) == hm.n_layers
    _cap(args.cap_gb)
    return _guarded(run, args.device)


def _peers(args, line: dict) -> None:
    for name in ("transformer_lens", "nnsight"):
        runs: list[tuple[int, dict]] = []
        for length in args.lengths:
            got = _child(["--peer", name, str(length)], args)
            print(f"peer {name} {length}: {got}", file=sys.stderr, flush=True)
            runs.append((length, got))
            if "failed" in got:
                break
        _peer_entries(line, name, runs)


def _peer_entries(line: dict, name: str, runs: list[tuple[int, dict]]) -> None:
    """A peer's keys from its runs `(length, measurement)` in length order: the peak memory per
    length until the first failure, whose length is `peer_fail_length_<name>` (None: none failed)."""
    line[f"peer_{name}_lengths"] = []
    line[f"peer_{name}_memory_mb"] = []
    line[f"peer_fail_length_{name}"] = None
    for length, got in runs:
        if "failed" in got:
            line[f"peer_fail_length_{name}"] = length
            line[f"peer_{name}_failure"] = got["failed"]
            break
        line[f"peer_{name}_lengths"].append(length)
        line[f"peer_{name}_memory_mb"].append(round(got["memory_mb"], 1))


# ------------------------------------------------------------------------------ the plan check
PLAN_MODELS = {  # published configs (fewer layers nowhere: the whole model), random weights
    "0.1B": (
        "llama",
        dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
             tie_word_embeddings=True, rope_theta=100000.0),
    ),
    "0.5B": (
        "qwen2",
        dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
             tie_word_embeddings=True, rope_theta=1000000.0),
    ),
    "1B": (
        "llama",
        dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
             tie_word_embeddings=True, rope_theta=500000.0),
    ),
}  # fmt: skip
PLAN_CASES = [  # (model, dtype, request, tokens)
    ("0.1B", "float32", "forward", 2048),
    ("0.1B", "bfloat16", "forward", 2048),
    ("0.1B", "float32", "sinks", 2048),
    ("0.1B", "float32", "gradient", 1024),
    ("0.5B", "float32", "forward", 2048),
    ("0.5B", "bfloat16", "forward", 2048),
    ("1B", "bfloat16", "forward", 2048),
    ("1B", "bfloat16", "sinks", 1024),
]


def _plan_one(model: str, dtype: str, request: str, tokens: int, args) -> dict:
    """Measured (weights + activation peak, RSS) against `plan_memory` for one case."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from heads import HeadModel, load_tokenizer, plan_memory
    from heads.scorers.sinks import sink_stats

    kind, values = PLAN_MODELS[model]
    cfg = AutoConfig.for_model(kind, **values)
    dt = getattr(torch, dtype)
    tok = load_tokenizer() if request == "sinks" else None
    text = _task_text(tok, tokens) if tok is not None else None
    plan = plan_memory(cfg, request, tokens, 1, dt)
    gc.collect()
    before = _status("VmRSS")
    torch.manual_seed(0)
    model_ = AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation="sdpa").eval()
    gc.collect()
    weights = _status("VmRSS") - before
    ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model_(input_ids=ids[:, :64], use_cache=False, logits_to_keep=1)  # warm-up
    if request == "forward":

        def run() -> None:
            with torch.no_grad():
                model_(input_ids=ids, use_cache=False, logits_to_keep=1)

    elif request == "gradient":
        model_.requires_grad_(False)

        def run() -> None:
            x = model_.get_input_embeddings()(ids).detach().requires_grad_(True)
            out = model_(inputs_embeds=x, use_cache=False, logits_to_keep=1)
            out.logits.float().logsumexp(-1).sum().backward()

    else:
        hm = HeadModel(model_, tok, name=model)

        def run() -> None:
            sink_stats(hm, [text], chat=False, markup=False)

    _cap(args.cap_gb)
    got = _guarded(run, args.device)
    if "failed" in got:
        return got
    act = got["memory_mb"] * 2**20
    planned = plan.devices[0]
    return {
        "measured_mb": round((weights + act) / 2**20, 1),
        "planned_mb": round(planned.total / 2**20, 1),
        "measured_activation_mb": round(act / 2**20, 1),
        "planned_activation_mb": round(planned.activations / 2**20, 1),
        "error": round(abs(planned.total - (weights + act)) / (weights + act), 4),
        "activation_error": round(abs(planned.activations - act) / max(act, 1), 4),
    }


def _task_text(tok, tokens: int) -> str:
    from probes.datasets.needle import needle_task

    return needle_task(tok, tokens, seed=0).text(tok)


def _plan_check(args, line: dict) -> None:
    cases = {}
    for model, dtype, request, tokens in PLAN_CASES:
        got = _child(["--plan-one", model, dtype, request, str(tokens)], args)
        key = f"{model}_{dtype}_{request}_{tokens}"
        print(f"plan {key}: {got}", file=sys.stderr, flush=True)
        cases[key] = got
    _plan_entries(line, cases)


def _plan_entries(line: dict, cases: dict[str, dict]) -> None:
    """`plan_cases` and the largest relative errors of the plan over the cases that ran."""
    line["plan_cases"] = cases
    ok = [c for c in cases.values() if "error" in c]
    if ok:
        line["plan_error_max"] = max(c["error"] for c in ok)
        line["plan_error_max_activations"] = max(c["activation_error"] for c in ok)


# ------------------------------------------------------------------------------ Gemma-3-270m, long
def _gemma_one(name: str, length: int, args) -> dict:
    import torch

    from heads import load_model

    hm = load_model("gemma-3-270m", device=args.device)
    ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(2))
    if name == "forward":

        def run() -> None:
            with torch.no_grad():
                hm.model(input_ids=ids, use_cache=False, logits_to_keep=1)

    elif name == "dla":
        from heads.scorers.patching.logit import direct_logit_attribution

        pairs = _pair(hm, length)

        def run() -> None:
            direct_logit_attribution(hm, pairs)

    else:
        from heads.scorers.safety.attribution import attribute

        prompt = hm.tokenizer.decode(ids[0].tolist())

        def run() -> None:
            attribute(hm, [prompt], ablation="sc", template=None)

    with torch.no_grad():
        hm.model(input_ids=ids[:, :128], use_cache=False, logits_to_keep=1)
    _cap(args.cap_gb)
    got = _guarded(run, args.device)
    got["load_average_1m"] = [round(os.getloadavg()[0], 2)]
    return got


def _gemma(args, line: dict) -> None:
    line["gemma_lengths"] = args.gemma
    for name in ("forward", *args.gemma_analyses):
        for length in args.gemma:
            got = _child(["--gemma-one", name, str(length)], args)
            print(f"gemma {name} {length}: {got}", file=sys.stderr, flush=True)
            _gemma_entry(line, name, length, got)


def _gemma_entry(line: dict, name: str, length: int, got: dict) -> None:
    key = f"gemma_{name}_{length // 1024}k"
    if "failed" in got:
        line[f"{key}_failed"] = got["failed"]
        return
    line[f"{key}_memory_mb"] = round(got["memory_mb"], 1)
    line[f"{key}_seconds"] = round(got["seconds"], 1)
    if "cpu_seconds" in got:
        line[f"{key}_cpu_seconds"] = round(got["cpu_seconds"], 1)


def _child(extra: list[str], args) -> dict:
    cmd = [sys.executable, __file__, *extra, "--device", args.device, "--cap-gb", str(args.cap_gb)]
    cmd += ["--ig-steps", str(args.ig_steps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # big blocks go back to the OS when freed: RSS = live
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"failed": f"exit {done.returncode}: {tail}"}
    return dict(json.loads(lines[-1]))


def _fit(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def _header(device: str, lengths: list[int], ig_steps: int, cap_gb: float) -> dict:
    line: dict = {"model": "SmolLM2-135M-Instruct (embedded)", "device": device, "lengths": lengths}
    line["memory_measure"] = "cuda max_memory_allocated" if device.startswith("cuda") else "peak RSS (VmHWM)"
    line["ig_steps"] = ig_steps
    line["cap_gb"] = cap_gb
    return line


def _failure(res: dict) -> str | None:
    failed = (
        res.get("failed") or res.get("analysis", {}).get("failed") or res.get("forward", {}).get("failed")
    )
    return str(failed) if failed else None


def _summarise(line: dict, results: dict[str, dict[int, dict]]) -> None:
    """Per analysis (`results[name][length]`: a child's measurement): the ratios over the plain
    forward, the seconds, the memory exponent; then the maxima over the analyses."""
    ratios: dict[str, list[float]] = {"gradient": [], "forward": []}
    exponents: list[float] = []
    for name, runs in results.items():
        kind = ANALYSES[name][0]
        got: dict[int, dict] = {}
        for length in sorted(runs):
            failed = _failure(runs[length])
            if failed:  # the first failure ends the analysis (longer lengths were skipped)
                line[f"{name}_failed_at"] = length
                line[f"{name}_failure"] = failed
                break
            got[length] = runs[length]
        lengths = sorted(got)
        if not lengths:
            continue
        fwd = {n: got[n]["forward"] for n in lengths}
        ana = {n: got[n]["analysis"] for n in lengths}
        mem = [ana[n]["memory_mb"] / max(fwd[n]["memory_mb"], 1e-6) for n in lengths]
        line[f"{name}_lengths"] = lengths
        line[f"{name}_memory_mb"] = [round(ana[n]["memory_mb"], 1) for n in lengths]
        line[f"{name}_forward_memory_mb"] = [round(fwd[n]["memory_mb"], 1) for n in lengths]
        line[f"{name}_memory_ratio"] = [round(r, 3) for r in mem]
        full = [got[n].get("forward_all_logits", {}).get("memory_mb") for n in lengths]
        if all(isinstance(m, float) for m in full):  # against `model(ids)` (every position's logits)
            line[f"{name}_memory_ratio_all_logits"] = [
                round(ana[n]["memory_mb"] / max(m, 1e-6), 3) for n, m in zip(lengths, full, strict=True)
            ]
        line[f"{name}_time_ratio"] = [round(ana[n]["seconds"] / fwd[n]["seconds"], 2) for n in lengths]
        line[f"{name}_cpu_time_ratio"] = [
            round(ana[n]["cpu_seconds"] / fwd[n]["cpu_seconds"], 2) for n in lengths
        ]
        line[f"{name}_seconds"] = [round(ana[n]["seconds"], 1) for n in lengths]
        ratios[kind] += mem
        if len(lengths) > 1:
            e = _fit([float(n) for n in lengths], [ana[n]["memory_mb"] for n in lengths])
            line[f"memory_exponent_{name}"] = round(e, 3)
            exponents.append(e)
    if ratios["gradient"]:
        line["max_memory_ratio_gradient"] = round(max(ratios["gradient"]), 3)
    if ratios["forward"]:
        line["max_memory_ratio_forward_only"] = round(max(ratios["forward"]), 3)
    if exponents:
        line["max_memory_exponent"] = round(max(exponents), 3)


def _from_logs(paths: list[str]) -> dict:
    """The JSON line rebuilt from the stderr logs of earlier runs (`<analysis> <length>: {...}` and
    `gemma <run> <length>: {...}` per child, a later entry replacing an earlier one): the printing
    step of several invocations, merged. The load averages are those the children recorded."""
    import ast
    import re

    results: dict[str, dict[int, dict]] = {}
    gemma: dict[tuple[str, int], dict] = {}
    peers: dict[str, dict[int, dict]] = {}
    plans: dict[str, dict] = {}
    loads: list[float] = []
    steps: set[int] = set()
    pattern = re.compile(r"^(gemma )?([\w-]+) (\d+): (\{.*\})$")
    peer_or_plan = re.compile(r"^(?:peer (\w+) (\d+)|plan ([\w.]+)): (\{.*\})$")
    for path in paths:
        with open(path) as f:
            for raw in f:
                other = peer_or_plan.match(raw.strip())
                if other is not None:
                    got = ast.literal_eval(other.group(4))
                    if other.group(1):
                        peers.setdefault(other.group(1), {})[int(other.group(2))] = got
                    else:
                        plans[other.group(3)] = got
                    continue
                m = pattern.match(raw.strip())
                if m is None or (m.group(1) is None and m.group(2) not in ANALYSES):
                    continue
                res = ast.literal_eval(m.group(4))
                loads += [float(x) for x in res.pop("load_average_1m", [])]
                if "ig_steps" in res:
                    steps.add(int(res.pop("ig_steps")))
                if m.group(1):
                    gemma[(m.group(2), int(m.group(3)))] = res
                else:
                    results.setdefault(m.group(2), {})[int(m.group(3))] = res
    lengths = sorted({n for runs in results.values() for n in runs})
    line = _header("cpu", lengths, -1, -1.0)
    del line["cap_gb"]
    line["ig_steps"] = sorted(steps)[0] if len(steps) == 1 else sorted(steps) or None
    line["merged_from_logs"] = len(paths)
    order = [name for name in ANALYSES if name in results]
    _summarise(line, {name: results[name] for name in order})
    if gemma:
        line["gemma_lengths"] = sorted({n for _, n in gemma})
        for (name, length), got in sorted(gemma.items()):
            _gemma_entry(line, name, length, got)
    for name, runs in sorted(peers.items()):
        _peer_entries(line, name, [(n, runs[n]) for n in sorted(runs)])
    if plans:
        _plan_entries(line, plans)
    if loads:
        line["load_average_1m_range"] = [min(loads), max(loads)]
    return line


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
        "--gemma-analyses", nargs="+", default=["atp", "dla"], choices=["atp", "dla"], help="--gemma's runs"
    )
    ap.add_argument(
        "--from-log", nargs="+", metavar="LOG", help="print the line from earlier runs' stderr logs (merged)"
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
        print(json.dumps(_peer(args.peer[0], int(args.peer[1]), args)))
        return
    if args.plan_one:
        m, dt, req, n = args.plan_one
        print(json.dumps(_plan_one(m, dt, req, int(n), args)))
        return
    if args.gemma_one:
        print(json.dumps(_gemma_one(args.gemma_one[0], int(args.gemma_one[1]), args)))
        return
    if args.from_log:
        print(json.dumps(_from_logs(args.from_log)))
        return
    load_start = round(os.getloadavg()[0], 2)
    line = _header(args.device, args.lengths, args.ig_steps, args.cap_gb)
    if args.plan_check:
        _plan_check(args, line)
    results: dict[str, dict[int, dict]] = {}
    for name in args.analyses:
        kind = ANALYSES[name][0]
        most = args.atp_star_max if name == "atp_star" else args.gradient_max if kind == "gradient" else None
        wanted = [n for n in args.lengths if most is None or n <= most]
        results[name] = {}
        for length in wanted:
            res = _child(["--one", name, str(length)], args)
            print(f"{name} {length}: {res}", file=sys.stderr, flush=True)
            results[name][length] = res
            if _failure(res):  # out of memory under the cap (or an error): longer lengths are skipped
                break
    _summarise(line, results)
    if args.peers:
        _peers(args, line)
    if args.gemma:
        _gemma(args, line)
    line["load_average_1m"] = [load_start, round(os.getloadavg()[0], 2)]
    print(json.dumps(line))


if __name__ == "__main__":
    main()
