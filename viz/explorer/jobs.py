"""The explorer's jobs: everything that runs the model, within one limit, each cancellable.

A job registers its id in `Jobs` (at most `MAX_JOBS` running or waiting), waits for the model
lock in a thread, runs, and ends. Two shapes:

- `job_stream` (`/api/scores`, `/api/generate`, `/api/patch`): an event stream: `{"job": id}`,
  then status / progress / text events, then exactly one last event (`result`, `error` or
  `cancelled`).
- `run_job` (`/api/prepare`, `/api/pattern`, `/api/head`: one forward or two): the JSON answer
  of the work, or `{"cancelled": true}`.

`Jobs.cancel` sets a job's flag: the work stops at its next token, progress step or layer, and
a job still waiting for the model never starts. A client that goes away sets the flag too, and
the slot is freed however the response ends. `Jobs.stop_all` (the server stopping: Ctrl-C,
SIGTERM) cancels every job and ends every response at once, without waiting for work that
only stops at its next step.
"""

import asyncio
import json
import queue
import re
import secrets
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from heads.errors import HeadsteerValueError
from viz.explorer.scores import Cancelled
from viz.web.body import one_line

__all__ = ["MAX_JOBS", "POLL_S", "JOB_ID", "Jobs", "event", "job_stream", "one_line", "run_job"]

MAX_JOBS = 16
"""Most jobs (generations, sweeps, pattern recordings, head cards) running or waiting at once."""
POLL_S = 0.02
"""How often a job's event stream looks for new events, and a waiting job at its flag (seconds)."""
JOB_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")
"""A job (or tab) id: 8-64 characters of letters, digits, `_` or `-`."""

Work = Callable[[Callable[[dict], None], threading.Event], dict]
"""A job's work: `work(emit, flag)` -> the object of its last event (its answer)."""


class Jobs:
    """The running / waiting jobs of one explorer: a cancel flag per job id, at most `limit`.

    The ids are made by the page (random per job), so one tab cannot name another's jobs
    without having seen them. `supersede(key, job)` cancels the job last registered under `key`
    (a tab's previous prepare or head card), so the page's requests never pile up."""

    def __init__(self, limit: int = MAX_JOBS):
        self.limit = limit
        self.stopping = threading.Event()
        """Set once by `stop_all`: every job is cancelled and no new one starts."""
        self._flags: dict[str, threading.Event] = {}
        self._latest: dict[Any, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def check_id(job: object) -> str:
        if job is None:
            return secrets.token_urlsafe(12)
        if not isinstance(job, str) or not JOB_ID.fullmatch(job):
            raise HeadsteerValueError("job must be 8-64 characters of letters, digits, '_' or '-'")
        return job

    def start(self, job: str) -> threading.Event:
        with self._lock:
            if self.stopping.is_set():
                raise HeadsteerValueError("the explorer is stopping")
            if job in self._flags:
                raise HeadsteerValueError(f"job {job!r} is already running")
            if len(self._flags) >= self.limit:
                raise HeadsteerValueError(f"{self.limit} jobs are already running or waiting; try again")
            flag = self._flags[job] = threading.Event()
            return flag

    def end(self, job: str) -> None:
        with self._lock:
            self._flags.pop(job, None)
            for key in [k for k, v in self._latest.items() if v == job]:
                del self._latest[key]

    def cancel(self, job: str) -> bool:
        """Flag `job` as cancelled; False when no such job runs."""
        with self._lock:
            flag = self._flags.get(job)
        if flag is None:
            return False
        flag.set()
        return True

    def supersede(self, key: Any, job: str) -> None:
        """Cancel the job last registered under `key` (if it still runs) and register `job`."""
        with self._lock:
            before = self._latest.get(key)
            self._latest[key] = job
        if before is not None and before != job:
            self.cancel(before)

    def stop_all(self) -> None:
        """Cancel every job and refuse new ones (the server is stopping)."""
        with self._lock:
            self.stopping.set()
            flags = list(self._flags.values())
        for flag in flags:
            flag.set()

    def running(self) -> int:
        with self._lock:
            return len(self._flags)


def event(obj: dict) -> str:
    """One server-sent event: a `data:` line with `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def _runner(
    jobs: Jobs,
    lock: threading.Lock,
    job: str,
    flag: threading.Event,
    work: Work,
    put: Callable[[dict | None], None],
    failed: Callable[[BaseException], None] | None = None,
) -> Callable[[], None]:
    """The thread body of a job: wait for the model `lock` (giving up once `flag` is set), run
    `work(put, flag)`, `put` its answer, `{"cancelled": true}` or `{"error": line}` (the
    exception also given to `failed`), then None; the slot is freed whatever happens."""

    def run() -> None:
        try:
            got = said = False
            while not got:
                if flag.is_set():
                    raise Cancelled
                got = lock.acquire(timeout=0.05)
                if not got and not said:
                    said = True
                    put({"status": "waiting for the model (another job runs)"})
            try:
                if flag.is_set():
                    raise Cancelled
                put(work(put, flag))
            finally:
                lock.release()
        except Cancelled:
            put({"cancelled": True})
        except Exception as exc:  # reported to the page as one line; the server stays up
            if failed is not None:
                failed(exc)
            put({"error": one_line(exc)})
        finally:
            jobs.end(job)
            put(None)

    return run


def job_stream(jobs: Jobs, lock: threading.Lock, job: str, work: Work) -> Any:
    """Register `job` in `jobs` and return its event-stream response: `work(emit, flag)` runs
    in a thread once it holds the model `lock` and returns the object of the last event.

    Raises:
        HeadsteerValueError: the id is already running, `jobs` is full or stopping (HTTP 400).
    """
    flag = jobs.start(job)
    events: queue.Queue[dict | None] = queue.Queue()
    thread = threading.Thread(
        target=_runner(jobs, lock, job, flag, work, events.put), daemon=True, name=f"explorer-{job}"
    )
    started: list[bool] = []

    async def stream() -> AsyncIterator[str]:
        # async, so a client that goes away cancels this generator at its next await (a sync
        # one would sit in a thread blocked on the queue and never learn it): its `finally`
        # sets the flag, and the work stops at its next token or progress step, or never
        # starts if it still waits for the model
        try:
            yield event({"job": job})
            thread.start()
            started.append(True)
            while True:
                try:
                    ev = events.get_nowait()
                except queue.Empty:
                    if jobs.stopping.is_set():  # the server stops: end now, not at the work's next step
                        yield event({"cancelled": True})
                        break
                    await asyncio.sleep(POLL_S)
                    continue
                if ev is None:  # after the slot was freed: a client that saw the last event finds it free
                    break
                yield event(ev)
        finally:
            flag.set()  # the client went away (or the job ended): stop the work too

    def closed() -> None:  # however the response ends, even before the stream ever ran
        flag.set()
        if not started:  # the thread never started: nothing else frees the slot
            jobs.end(job)

    return _job_stream_response(stream(), closed)


async def run_job(
    jobs: Jobs, lock: threading.Lock, job: str, work: Work, request: Any, *, supersede: Any = None
) -> dict:
    """Register `job`, run `work(emit, flag)` in a thread once it holds the model `lock`, and
    return its answer: the object it returned, `{"cancelled": True}` (cancelled, superseded, the
    client gone or the server stopping) or `{"error": line, "exception": exc}`; `emit`'s
    events are dropped. With `supersede` (a key such as `("prepare", tab)`), the job last run
    under that key is cancelled (`Jobs.supersede`).

    The client's `http.disconnect` (read from `request.receive` once its body is in) sets the
    job's flag: a job still waiting for the model never starts, one that runs stops at its next
    check.

    Raises:
        HeadsteerValueError: the id is already running, `jobs` is full or stopping (HTTP 400).
    """
    flag = jobs.start(job)
    if supersede is not None:
        jobs.supersede(supersede, job)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[dict] = loop.create_future()
    answer: list[dict] = []
    errors: list[BaseException] = []

    def finish() -> None:
        if not done.done():
            last = answer[-1]
            done.set_result({**last, "exception": errors[-1]} if "error" in last and errors else last)

    def put(ev: dict | None) -> None:
        if ev is None:
            loop.call_soon_threadsafe(finish)
        elif "status" not in ev and "progress" not in ev:
            answer.append(ev)

    run = _runner(jobs, lock, job, flag, work, put, errors.append)
    threading.Thread(target=run, daemon=True, name=f"explorer-{job}").start()

    async def left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def stopping() -> None:
        while not jobs.stopping.is_set():
            await asyncio.sleep(POLL_S)

    watchers: list[asyncio.Future[Any]] = [asyncio.ensure_future(left()), asyncio.ensure_future(stopping())]
    try:
        await asyncio.wait([done, *watchers], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in watchers:
            w.cancel()
    if done.done():
        return done.result()
    flag.set()  # the client left or the server stops: the thread frees the slot when it ends
    return {"cancelled": True}


def _job_stream_class() -> Any:
    from starlette.responses import StreamingResponse

    class JobStream(StreamingResponse):
        """An event stream that calls `on_close` once its response is over, whether it was sent,
        cut by the client, or never started (a client gone right after its request)."""

        def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
            super().__init__(content, media_type="text/event-stream")
            self.on_close = on_close

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()

    return JobStream


def _job_stream_response(content: AsyncIterator[str], on_close: Callable[[], None]) -> Any:
    return _job_stream_class()(content, on_close)
