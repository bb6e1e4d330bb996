"""Load test of `headsteer serve`: concurrent clients with mixed steering on the embedded model.

Starts the server in this process (uvicorn in a thread, 127.0.0.1, a free port) on the
embedded SmolLM2-135M-Instruct, then sends the same `--requests` chat requests (greedy,
`--max-tokens` each, a mix of unsteered, PASTA with the shipped profile and with other
alphas, SpotLight and head ablation) twice with the official `openai` client:

1. one at a time (each request alone in its batch): the baseline answers and time;
2. all at once from `--requests` concurrent clients (the server batches them).

Prints one JSON line: `requests`, `answered` (HTTP 200 with a choice), `crossed` (answers
that differ from the same request run alone), `batched_over_sequential` (time of 1 over
time of 2; goal >= 2 on a 2-core CPU), the two wall times and the batch sizes the server ran.

3. (unless `--memory-requests 0`) peak memory: `--memory-requests` concurrent long prompts
   (`--memory-prompt-tokens` each, one emphasized span, 2 new tokens) unsteered, then the same
   batch with PASTA (shipped profile): `peak_rss_mb_unsteered`, `peak_rss_mb_steered` (process
   RSS sampled every 5 ms during each batch) and `rss_steered_over_unsteered` (goal <= 1.2: a
   per-row edit costs what a per-call one costs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEERS = [
    None,
    [{"method": "pasta", "heads": "auto", "alpha": 0.01}],
    [{"method": "pasta", "heads": "auto", "alpha": 0.1}],
    [{"method": "spotlight", "tau": 0.2}],
    [{"method": "ablate", "heads": {"10": [0, 1], "12": [4]}}],
    [{"method": "pasta", "heads": {"8": [1, 2], "14": [0]}, "alpha": 0.05}],
]
PROMPTS = [
    "The meeting moved to **Thursday at 3 pm**. When is the meeting?",
    "Answer in **one word**: what is the capital of France?",
    "Write a short haiku about **autumn rain**.",
    "List **two** colours of the rainbow.",
    "Tom has a **red** bike and Ann a blue one. What colour is Tom's bike?",
    "Explain in a sentence why the **sky** looks blue.",
    "Name a fruit that is **yellow**.",
    "Translate **good morning** into French.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_mb(pid: int, field: str) -> float:
    """`field` (`VmRSS`: resident now, `VmHWM`: the peak since the process started) of process
    `pid` in MiB, from `/proc/PID/status` (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def _memory_phase(args, steer: list | None) -> dict:
    """One batch of long prompts against a fresh `headsteer serve` subprocess (see the module doc).

    Starts the server (`--max-batch` = `--memory-requests`, a long batch wait so that every
    request joins one batch), sends one short warm-up request with the same `steer`, reads
    the server's resident memory, then sends the `--memory-requests` long prompts at once and
    reads its peak (`VmHWM`, which a fresh process per phase resets). Returns the idle and
    peak MiB, the prompt tokens and how many requests were answered.
    """
    import openai

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    port = _free_port()
    n = args.memory_requests
    cmd = [sys.executable, "-m", "viz.cli", "serve", "--port", str(port), "--max-batch", str(n)]
    cmd += ["--batch-wait-ms", str(args.memory_wait_ms), "--quiet", "--json"]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=root)
        try:
            ready = proc.stdout.readline() if proc.stdout is not None else b""
            if not ready:
                log.seek(0)
                raise RuntimeError(f"the server did not start: {log.read().decode()[-2000:]}")
            model = json.loads(ready)["model"]
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600
            )
            for _ in range(600):  # the JSON line comes just before uvicorn listens
                try:
                    client.models.list()
                    break
                except openai.APIConnectionError:
                    time.sleep(0.1)
            extra = {} if steer is None else {"steer": steer}

            def one(prompt: str, max_tokens: int) -> int:
                r = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body=extra,
                )
                return r.usage.prompt_tokens

            filler = "The archive lists many routine entries about weather, trains and markets. "
            short = one("The code word is **amber**. What is the code word?", 2)  # warm-up
            per = (one(filler * 10 + "The code word is **amber**. What is the code word?", 2) - short) / 10
            idle = _proc_mb(proc.pid, "VmRSS")
            before = _proc_mb(proc.pid, "VmHWM")
            reps = max(1, round((args.memory_prompt_tokens - short) / per))
            prompts = [
                f"Entry {i}. " + filler * reps + f"The code word is **amber {i}**. What is the code word?"
                for i in range(n)
            ]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                tokens = list(pool.map(lambda p: one(p, 2), prompts))
            seconds = time.perf_counter() - t0
            peak = _proc_mb(proc.pid, "VmHWM")
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"idle": idle, "peak_before": before, "peak": peak, "tokens": max(tokens), "seconds": seconds}


def _memory(args) -> dict:
    """Peak RSS of the server over one batch of long prompts, unsteered then PASTA-steered."""
    base = _memory_phase(args, None)
    steered = _memory_phase(args, [{"method": "pasta", "heads": "auto", "alpha": 0.01}])
    return {
        "memory_requests": args.memory_requests,
        "memory_prompt_tokens": max(base["tokens"], steered["tokens"]),
        "idle_rss_mb_unsteered": round(base["idle"]),
        "idle_rss_mb_steered": round(steered["idle"]),
        "peak_rss_mb_unsteered": round(base["peak"]),
        "peak_rss_mb_steered": round(steered["peak"]),
        "peak_rss_steered_over_unsteered": round(steered["peak"] / base["peak"], 3),
        "batch_rss_steered_over_unsteered": round(
            (steered["peak"] - steered["idle"]) / (base["peak"] - base["idle"]), 3
        ),
        # False: loading the model peaked higher than the batch (the peaks then say nothing)
        "batch_set_peak": base["peak"] > base["peak_before"] and steered["peak"] > steered["peak_before"],
        "memory_batch_s_unsteered": round(base["seconds"], 1),
        "memory_batch_s_steered": round(steered["seconds"], 1),
    }


def _throughput(args) -> dict:
    """Parts 1 and 2 of the module doc: the requests one at a time, then all at once."""
    import openai
    import uvicorn

    from heads import load_model
    from viz.server.app import create_app

    hm = load_model()
    app = create_app(hm, max_batch=args.requests, wait_s=0.05)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=3600
    )

    jobs = [(PROMPTS[i % len(PROMPTS)], STEERS[i % len(STEERS)]) for i in range(args.requests)]

    def ask(job):
        prompt, steer = job
        try:
            r = client.chat.completions.create(
                model=hm.name,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=args.max_tokens,
                temperature=0,
                extra_body={} if steer is None else {"steer": steer},
            )
            return r.choices[0].message.content
        except openai.APIError as exc:
            return exc

    ask(jobs[0])  # warm-up
    t0 = time.perf_counter()
    alone = [ask(j) for j in jobs]
    t_seq = time.perf_counter() - t0
    batches_before = len(app.state.batcher.batches)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.requests) as pool:
        together = list(pool.map(ask, jobs))
    t_batch = time.perf_counter() - t0
    batches = app.state.batcher.batches[batches_before:]
    server.should_exit = True
    thread.join(60)

    answered = sum(isinstance(x, str) for x in together)
    crossed = sum(
        isinstance(a, str) and isinstance(b, str) and a != b for a, b in zip(alone, together, strict=True)
    )
    errors = [str(x) for x in [*alone, *together] if not isinstance(x, str)]
    return {
        "requests": args.requests,
        "answered": answered,
        "crossed": crossed,
        "batched_over_sequential": round(t_seq / t_batch, 2),
        "sequential_s": round(t_seq, 2),
        "batched_s": round(t_batch, 2),
        "batch_sizes": batches,
        "max_tokens": args.max_tokens,
        "errors": errors[:3],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32, help="throughput part: clients (0: skip it)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--memory-requests", type=int, default=8, help="memory part: batch size (0: skip)")
    ap.add_argument("--memory-prompt-tokens", type=int, default=2000)
    ap.add_argument("--memory-wait-ms", type=float, default=3000.0, help="memory servers: --batch-wait-ms")
    args = ap.parse_args()
    if args.requests < 0 or args.memory_requests < 0 or args.requests + args.memory_requests == 0:
        ap.error("--requests and --memory-requests must be >= 0, not both 0")
    out = _throughput(args) if args.requests > 0 else {}
    if args.memory_requests > 0:
        out.update(_memory(args))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
