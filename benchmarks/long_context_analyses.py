"""Long-context analyses: time and peak memory of each analysis against a plain forward, per length.

Embedded SmolLM2-135M (30 layers, 9 query heads over 3 KV heads), one prompt of 1k, 2k, 4k
tokens (random token ids, seeded). Each (analysis, length) runs in a fresh subprocess with glibc
returning every block of 64 KiB or more to the OS when freed (`MALLOC_MMAP_THRESHOLD_=65536`, so
RSS follows live memory): load the model, one untimed plain forward at that length (warm-up),
then the plain forward (`logits_to_keep=1`, no gradients) and the analysis, each measured as the
peak RSS above the RSS just before it (`/proc/self/clear_refs` 5 resets the peak, `VmHWM` reads
it; on CUDA `torch.cuda.max_memory_allocated` above the allocation before) with its wall and CPU
time. Ratios are analysis over plain forward in the same process; `memory_exponent_<analysis>`
is the slope of log(peak memory) against log(length). Prints one JSON line (and the load
average at the start and the end).

Sections (`--analyses`; another section is one function in `ANALYSES` and its kind):

* gradient-based: `eap` (edge attribution patching, `edge_scores(method="eap")`, one pair whose
  prompts differ in two tokens), `eap-ig` (EAP-IG over the inputs, `--ig-steps` points),
  `atp` (AtP of head outputs, Ships' KL with 4 tokens, `attribute(ablation="sc")`), `atp_star`
  (AtP*: UA with the exact pattern change and GradDrop, `attribute(ablation="ua",
  saturation_fix=True, graddrop=True)`; GradDrop adds L / 2 walks down the layers, so its
  default lengths are the short ones: `--atp-star-max`).

    python benchmarks/long_context_analyses.py [--lengths 1024 2048 4096] [--analyses eap atp ...]
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


def _eap(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.circuits import edge_scores

    pairs = _pair(hm, length)
    return lambda: edge_scores(hm, pairs, method="eap", progress=False)


def _eap_ig(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.circuits import edge_scores

    pairs = _pair(hm, length)
    return lambda: edge_scores(hm, pairs, method="eap-ig", steps=args.ig_steps, progress=False)


def _atp(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.safety.attribution import attribute

    prompt = _prompt(hm, length)
    return lambda: attribute(hm, [prompt], ablation="sc", template=None)


def _atp_star(hm, length: int, args) -> Callable[[], object]:
    from heads.scorers.safety.attribution import attribute

    prompt = _prompt(hm, length)
    return lambda: attribute(hm, [prompt], ablation="ua", saturation_fix=True, graddrop=True, template=None)


ANALYSES: dict[str, tuple[str, Callable]] = {
    "eap": ("gradient", _eap),
    "eap-ig": ("gradient", _eap_ig),
    "atp": ("gradient", _atp),
    "atp_star": ("gradient", _atp_star),
}
"""name -> (kind: "gradient" or "forward", builder `(model, length, args) -> run`)."""


def _one(name: str, length: int, args) -> dict:
    import torch

    from heads import load_model

    torch.manual_seed(0)
    hm = load_model(device=args.device)
    run = ANALYSES[name][1](hm, length, args)
    ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(2)).to(hm.device)

    def plain() -> None:
        with torch.no_grad():
            hm.model(input_ids=ids, use_cache=False, logits_to_keep=1)

    plain()  # warm-up at this length
    forward = _measure(plain, args.device)
    analysis = _measure(run, args.device)
    return {"forward": forward, "analysis": analysis}


def _fit(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--analyses", nargs="+", default=list(ANALYSES), choices=list(ANALYSES))
    ap.add_argument("--ig-steps", type=int, default=5, help="EAP-IG interpolation points (default 5)")
    ap.add_argument("--atp-star-max", type=int, default=2048, help="longest length for atp_star")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", nargs=2, metavar=("ANALYSIS", "LENGTH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one[0], int(args.one[1]), args)))
        return
    load_start = round(os.getloadavg()[0], 2)
    line: dict = {"model": "SmolLM2-135M-Instruct (embedded)", "device": args.device, "lengths": args.lengths}
    line["memory_measure"] = (
        "cuda max_memory_allocated" if args.device.startswith("cuda") else "peak RSS (VmHWM)"
    )
    line["ig_steps"] = args.ig_steps
    ratios: dict[str, list[float]] = {"gradient": [], "forward": []}
    exponents: list[float] = []
    for name in args.analyses:
        kind = ANALYSES[name][0]
        lengths = [n for n in args.lengths if name != "atp_star" or n <= args.atp_star_max]
        got: dict[int, dict] = {}
        for length in lengths:
            cmd = [sys.executable, __file__, "--one", name, str(length), "--device", args.device]
            cmd += ["--ig-steps", str(args.ig_steps)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # big blocks go back to the OS when freed: RSS = live
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            got[length] = json.loads(out.strip().splitlines()[-1])
            print(f"{name} {length}: {got[length]}", file=sys.stderr, flush=True)
        fwd = {n: got[n]["forward"] for n in lengths}
        ana = {n: got[n]["analysis"] for n in lengths}
        mem = [ana[n]["memory_mb"] / max(fwd[n]["memory_mb"], 1e-6) for n in lengths]
        line[f"{name}_lengths"] = lengths
        line[f"{name}_memory_mb"] = [round(ana[n]["memory_mb"], 1) for n in lengths]
        line[f"{name}_forward_memory_mb"] = [round(fwd[n]["memory_mb"], 1) for n in lengths]
        line[f"{name}_memory_ratio"] = [round(r, 3) for r in mem]
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
    line["load_average_1m"] = [load_start, round(os.getloadavg()[0], 2)]
    print(json.dumps(line))


if __name__ == "__main__":
    main()
