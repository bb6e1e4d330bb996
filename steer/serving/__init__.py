"""Serving steered generation: per-request steering specs, and batches of requests that
each carry their own steering, decoded together through the engine's per-row edits.

The HTTP layer (`viz.server.app`) turns an OpenAI-style body into a `ServeRequest`
(`parse_steer`, `SamplingParams.from_body`), `BatchGenerator.prepare` validates it
alone (so a bad request fails before it joins a batch), and `BatchGenerator.run`
decodes a list of prepared requests as one left-padded batch. Every request's edits
are restricted to its own batch row (`Edit.row_heads`), and its sampling uses its own
`torch.Generator`, so a request gets the same tokens alone or in any batch (up to
float round-off between batch shapes, which does not change greedy answers in the
tests). `Batcher` is the dynamic batcher: one worker thread that collects the requests
arriving within `wait_s` (up to `max_batch`) and runs them as one batch.

The code: `steer.serving.requests` (the request, its steering and decoding fields),
`steer.serving.rows` (each request's edits on its own batch row), `steer.serving.batching`
(`BatchGenerator`, `Batcher`).
"""

from steer.serving.batching import Batcher, BatchGenerator, Job, RequestCancelled
from steer.serving.requests import Completion, Prepared, SamplingParams, ServeRequest, parse_steer
from steer.serving.rows import _RowBias  # noqa: F401 - for the tests of the per-row bias

__all__ = [
    "Batcher",
    "BatchGenerator",
    "Job",
    "RequestCancelled",
    "Completion",
    "Prepared",
    "SamplingParams",
    "ServeRequest",
    "parse_steer",
]
