"""Batches of served requests: `BatchGenerator` validates a request alone (`prepare`) and decodes
prepared requests together (`run`), each on its own row with its own steering and sampling
generator; `Batcher` is the dynamic batcher (one worker thread collecting the requests that
arrive within `wait_s`, up to `max_batch`)."""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch

from heads._util.validation import short_repr
from heads.engine.context import editing, validate_edits
from heads.engine.edits import (
    Edit,
)
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts, encode_prompts, position_ids
from heads.model.adapter import HeadModel
from heads.scorers.attention_mass import span_attention
from steer.kv_window import check_window_room
from steer.pasta.method import Pasta
from steer.profiles import shipped_profile
from steer.sampling import draw, fresh_seed, row_generator
from steer.steered_model import check_new_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from steer.serving.requests import (
    AUTO_SPAN_TOP_K,
    Completion,
    Prepared,
    SamplingParams,
    ServeRequest,
)
from steer.serving.rows import _pad_to, _RowBias, _RowSpans, _RowWrapper, _wrapper

__all__ = ["Batcher", "BatchGenerator", "Job", "RequestCancelled"]


class RequestCancelled(Exception):
    """The client of a request went away; its row stopped decoding after `completion_tokens`."""

    def __init__(self, message: str = "the client went away", completion_tokens: int = 0):
        super().__init__(message)
        self.completion_tokens = completion_tokens


class BatchGenerator:
    """Runs batches of `ServeRequest`s, each with its own steering, on one model.

    Args:
        model: a `HeadModel` with a tokenizer.
        max_prompt_tokens: longest rendered prompt a request may have, in tokens (default
            None: the model's positions, less `max_tokens`).
    """

    def __init__(self, model: HeadModel, *, max_prompt_tokens: int | None = None):
        if not isinstance(model, HeadModel) or model.tokenizer is None:
            raise HeadsteerTypeError("BatchGenerator needs a HeadModel with a tokenizer (heads.load_model)")
        if max_prompt_tokens is not None and (
            isinstance(max_prompt_tokens, bool)
            or not isinstance(max_prompt_tokens, int)
            or max_prompt_tokens < 1
        ):
            raise HeadsteerValueError(
                f"max_prompt_tokens must be a positive int, got {short_repr(max_prompt_tokens)}"
            )
        self.model = model
        self.max_prompt_tokens = max_prompt_tokens
        tok = model.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = model.model.generation_config.eos_token_id
        if eos is None:
            eos = tok.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}

    def _resolve_auto(self, s: Any, enc: EncodedPrompts, request: ServeRequest) -> Any:
        """Replace `heads="auto"` with the shipped profile (or the span heuristic for PASTA)."""
        if getattr(s, "heads", None) != "auto":
            return s
        kind = "pasta" if isinstance(s, Pasta) else "act"
        try:
            return replace(s, heads=shipped_profile(kind, self.model.name))
        except ValueError:
            if kind != "pasta":
                raise
        warnings.warn(
            f'no shipped PASTA profile for {self.model.name}: heads "auto" falls back to the span '
            f"heuristic (top {AUTO_SPAN_TOP_K} heads by attention on the span)",
            UserWarning,
            stacklevel=2,
        )
        if not any(enc.spans):
            raise HeadsteerValueError(
                "PASTA needs an emphasized span: mark it with **...** or pass emphasize"
            )
        scores = span_attention(self.model, request.prompt, emphasize=request.emphasize, chat=request.chat)
        return replace(s, heads=scores.top(AUTO_SPAN_TOP_K))

    def prepare(self, request: ServeRequest) -> Prepared:
        """Validate `request` alone: encode it, resolve "auto" heads, build its edits once.

        Raises:
            ValueError: bad prompt or span, unknown heads, a method that needs a span
                without one, a prompt longer than `max_prompt_tokens`, prompt + max_tokens
                beyond the model's positions, or an attention edit on a sliding-window layer
                that the decoding would reach (`steer.kv_window.check_window_room`).
        """
        enc = encode_prompts(
            self.model.tokenizer, request.prompt, emphasize=request.emphasize, chat=request.chat
        )
        if enc.batch != 1:
            raise HeadsteerValueError("one prompt per request")
        if self.max_prompt_tokens is not None and enc.length > self.max_prompt_tokens:
            raise HeadsteerValueError(
                f"the prompt has {enc.length} tokens, more than this server's limit of "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)"
            )
        check_new_tokens(self.model, enc.length, request.params.max_tokens, "max_tokens")
        steer = [self._resolve_auto(s, enc, request) for s in request.steer]
        validate_edits(self.model, [e for s in steer for e in s.edits(self.model, enc)])  # as editing() will
        check_window_room(self.model, enc, steer, request.params.max_tokens, "max_tokens")  # not part-way
        seed = request.params.seed
        if seed is None:
            seed = fresh_seed()
        return Prepared(request, enc, steer, seed)

    def _stack(self, items: Sequence[Prepared]) -> EncodedPrompts:
        """Left-pad the requests' encodings into one batch (spans shifted by the padding)."""
        width = max(p.enc.length for p in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        spans = []
        for b, p in enumerate(items):
            pad = width - p.enc.length
            ids[b, pad:] = p.enc.input_ids[0]
            mask[b, pad:] = p.enc.attention_mask[0]
            spans.append([(t0 + pad, t1 + pad) for t0, t1 in p.enc.spans[0]])
        texts = [p.enc.texts[0] for p in items]
        return EncodedPrompts(ids, mask, spans, texts, [p.enc.char_spans[0] for p in items])

    def _edits(self, items: Sequence[Prepared], width: int) -> list[Edit]:
        """Every request's edits, each seeing only its own batch row; one wrapper per (layer, kind).

        A request's interventions build their edits on its own one-row encoding, left-padded
        to the batch width `width`, so they see exactly the row (and absolute positions) they
        run on, and the cost per layer stays one pass over the batch.
        """
        groups: dict[tuple[int, type, int], _RowWrapper] = {}
        for b, p in enumerate(items):
            enc = _pad_to(p.enc, width, self.pad_id)
            for s in p.steer:
                for e in s.edits(self.model, enc):
                    if e.is_identity():
                        continue
                    kind = _wrapper(e)
                    # a span-share wrapper holds one edit per row: a second one on a row opens another
                    slot = 0
                    while kind is _RowSpans and any(
                        row == b for row, _ in getattr(groups.get((e.layer, kind, slot)), "members", ())
                    ):
                        slot += 1
                    key = (e.layer, kind, slot)
                    if key not in groups:
                        groups[key] = kind(layer=e.layer)
                    groups[key].members.append((b, e))
        for w in groups.values():
            if isinstance(w, _RowBias):  # broadcast like the members (`[B, 1, 1, K]` for PASTA)
                w.per_column = all(e.per_column for _, e in w.members)  # type: ignore[misc]
        return list(groups.values())

    @staticmethod
    def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
        """Next token of one row from logits `[V]`, numerically safe over the whole documented range.

        Works in float64 on `(logits - max) / temperature`, so the top token's term is exactly
        `exp(0) = 1` at any temperature in (0, 2]: a tiny temperature (1e-45, the smallest
        double) is greedy rather than `inf / inf`; the top token is always kept by `top_p`
        (a tiny top_p keeps just it). Non-finite logits fall back to greedy on the finite ones.
        """
        x = logits.double()
        if not bool(torch.isfinite(x).all()):
            x = torch.nan_to_num(x, nan=-math.inf, posinf=torch.finfo(x.dtype).max)
        if params.temperature == 0 or not bool(torch.isfinite(x.max())):
            return int(torch.argmax(x))
        probs = torch.softmax((x - x.max()) / params.temperature, dim=-1)
        if params.top_p < 1:
            sp, idx = torch.sort(probs, descending=True)
            keep = (sp.cumsum(0) - sp) < params.top_p  # the smallest prefix reaching top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
        return draw(probs, gen)

    @torch.no_grad()
    def run(
        self,
        items: Sequence[Prepared],
        on_delta: Callable[[int, str], None] | None = None,
        cancelled: Callable[[int], bool] | None = None,
    ) -> list[Completion | Exception]:
        """Decode prepared requests as one batch (KV cache, per-row steering and sampling).

        Args:
            items: requests from `prepare`.
            on_delta: called as `on_delta(row, text)` from this thread with each new piece
                of a row's text (held back while it may be the start of a stop string).
            cancelled: `cancelled(row)` is asked before every step; a row for which it is
                True stops decoding at once (its client went away) and gets `RequestCancelled`.

        Returns:
            one `Completion` per item, in order, or the exception that ended that row alone
            (its sampling or its `on_delta` failed; the other rows go on). An error of the
            whole forward pass raises.
        """
        from transformers import DynamicCache

        hm = self.model
        enc = self._stack(items)
        n = enc.batch
        params = [p.request.params for p in items]
        # each row its own generator (steer.sampling); a rerun of the same request draws the same tokens
        seeds = [p.seed if p.seed is not None else p.request.params.seed for p in items]
        gens = [row_generator(fresh_seed() if s is None else s) for s in seeds]
        errors: dict[int, Exception] = {}
        tokens: list[list[int]] = [[] for _ in range(n)]
        texts = [""] * n
        sent = [0] * n
        reason: list[str | None] = [None] * n
        hold = [max((len(s) for s in prm.stop), default=1) - 1 for prm in params]
        device = hm.device
        mask = enc.attention_mask.to(device)
        pos = position_ids(enc.attention_mask).to(device)
        ids = enc.input_ids.to(device)
        cache = DynamicCache(config=hm.model.config)
        with editing(hm, self._edits(items, enc.length), require_fired=False):
            for _step in range(max(p.max_tokens for p in params)):
                out = hm.run(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                logits = out.logits[:, -1].float().cpu()
                nxt = []
                for b in range(n):
                    if reason[b] is None and cancelled is not None and cancelled(b):
                        reason[b] = "cancelled"
                        errors[b] = RequestCancelled(completion_tokens=len(tokens[b]))
                    if reason[b] is not None:
                        nxt.append(self.pad_id)
                        continue
                    try:
                        t = self._pick(logits[b], params[b], gens[b])
                        tokens[b].append(t)
                        self._advance(b, t, tokens, texts, reason, params[b])
                        if on_delta is not None:
                            end = len(texts[b]) if reason[b] is not None else len(texts[b]) - hold[b]
                            while end > sent[b] and texts[b][end - 1] == "\ufffd":  # incomplete UTF-8
                                end -= 1
                            if end > sent[b]:
                                on_delta(b, texts[b][sent[b] : end])
                                sent[b] = end
                    except Exception as exc:  # noqa: BLE001 - this row's failure is this row's alone
                        reason[b] = "error"
                        errors[b] = exc
                        t = self.pad_id
                    nxt.append(t)
                if all(r is not None for r in reason):
                    break
                ids = torch.tensor(nxt, dtype=torch.long, device=device)[:, None]
                mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
                pos = pos[:, -1:] + 1
        return [
            errors[b]
            if b in errors
            else Completion(
                texts[b], tokens[b], reason[b] or "length", int(items[b].enc.attention_mask.sum())
            )
            for b in range(n)
        ]

    def _advance(
        self,
        b: int,
        t: int,
        tokens: list[list[int]],
        texts: list[str],
        reason: list[str | None],
        prm: SamplingParams,
    ) -> None:
        """Update row b's text after token t; set its finish reason on EOS, stop or length."""
        tok = cast("PreTrainedTokenizerBase", self.model.tokenizer)  # checked in __init__
        if t in self.eos_ids:
            reason[b] = "stop"
            return
        text = cast(str, tok.decode(tokens[b], skip_special_tokens=True))  # one sequence -> one str
        cut = min((i for i in (text.find(s) for s in prm.stop) if i >= 0), default=-1)
        if cut >= 0:
            texts[b] = text[:cut]
            reason[b] = "stop"
            return
        texts[b] = text
        if len(tokens[b]) >= prm.max_tokens:
            reason[b] = "length"


class Job:
    """A queued request (from `Batcher.submit`); `cancel()` stops its row as soon as possible."""

    __slots__ = ("prepared", "on_delta", "on_done", "_cancelled")

    def __init__(self, prepared, on_delta, on_done):
        self.prepared, self.on_delta, self.on_done = prepared, on_delta, on_done
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Its client went away: drop it from the queue, or stop its row before the next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Batcher:
    """Dynamic batching: one worker thread runs the queued requests in batches.

    Args:
        generator: the `BatchGenerator`.
        max_batch: most requests per batch (default 32).
        wait_s: after the first request arrives, wait this long for more (default 0.02 s).
        max_queue: most requests waiting; `submit` raises `queue.Full` beyond it (default 256).

    `submit(prepared, on_delta, on_done)` queues a request and returns its `Job`; `on_delta(text)`
    gets its text pieces and `on_done(completion_or_exception)` its end, both from the worker
    thread. `Job.cancel()` (a client that went away) ends that row alone with `RequestCancelled`.
    One request's failure is that request's alone: a row whose sampling fails ends with its
    error while the batch goes on, and a batch whose forward pass fails is rerun one request
    at a time (a streamed request resumes after the text it already sent), so only the
    offender gets the error. `close()` stops taking requests, finishes the queued ones and
    joins the thread.
    """

    def __init__(
        self, generator: BatchGenerator, *, max_batch: int = 32, wait_s: float = 0.02, max_queue: int = 256
    ):
        if max_batch < 1 or wait_s < 0:
            raise HeadsteerValueError(f"max_batch must be >= 1 and wait_s >= 0, got {max_batch}, {wait_s}")
        self.generator = generator
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._closing = threading.Event()
        self.batches: list[int] = []  # sizes of the batches run (for tests and benchmarks)
        self._thread = threading.Thread(target=self._loop, name="headsteer-batcher", daemon=True)
        self._thread.start()

    def submit(self, prepared: Prepared, on_delta: Callable[[str], None] | None, on_done: Callable) -> Job:
        """Queue a prepared request; returns its `Job` (to `cancel()` it).

        Raises:
            RuntimeError: the batcher is closing.
            queue.Full: too many requests waiting.
        """
        if self._closing.is_set():
            raise RuntimeError("the server is shutting down")
        job = Job(prepared, on_delta, on_done)
        self._queue.put_nowait(job)
        return job

    def _take(self) -> list[Job]:
        try:
            first = self._queue.get(timeout=0.1)
        except queue.Empty:
            return []
        jobs = [first]
        deadline = time.monotonic() + self.wait_s
        while len(jobs) < self.max_batch:
            left = deadline - time.monotonic()
            try:
                jobs.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _run(self, jobs: list[Job], sent: list[str] | None = None) -> list:
        """Run `jobs` as one batch; the result or the exception of each, in order.

        `sent[i]`: text job i already streamed (a rerun skips it, and fails that job alone if
        its new text does not start with it).
        """
        self.batches.append(len(jobs))
        sent = [""] * len(jobs) if sent is None else sent
        fresh = [""] * len(jobs)  # text of this run, per row

        def delta(row: int, text: str) -> None:
            cb = jobs[row].on_delta
            if cb is None:
                return
            before = len(fresh[row])
            fresh[row] += text
            old = sent[row]
            if len(fresh[row]) <= len(old):
                if not old.startswith(fresh[row]):
                    raise RuntimeError("the rerun of this request diverged from the text already sent")
                return
            if not fresh[row].startswith(old):
                raise RuntimeError("the rerun of this request diverged from the text already sent")
            new = fresh[row][max(before, len(old)) :]
            sent[row] = fresh[row]
            try:
                cb(new)
            except Exception:  # noqa: BLE001 - a vanished client ends its own row only
                jobs[row].cancel()

        try:
            return self.generator.run(
                [j.prepared for j in jobs], delta, cancelled=lambda row: jobs[row].cancelled
            )
        except Exception as exc:  # noqa: BLE001 - every waiting request must hear of it
            if len(jobs) == 1:
                return [exc]
        # One request's failure must not take the others down: rerun each alone.
        return [self._run([j], [sent[i]])[0] for i, j in enumerate(jobs)]

    def _loop(self) -> None:
        while not (self._closing.is_set() and self._queue.empty()):
            jobs = self._take()
            gone = [j for j in jobs if j.cancelled]
            jobs = [j for j in jobs if not j.cancelled]
            results = self._run(jobs) if jobs else []
            for j, r in [
                *((j, RequestCancelled()) for j in gone),
                *zip(jobs, results, strict=True),
            ]:
                try:
                    j.on_done(r)
                except Exception:  # noqa: BLE001, S110 - a vanished client must not stop the worker
                    pass

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting requests, finish the queued ones, join the worker."""
        self._closing.set()
        self._thread.join(timeout)
