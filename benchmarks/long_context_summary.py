"""The printing step of `long_context_analyses.py`: the JSON line from the children's
measurements (ratios over the plain forward, seconds, memory exponents, maxima; the peers' fail
lengths; the plan's errors; Gemma's entries), also rebuilt from earlier runs' stderr logs."""

from __future__ import annotations

import math


def fit(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def header(device: str, lengths: list[int], ig_steps: int, cap_gb: float) -> dict:
    line: dict = {"model": "SmolLM2-135M-Instruct (embedded)", "device": device, "lengths": lengths}
    line["memory_measure"] = "cuda max_memory_allocated" if device.startswith("cuda") else "peak RSS (VmHWM)"
    line["ig_steps"] = ig_steps
    line["cap_gb"] = cap_gb
    return line


def failure(res: dict) -> str | None:
    failed = (
        res.get("failed") or res.get("analysis", {}).get("failed") or res.get("forward", {}).get("failed")
    )
    return str(failed) if failed else None


def summarise(line: dict, results: dict[str, dict[int, dict]], kinds: dict[str, str]) -> None:
    """Per analysis (`results[name][length]`: a child's measurement): the ratios over the plain
    forward, the seconds, the memory exponent; then the maxima over the analyses (`kinds[name]`:
    "gradient" or "forward")."""
    ratios: dict[str, list[float]] = {"gradient": [], "forward": []}
    exponents: list[float] = []
    for name, runs in results.items():
        kind = kinds[name]
        got: dict[int, dict] = {}
        for length in sorted(runs):
            failed = failure(runs[length])
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
        ratios.setdefault(kind, []).extend(mem)  # "reference" sections: out of the maxima
        if len(lengths) > 1:
            e = fit([float(n) for n in lengths], [ana[n]["memory_mb"] for n in lengths])
            line[f"memory_exponent_{name}"] = round(e, 3)
            exponents.append(e)
    if ratios["gradient"]:
        line["max_memory_ratio_gradient"] = round(max(ratios["gradient"]), 3)
    if ratios["forward"]:
        line["max_memory_ratio_forward_only"] = round(max(ratios["forward"]), 3)
    if ratios.get("circuit"):
        line["max_memory_ratio_circuit"] = round(max(ratios["circuit"]), 3)
    if exponents:
        line["max_memory_exponent"] = round(max(exponents), 3)


def from_logs(paths: list[str], kinds: dict[str, str]) -> dict:
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
                if m is None or (m.group(1) is None and m.group(2) not in kinds):
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
    line = header("cpu", lengths, -1, -1.0)
    del line["cap_gb"]
    line["ig_steps"] = sorted(steps)[0] if len(steps) == 1 else sorted(steps) or None
    line["merged_from_logs"] = len(paths)
    order = [name for name in kinds if name in results]
    summarise(line, {name: results[name] for name in order}, kinds)
    if gemma:
        line["gemma_lengths"] = sorted({n for _, n in gemma})
        for (name, length), got in sorted(gemma.items()):
            gemma_entry(line, name, length, got)
    for name, runs in sorted(peers.items()):
        peer_entries(line, name, [(n, runs[n]) for n in sorted(runs)])
    if plans:
        plan_entries(line, plans)
    if loads:
        line["load_average_1m_range"] = [min(loads), max(loads)]
    return line


def records_of_line(line: dict, kinds: dict[str, str]) -> dict[str, dict[int, dict]]:
    """The children's measurements a printed line was summarised from, per analysis and length,
    rebuilt so that `summarise` gives the line's ratios back: the analysis' memory and seconds as
    printed, the forward's memory and time the printed ratios imply (a line's own
    `<analysis>_forward_memory_mb` is rounded to 0.1 MB, its ratios to 0.001)."""
    out: dict[str, dict[int, dict]] = {}
    for name in kinds:
        lengths = line.get(f"{name}_lengths")
        if not lengths:
            continue
        mem, ratio = line[f"{name}_memory_mb"], line[f"{name}_memory_ratio"]
        sec, t_ratio = line[f"{name}_seconds"], line[f"{name}_time_ratio"]
        c_ratio = line[f"{name}_cpu_time_ratio"]
        full = line.get(f"{name}_memory_ratio_all_logits")
        for i, n in enumerate(lengths):
            fwd_s = sec[i] / max(t_ratio[i], 1e-9)
            fwd_mb = mem[i] / max(ratio[i], 1e-9)
            rec = {
                "forward": {"memory_mb": fwd_mb, "seconds": fwd_s, "cpu_seconds": fwd_s},
                "analysis": {"memory_mb": mem[i], "seconds": sec[i], "cpu_seconds": c_ratio[i] * fwd_s},
            }
            if full:
                rec["forward_all_logits"] = {"memory_mb": mem[i] / max(full[i], 1e-9)}
            out.setdefault(name, {})[int(n)] = rec
    return out


def merge_with_line(base: dict, paths: list[str], kinds: dict[str, str]) -> dict:
    """A printed line (`base`) with the measurements of later runs' stderr logs (`paths`) merged
    in: a logged (analysis, length) replaces the line's, the ratios, exponents and maxima are
    recomputed over both, and the line's Gemma, peer and plan entries are kept unless a log has
    its own. For a line whose logs were not kept."""
    import tempfile

    rebuilt = []
    for name, runs in records_of_line(base, kinds).items():
        rebuilt += [f"{name} {n}: {rec!r}" for n, rec in sorted(runs.items())]
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write("\n".join(rebuilt) + "\n")
    try:
        line = from_logs([f.name, *paths], kinds)
    finally:
        import os

        os.unlink(f.name)
    for key, value in base.items():
        if key.startswith(("gemma_", "peer_", "plan_")) and key not in line:
            line[key] = value
    loads = base.get("load_average_1m_range", []) + line.get("load_average_1m_range", [])
    if loads:
        line["load_average_1m_range"] = [min(loads), max(loads)]
    line["ig_steps"] = base.get("ig_steps", line.get("ig_steps"))
    line["merged_from_logs"] = int(base.get("merged_from_logs", 1)) + len(paths)
    return line


def peer_entries(line: dict, name: str, runs: list[tuple[int, dict]]) -> None:
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


def plan_entries(line: dict, cases: dict[str, dict]) -> None:
    """`plan_cases` and the largest relative errors of the plan over the cases that ran."""
    line["plan_cases"] = cases
    ok = [c for c in cases.values() if "error" in c]
    if ok:
        line["plan_error_max"] = max(c["error"] for c in ok)
        line["plan_error_max_activations"] = max(c["activation_error"] for c in ok)


def gemma_entry(line: dict, name: str, length: int, got: dict) -> None:
    key = f"gemma_{name}_{length // 1024}k"
    if "failed" in got:
        line[f"{key}_failed"] = got["failed"]
        return
    line[f"{key}_memory_mb"] = round(got["memory_mb"], 1)
    line[f"{key}_seconds"] = round(got["seconds"], 1)
    if "cpu_seconds" in got:
        line[f"{key}_cpu_seconds"] = round(got["cpu_seconds"], 1)
