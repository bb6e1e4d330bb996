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


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_during(fn) -> tuple[float, object]:
    """Run `fn()`; the highest RSS (MiB) sampled every 5 ms meanwhile, and its result."""
    peak = [_rss_mb()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        stop.set()
        t.join()
    return peak[0], out


def _memory_phase(client, hm, args) -> dict:
    """Peak RSS of one batch of long prompts, unsteered then PASTA-steered (see the module doc)."""
    filler = "The archive lists many routine entries about weather, trains and markets. "
    per = len(hm.tokenizer(filler)["input_ids"])
    reps = max(1, args.memory_prompt_tokens // per)
    prompts = [
        f"Entry {i}. " + filler * reps + f"The code word is **amber {i}**. What is the code word?"
        for i in range(args.memory_requests)
    ]

    def batch(steer):
        def one(prompt):
            r = client.chat.completions.create(
                model=hm.name,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=2,
                temperature=0,
                extra_body={} if steer is None else {"steer": steer},
            )
            return r.usage.prompt_tokens

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))

    base, tokens = _peak_during(lambda: batch(None))
    steered, _ = _peak_during(lambda: batch([{"method": "pasta", "heads": "auto", "alpha": 0.01}]))
    return {
        "memory_requests": len(prompts),
        "memory_prompt_tokens": max(tokens),
        "peak_rss_mb_unsteered": round(base),
        "peak_rss_mb_steered": round(steered),
        "rss_steered_over_unsteered": round(steered / base, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--memory-requests", type=int, default=8)
    ap.add_argument("--memory-prompt-tokens", type=int, default=2000)
    args = ap.parse_args()

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
    memory = _memory_phase(client, hm, args) if args.memory_requests > 0 else {}
    server.should_exit = True
    thread.join(60)

    answered = sum(isinstance(x, str) for x in together)
    crossed = sum(
        isinstance(a, str) and isinstance(b, str) and a != b for a, b in zip(alone, together, strict=True)
    )
    errors = [str(x) for x in [*alone, *together] if not isinstance(x, str)]
    print(
        json.dumps(
            {
                "requests": args.requests,
                "answered": answered,
                "crossed": crossed,
                "batched_over_sequential": round(t_seq / t_batch, 2),
                "sequential_s": round(t_seq, 2),
                "batched_s": round(t_batch, 2),
                "batch_sizes": batches,
                "max_tokens": args.max_tokens,
                "errors": errors[:3],
                **memory,
            }
        )
    )


if __name__ == "__main__":
    main()
