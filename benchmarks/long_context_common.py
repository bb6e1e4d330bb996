"""Shared parts of `long_context_analyses.py` (its children, the peers, the plan check, Gemma):
the measurement (peak RSS or CUDA allocation above the start, wall and CPU seconds), the memory
cap, the child processes and the inputs (a seeded pair, a seeded prompt, a needle task's text)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's heads / steer
ANSWERS = (355, 1789)
"""The pairs' target and foil token ids (also the one-scalar AtP metric's logit difference)."""
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "long_context_analyses.py")


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def measure(fn: Callable[[], object], device: str) -> dict:
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
        base = status("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = torch.cuda.max_memory_allocated() if cuda else status("VmHWM")
    return {"memory_mb": (peak - base) / 2**20, "seconds": wall, "cpu_seconds": cpu}


def cap(gb: float) -> None:
    """Cap this process's address space at its current size + `gb` GB (allocations beyond fail)."""
    import resource

    if gb <= 0:
        return
    limit = status("VmSize") + int(gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def guarded(fn: Callable[[], object], device: str) -> dict:
    """`measure(fn)`, or `{"failed": reason}` when it runs out of memory under the cap."""
    try:
        return measure(fn, device)
    except (MemoryError, RuntimeError) as exc:  # the cap: "can't allocate memory" / "DefaultCPUAllocator"
        return {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def child(extra: list[str], args) -> dict:
    cmd = [sys.executable, SCRIPT, *extra, "--device", args.device, "--cap-gb", str(args.cap_gb)]
    cmd += ["--ig-steps", str(args.ig_steps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # big blocks go back to the OS when freed: RSS = live
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"failed": f"exit {done.returncode}: {tail}"}
    return dict(json.loads(lines[-1]))


# ------------------------------------------------------------------------------ inputs
def pair(hm, length: int):
    import torch

    from heads.scorers.patching import pairs_from_tokens

    g = torch.Generator().manual_seed(0)
    clean = torch.randint(100, 40000, (1, length), generator=g)
    corr = clean.clone()
    corr[0, length // 3] = 7777
    corr[0, length - 5] = 8888
    return pairs_from_tokens(clean.tolist(), corr.tolist(), [ANSWERS[0]], [ANSWERS[1]])


def prompt(hm, length: int) -> str:
    """A text of at most `length` tokens, a few fewer (random words decoded from seeded ids)."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(100, 40000, (length,), generator=g).tolist()
    text = hm.tokenizer.decode(ids)
    extra = len(hm.tokenizer(text).input_ids) - length  # decoded words tokenize again differently
    while extra > 0:  # at most `length` tokens: the forward it is compared with has `length`
        ids = ids[: len(ids) - extra]
        text = hm.tokenizer.decode(ids)
        extra = len(hm.tokenizer(text).input_ids) - length
    return text


def task_text(tok, tokens: int) -> str:
    from probes.datasets.needle import needle_task

    return needle_task(tok, tokens, seed=0).text(tok)
