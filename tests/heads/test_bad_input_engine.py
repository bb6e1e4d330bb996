"""Bad input found by a breaker review: each case raises a clear ValueError (or warns on a
no-op) before any work, and the model is left as it was."""

import pytest
import torch
from PIL import Image

from heads import HeadScale, editing, encode_prompts, forward
from heads.engine.edits import ResidualEdit, ResidualRecorder
from heads.inputs.images import normalize_images
from steer import Iti, SteeredModel
from steer.noop import NoOpWarning


def _logits(model):
    enc = encode_prompts(model.tokenizer, ["one two three four"], chat=False)
    return forward(model, enc)


def test_edit_with_an_empty_head_list_is_refused():
    with pytest.raises(ValueError, match="heads is empty"):
        HeadScale(0, heads=[], factor=0.0)


def test_positions_from_a_generator_or_an_array_are_read_once(tiny_llama):
    import numpy as np

    base = _logits(tiny_llama)
    for positions in ((p for p in [1, 2]), np.array([1, 2])):
        e = HeadScale(0, heads=[0], factor=0.0, positions=positions)
        assert e.positions == (1, 2)
        with editing(tiny_llama, e):
            changed = _logits(tiny_llama)
        assert not torch.equal(changed, base)
    assert torch.equal(_logits(tiny_llama), base)


def test_residual_edits_refuse_heads():
    with pytest.raises(ValueError, match="heads / row_heads do not apply"):
        ResidualRecorder(0, heads=[1]).validate()


def test_residual_edit_returning_another_dtype_is_cast_back(tiny_llama):
    class ToDouble(ResidualEdit):
        def apply(self, x, call):
            return x.double()  # exact in fp64: cast back, nothing changes

    base = _logits(tiny_llama)
    with editing(tiny_llama, ToDouble(0)):
        assert torch.equal(_logits(tiny_llama), base)


@pytest.mark.parametrize(
    "image, message",
    [
        ("http://127.0.0.1:9/x.png", "URLs are not fetched"),
        ("/nonexistent/x.png", "does not exist"),
        (Image.new("RGB", (0, 0)), "empty image"),
        (5, "must be a PIL image"),
        ({"a": 1}, "must be a PIL image"),
    ],
)
def test_bad_images_are_refused_before_any_processor_call(image, message):
    with pytest.raises(ValueError, match=message):
        normalize_images(image, 1)


def test_iti_refuses_huge_alpha_and_overflowing_shifts(tiny_llama):
    d = tiny_llama.d_head
    with pytest.raises(ValueError, match="alpha"):
        Iti(heads=[(0, 0)], directions=torch.ones(1, d), sigmas=torch.ones(1), alpha=1e300)
    big = Iti(heads=[(0, 0)], directions=torch.full((1, d), 1e38), sigmas=torch.full((1,), 1e38), alpha=10.0)
    with pytest.raises(ValueError, match="overflows"):
        big.shifts(tiny_llama)


def test_iti_no_ops_warn_and_unreached_positions_never_fire(tiny_llama):
    d = tiny_llama.d_head
    with pytest.warns(NoOpWarning, match="no heads"):
        Iti(heads=[], directions=torch.zeros(0, d), sigmas=torch.zeros(0))
    with pytest.warns(NoOpWarning, match="all zero"):
        Iti(heads=[(0, 0)], directions=torch.ones(1, d), sigmas=torch.zeros(1))
    far = Iti(heads=[(0, 0)], directions=torch.ones(1, d), sigmas=torch.ones(1), from_position=10**6)
    from heads.engine.context import EditNeverFired

    with pytest.raises(EditNeverFired):
        SteeredModel(tiny_llama).generate("one two", far, chat=False, max_new_tokens=2)


def test_generate_seed_is_checked(tiny_llama):
    for seed in ("x", 1.5, -1, True):
        with pytest.raises(ValueError, match="seed"):
            SteeredModel(tiny_llama).generate("one two", chat=False, max_new_tokens=1, seed=seed)


def test_load_model_checks_device_before_loading(tiny_llama_dir):
    from heads import load_model

    with pytest.raises(ValueError, match="not a torch device"):
        load_model(tiny_llama_dir, device="bogus")
    with pytest.raises(ValueError, match="offload_folder"):
        load_model(tiny_llama_dir, offload_folder="/tmp/x")


def test_attribution_metric_must_depend_on_the_log_probs(tiny_llama):
    from heads.scorers.safety.attribution import attribute

    with pytest.raises(ValueError, match="does not depend"):
        flat = lambda lp, idx: torch.zeros(lp.shape[0])  # noqa: E731
        attribute(tiny_llama, ["one two three"], metric=flat, template=None)


def test_a_reused_edit_must_fire_again(tiny_llama):
    from heads.engine.context import EditNeverFired

    e = HeadScale(0, factor=0.0)
    with editing(tiny_llama, e):
        _logits(tiny_llama)
    with pytest.raises(EditNeverFired):
        with editing(tiny_llama, e):
            pass  # no forward: the edit never ran in this context


@pytest.mark.parametrize(
    "spec",
    [
        [{"method": "ablate", "heads": {}}],
        [{"method": "ablate", "heads": {"0": []}}],
        [{"method": "pasta", "alpha": 1}],
    ],
)
def test_server_steering_that_changes_nothing_is_a_bad_request(spec):
    from steer.serving import parse_steer

    with pytest.raises(ValueError, match="steer\\[0\\]"):
        parse_steer(spec)


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "--method", "iti", "--task", "sentiment", "--iti-direction", "bogus"], "--iti-direction"),
        (["eval", "--method", "iti", "--task", "sentiment", "--iti-k", "0"], "--iti-k"),
        (["eval", "--method", "var", "--task", "context_qa", "--var-p", "2"], "--var-p"),
        (["report", "probes", "--out", "p.html", "--jobs", "0"], "--jobs"),
    ],
)
def test_cli_method_options_are_checked_before_the_model_loads(args, message, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import heads
    from viz.cli.main import app

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(heads, "load_model", no_load)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_scaling_factors_that_multiply_past_the_dtype_bound_are_refused(tiny_llama):
    """Each `HeadScale(1e4)` is in bounds, eight of them on one head give 1e32 (its square
    overflows float32 in the next norm): refused before any forward, naming layer and head;
    the product of two in-bounds factors runs."""
    from steer import Ablate

    base = _logits(tiny_llama)
    stacked = [HeadScale(1, heads=[2], factor=1e4) for _ in range(2)]
    with pytest.raises(ValueError, match=r"HeadScale factors on layer 1 head 2 multiply to 1e\+08"):
        with editing(tiny_llama, stacked):
            pass
    assert torch.equal(_logits(tiny_llama), base)  # the model is as it was
    with editing(tiny_llama, [HeadScale(1, heads=[2], factor=50.0), HeadScale(1, factor=100.0)]):
        _logits(tiny_llama)  # 5000 on head 2: within 1e4
    sm = SteeredModel(tiny_llama)
    ablate = [Ablate(heads={1: [0]}, method="sc", eps=1e4) for _ in range(8)]
    with pytest.raises(ValueError, match="layer 1 head 0 multiply to"):
        sm.generate("one two three", ablate, max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="QueryScale factors on layer 0 head 1"):
        sm.generate("one two", [Ablate(heads={0: [1]}, eps=200.0)] * 2, max_new_tokens=1, progress=False)
