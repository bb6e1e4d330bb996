"""Long-context prefill: unsteered (SDPA) vs PASTA on the blocked path vs PASTA on the fused path.

Embedded SmolLM2-135M (30 layers x 9 query heads over 3 KV heads), batch 1, prefill of 1k, 2k,
4k and 8k tokens (the model's limit), only the last position's logits (`logits_to_keep=1`, so
the 8k x 49k logits matrix is never built on any path). PASTA steers `--heads-per-layer`
heads in every layer with alpha 0.01 outside a 100-token span.

Each (path, length) runs in a fresh subprocess: load the model, one untimed warm-up prefill at
that same length (on the fused path it also compiles the kernel for the length's bucket; its
time is reported as `first_call_s`), then `--repeats` (default 3) timed prefills: the median
wall time (`seconds_*`) and the median CPU time of the process (`cpu_seconds_*`, all its
threads: what other jobs on a shared machine disturb least). Memory is the process's
resident set size (RSS, read from /proc/self/statm by a thread every 2 ms) during the timed
prefills, minus the RSS just before them, with glibc returning every block of 64 KiB or more to
the OS when freed (`MALLOC_MMAP_THRESHOLD_`), so RSS follows live memory: activations above the
loaded model, not weights (CPU; on CUDA the peak is `torch.cuda.max_memory_allocated` above the
allocation before the prefills). Ratios are steered over unsteered at the same length in the
same run (`time_ratio_*` from wall time, `cpu_time_ratio_*` from CPU time);
`memory_exponent_*` is the slope of log(memory) against log(length). Prints one JSON line,
with the 1-minute load average at the start and the end.

    python benchmarks/long_context.py [--lengths 1024 2048 4096 8192] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PATHS = ("unsteered", "blocked", "fused")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's heads / steer


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one(path: str, length: int, device: str, heads_per_layer: int, repeats: int) -> dict:
    """Run one configuration in this process; returns its figures."""
    import torch

    from heads import editing, load_model
    from steer.pasta.method import PastaBias

    hm = load_model(device=device)
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (1, length), device=device)
    column = torch.full((1, length), math.log(0.01))
    column[:, length // 2 : length // 2 + 100] = 0.0  # the emphasized span
    heads = list(range(heads_per_layer))

    def run(n: int = length) -> None:
        with torch.no_grad():
            if path == "unsteered":
                hm.model(input_ids=ids[:, :n], use_cache=False, logits_to_keep=1)
                return
            cb = column[:, :n]
            edits = [PastaBias(layer=la, heads=heads, column_bias=cb) for la in range(hm.n_layers)]
            with editing(hm, edits, kernel=path):
                hm.model(input_ids=ids[:, :n], use_cache=False, logits_to_keep=1)

    # warm-up at this very length on every path (the fused path compiles its kernel for the
    # length's bucket here: first_call_s); then the timed runs
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    if not cuda:
        sampler.start()
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    done.set()
    if cuda:
        peak[0] = torch.cuda.max_memory_allocated()
    else:
        sampler.join()
        peak[0] = max(peak[0], _rss())
    return {
        "seconds": statistics.median(walls),
        "cpu_seconds": statistics.median(cpus),
        "first_call_s": first,
        "memory_mb": (peak[0] - base) / 2**20,
    }


def _fit(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--heads-per-layer", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed prefills per configuration (median)")
    ap.add_argument("--one", nargs=2, metavar=("PATH", "LENGTH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        res = _one(args.one[0], int(args.one[1]), args.device, args.heads_per_layer, args.repeats)
        print(json.dumps(res))
        return
    load_start = round(os.getloadavg()[0], 2)
    results: dict[str, dict[int, dict]] = {p: {} for p in PATHS}
    for length in args.lengths:
        for path in PATHS:
            cmd = [sys.executable, __file__, "--one", path, str(length), "--device", args.device]
            cmd += ["--heads-per-layer", str(args.heads_per_layer), "--repeats", str(args.repeats)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # big blocks go back to the OS when freed: RSS = live
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            results[path][length] = json.loads(out.strip().splitlines()[-1])
            print(f"{path} {length}: {results[path][length]}", file=sys.stderr, flush=True)
    top = max(args.lengths)
    line: dict = {"device": args.device, "lengths": args.lengths, "heads_per_layer": args.heads_per_layer}
    line["repeats"] = args.repeats
    line["load_average_1m"] = [load_start, round(os.getloadavg()[0], 2)]
    line["memory_measure"] = "cuda max_memory_allocated" if args.device.startswith("cuda") else "RSS peak"
    for path in PATHS:
        line[f"memory_mb_{path}"] = [round(results[path][n]["memory_mb"], 1) for n in args.lengths]
        line[f"seconds_{path}"] = [round(results[path][n]["seconds"], 2) for n in args.lengths]
        line[f"cpu_seconds_{path}"] = [round(results[path][n]["cpu_seconds"], 2) for n in args.lengths]
    line["first_call_s_fused"] = [round(results["fused"][n]["first_call_s"], 1) for n in args.lengths]
    base = results["unsteered"][top]
    suffix = f"{top // 1024}k"
    for path in ("fused", "blocked"):
        r = results[path][top]
        line[f"memory_ratio_{suffix}_{path}"] = round(r["memory_mb"] / max(base["memory_mb"], 1e-6), 3)
        line[f"time_ratio_{suffix}_{path}"] = round(r["seconds"] / base["seconds"], 3)
        line[f"cpu_time_ratio_{suffix}_{path}"] = round(r["cpu_seconds"] / base["cpu_seconds"], 3)
    for path in PATHS:
        ys = [results[path][n]["memory_mb"] for n in args.lengths]
        line[f"memory_exponent_{path}"] = round(_fit([float(n) for n in args.lengths], ys), 3)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
