"""The explorer's jobs: long computations that answer with an event stream and can be cancelled.

A job registers its id in `Jobs` (at most `MAX_JOBS`), waits for the model lock in a thread,
runs, and sends `{"job": id}`, then status / progress / text events, then exactly one last
event (`result`, `error` or `cancelled`). `Jobs.cancel` sets its flag: the work stops at its
next token or progress step, and a job still waiting never starts. A client that goes away
sets the flag too, and the job's slot is freed however its response ends.
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

__all__ = ["MAX_JOBS", "POLL_S", "JOB_ID", "Jobs", "event", "job_stream", "one_line"]

MAX_JOBS = 16
"""Most jobs (generations, score and patching sweeps) running or waiting at once."""
POLL_S = 0.02
"""How often a job's event stream looks for new events (seconds)."""
JOB_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")
"""A job (or tab) id: 8-64 characters of letters, digits, `_` or `-`."""

Work = Callable[[Callable[[dict], None], threading.Event], dict]
"""A job's work: `work(emit, flag)` -> the object of its last event."""


class Jobs:
    """The running / waiting jobs of one explorer: a cancel flag per job id, at most `limit`.

    The ids are made by the page (random per job), so one tab cannot name another's jobs
    without having seen them."""

    def __init__(self, limit: int = MAX_JOBS):
        self.limit = limit
        self._flags: dict[str, threading.Event] = {}
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
            if job in self._flags:
                raise HeadsteerValueError(f"job {job!r} is already running")
            if len(self._flags) >= self.limit:
                raise HeadsteerValueError(f"{self.limit} jobs are already running or waiting; try again")
            flag = self._flags[job] = threading.Event()
            return flag

    def end(self, job: str) -> None:
        with self._lock:
            self._flags.pop(job, None)

    def cancel(self, job: str) -> bool:
        """Flag `job` as cancelled; False when no such job runs."""
        with self._lock:
            flag = self._flags.get(job)
        if flag is None:
            return False
        flag.set()
        return True

    def running(self) -> int:
        with self._lock:
            return len(self._flags)


def event(obj: dict) -> str:
    """One server-sent event: a `data:` line with `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def one_line(exc: BaseException) -> str:
    """`exc` as one line of at most 500 characters (its type when it has no message)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:500]


def job_stream(jobs: "Jobs", lock: threading.Lock, job: str, work: Work) -> Any:
    """Register `job` in `jobs` and return its event-stream response: `work(emit, flag)` runs
    in a thread once it holds the model `lock` and returns the object of the last event.

    Raises:
        HeadsteerValueError: the id is already running, or `jobs` is full (HTTP 400).
    """
    flag = jobs.start(job)
    events: queue.Queue[dict | None] = queue.Queue()

    def run() -> None:
        try:
            got = False
            while not got:
                if flag.is_set():
                    raise Cancelled
                got = lock.acquire(timeout=0.05)
                if not got and not waiting:
                    waiting.append(True)
                    events.put({"status": "waiting for the model (another job runs)"})
            try:
                events.put(work(events.put, flag))
            finally:
                lock.release()
        except Cancelled:
            events.put({"cancelled": True})
        except Exception as exc:  # reported to the page as one line; the server stays up
            events.put({"error": one_line(exc)})
        finally:
            jobs.end(job)
            events.put(None)

    waiting: list[bool] = []
    thread = threading.Thread(target=run, daemon=True, name=f"explorer-{job}")

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
                    await asyncio.sleep(POLL_S)
                    continue
                if ev is None:
                    break
                yield event(ev)
        finally:
            flag.set()  # the client went away (or the job ended): stop the work too

    def closed() -> None:  # however the response ends, even before the stream ever ran
        flag.set()
        if not started:  # the thread never started: nothing else frees the slot
            jobs.end(job)

    started: list[bool] = []
    return _job_stream_response(stream(), closed)


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
