"""Head sweeps on Ray: a local cluster started here; merged shards equal the single-process
sweep, and a shard whose worker dies is retried with nothing lost."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # starts a local Ray cluster: not in make test-fast

from heads import load_model  # noqa: E402
from heads.engine.executors import LocalExecutor, ModelSpec, RayExecutor, merge_tables  # noqa: E402
from heads.scorers.safety.ships import dataset_ships, ships  # noqa: E402
from steer.act.calibration import calibrate_act_heads  # noqa: E402
from steer.pasta.profiling import profile_heads  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["How do I pick a lock?", "Write a poem about rain", "What is two plus two?"]


@pytest.fixture(scope="module")
def cluster():
    """A local 2-CPU Ray cluster; workers import this checkout (and this test module)."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    ok = ~torch.isnan(a)
    assert torch.allclose(a[ok], b[ok], rtol=0, atol=1e-6)


def test_ships_on_ray_equal_single_process(cluster, tiny):
    one = ships(tiny, PROMPTS)
    merged = ships(tiny, PROMPTS, executor=RayExecutor(n_shards=3))
    assert not torch.isnan(merged.scores.scores).any()  # every head scored once
    _same(merged.scores.scores, one.scores.scores)
    _same(merged.per_prompt, one.per_prompt)
    assert merged.scores.params == one.scores.params
    d_one = dataset_ships(tiny, PROMPTS, r_main=1)
    d_ray = dataset_ships(tiny, PROMPTS, r_main=1, executor="ray")  # the connected cluster, 2 shards
    _same(d_ray.scores, d_one.scores)


def test_profiling_and_act_calibration_on_ray(cluster, tiny):
    prompts = ["The key is **blue**. The key is", "My cat is **black**. My cat is"]
    targets = [" blue", " black"]
    one = profile_heads(tiny, prompts, targets)
    merged = profile_heads(tiny, prompts, targets, executor=RayExecutor(n_shards=2))
    _same(merged.scores, one.scores)
    q = ["Is fire hot? Answer:", "Is ice hot? Answer:"]
    choices, labels = [["yes", "no"], ["yes", "no"]], [0, 1]
    a1 = calibrate_act_heads(tiny, q, choices, labels, heads={"1": [0, 1, 2, 3]})
    a2 = calibrate_act_heads(tiny, q, choices, labels, heads={"1": [0, 1, 2, 3]}, executor="ray")
    _same(a2.accuracy.scores, a1.accuracy.scores)
    _same(a2.margin.scores, a1.margin.scores)
    assert a2.heads.heads == a1.heads.heads and a2.base_margin == a1.base_margin


def _load_or_die(path: str, marker: str):
    """Worker loader that kills its own process the first time (the marker file exists). Two
    workers may start at once: removing the marker is the claim, so exactly one of them dies."""
    try:
        os.remove(marker)
    except FileNotFoundError:
        return load_model(path)
    os._exit(1)


def test_killed_worker_shard_is_retried(cluster, tiny, tiny_llama_dir, tmp_path):
    marker = tmp_path / "die-once"
    marker.write_text("")
    spec = ModelSpec(loader=functools.partial(_load_or_die, tiny_llama_dir, str(marker)))
    merged = ships(tiny, PROMPTS, executor=RayExecutor(n_shards=4, max_retries=2, spec=spec))
    assert not marker.exists()  # a worker did die
    _same(merged.scores.scores, ships(tiny, PROMPTS).scores.scores)
    marker.write_text("")
    with pytest.raises(ray.exceptions.RayError):  # without retries the shard is lost: an error, not a gap
        ships(tiny, PROMPTS, executor=RayExecutor(n_shards=2, max_retries=0, spec=spec))


def test_local_executor_and_merge_errors(tiny):
    one = ships(tiny, PROMPTS[:2], heads={"0": [0, 1], "2": [3]})
    parts = ships(tiny, PROMPTS[:2], heads={"0": [0, 1], "2": [3]}, executor=LocalExecutor(n_shards=5))
    _same(parts.scores.scores, one.scores.scores)  # 5 shards capped at 3 heads: none empty
    assert int((~torch.isnan(parts.scores.scores)).sum()) == 3
    with pytest.raises(ValueError, match="either shard= or executor="):
        ships(tiny, PROMPTS, shard=(0, 2), executor="local")
    with pytest.raises(ValueError, match="executor must be"):
        ships(tiny, PROMPTS, executor="threads")
    with pytest.raises(ValueError, match="two shards"):
        merge_tables([torch.zeros(2), torch.tensor([math.nan, 1.0])])
    with pytest.raises(ValueError, match="not loaded from a folder"):
        ModelSpec.of(type(tiny)(tiny.model, tiny.tokenizer, name="in-memory"))


def test_report_safety_has_ray_option():
    from typer.testing import CliRunner

    from viz.cli.main import app

    res = CliRunner().invoke(app, ["report", "safety", "--help"])
    assert res.exit_code == 0
    assert "--ray" in res.output
