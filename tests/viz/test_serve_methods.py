"""`headsteer serve` with AdaptVis / ScalingVis (text variant) and CAA (vectors loaded at start with
`--caa-vector FILE`): each request's answer equals `SteeredModel.generate`, alone and batched with
other requests; bad values get one-line 400s; a request can name a vector, never a file."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from heads.errors import HeadsteerValueError  # noqa: E402
from steer import AdaptVis, Caa, Pasta, ScalingVis, SteeredModel  # noqa: E402
from steer.caa import load_caa_vectors, save_caa_vectors  # noqa: E402
from steer.serving import BatchGenerator, SamplingParams, ServeRequest, parse_steer  # noqa: E402
from tests.support.serve import serve_subprocess  # noqa: E402

PROMPT = "The **key** is"
PAIRS = [("I love it, wonderful", "I hate it, terrible"), ("Yes, gladly", "No, never")]


@pytest.fixture(scope="module")
def caa_file(tiny_llama, tmp_path_factory) -> tuple[Path, Caa]:
    caa = Caa.from_pairs(tiny_llama, PAIRS, layer=1, progress=False)
    path = tmp_path_factory.mktemp("caa") / "vectors.safetensors"
    save_caa_vectors(path, {"happy": caa})
    return path, caa


def _req(prompt: str, steer: list, n: int = 5) -> ServeRequest:
    return ServeRequest(prompt, False, steer, params=SamplingParams(max_tokens=n, temperature=0))


def _want(model, prompt: str, steer: list, n: int = 5) -> list[int]:
    sm = SteeredModel(model)
    out = sm.generate(prompt, steer, max_new_tokens=n, min_new_tokens=n, chat=False, progress=False)
    return [int(t) for t in out.token_ids[0]]


# ------------------------------------------------------------------ in process: the batch generator
def test_served_adaptvis_scalingvis_caa_equal_steered_model(tiny_llama, caa_file):
    """Each request alone and all of them in one batch (with an unsteered and a PASTA row)
    give the tokens of `SteeredModel.generate` with the same intervention."""
    _, caa = caa_file
    vectors = {"happy": caa}
    specs = [
        [{"method": "scalingvis", "weight": 3.0}],
        [{"method": "adaptvis", "weight1": 0.2, "weight2": 4.0, "threshold": 0.0}],
        [{"method": "caa", "vector": "happy", "coefficient": 8.0}],
        [{"method": "caa", "coefficient": 8.0}, {"method": "pasta", "heads": {"1": [0, 2]}}],
        None,
    ]
    prompts = [PROMPT, PROMPT, "Tell me about the weather", PROMPT, "a short **one**"]
    steers = [parse_steer(s, vectors) for s in specs]
    assert isinstance(steers[0][0], ScalingVis) and steers[0][0].target == "text"
    assert isinstance(steers[1][0], AdaptVis) and isinstance(steers[3][1], Pasta)
    assert torch.equal(steers[2][0].vector, caa.vector) and steers[2][0].coefficient == 8.0
    wants = [_want(tiny_llama, p, s) for p, s in zip(prompts, steers, strict=True)]
    plain = _want(tiny_llama, PROMPT, [])
    assert wants[0] != plain and wants[1] != plain  # the steering acts on this model and prompt
    assert wants[2] != _want(tiny_llama, prompts[2], [])
    gen = BatchGenerator(tiny_llama)
    prepared = [gen.prepare(_req(p, s)) for p, s in zip(prompts, steers, strict=True)]
    alone = [gen.run([p])[0].token_ids for p in prepared]
    together = [c.token_ids for c in gen.run(prepared)]
    assert alone == wants
    assert together == wants


def test_served_adaptvis_picks_its_weight_per_request(tiny_llama):
    """The confidence probe runs per request: threshold 0 always picks weight2, 1 always weight1."""
    hi = parse_steer([{"method": "adaptvis", "weight1": 1.0, "weight2": 3.0, "threshold": 0.0}])
    lo = parse_steer([{"method": "adaptvis", "weight1": 3.0, "weight2": 1.0, "threshold": 1.0}])
    gen = BatchGenerator(tiny_llama)
    a, b = gen.run([gen.prepare(_req(PROMPT, hi)), gen.prepare(_req(PROMPT, lo))])
    assert a.token_ids == b.token_ids == _want(tiny_llama, PROMPT, [ScalingVis(3.0)])
    assert hi[0].last["weight"].tolist() == [3.0] and lo[0].last["weight"].tolist() == [3.0]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ([{"method": "adaptvis", "threshold": 2}], "threshold must be in [0, 1]"),
        ([{"method": "adaptvis", "weight1": 1, "weight2": 1}], "no-op"),
        ([{"method": "scalingvis", "weight": -1}], "weight must be in [0, 100]"),
        ([{"method": "scalingvis", "weight": "2"}], "weight must be a finite number"),
        ([{"method": "scalingvis", "target": "image"}], "unknown field"),
        ([{"method": "adaptvis", "layers": 3}], "layers must be a list"),
        ([{"method": "caa", "vector": "happy", "coefficient": float("inf")}], "coefficient"),
        ([{"method": "caa", "vector": "sad"}], "unknown vector 'sad'"),
        ([{"method": "caa", "vector": "/tmp/x.safetensors"}], "unknown vector"),
        ([{"method": "caa", "vector": "happy", "layer": 0}], "unknown field"),
        ([{"method": "caa", "vector": "happy", "coefficient": 0}], "no-op"),
    ],
)
def test_bad_specs_raise_one_line(caa_file, spec, needle):
    with pytest.raises(HeadsteerValueError) as info:
        parse_steer(spec, {"happy": caa_file[1]})
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_caa_without_vectors_and_with_several(caa_file):
    with pytest.raises(HeadsteerValueError, match="no CAA vectors .*--caa-vector"):
        parse_steer([{"method": "caa"}])
    caa = caa_file[1]
    with pytest.raises(HeadsteerValueError, match=r"vector is required: this server has \['a', 'b'\]"):
        parse_steer([{"method": "caa"}], {"a": caa, "b": caa})


def test_adaptvis_without_a_passage_fails_in_prepare(tiny_llama):
    gen = BatchGenerator(tiny_llama)
    with pytest.raises(HeadsteerValueError, match="marked context passage"):
        gen.prepare(_req("no markup at all", parse_steer([{"method": "adaptvis"}])))


# ------------------------------------------------------------------ the vector file
def test_caa_vector_file_round_trip_and_refusals(tiny_llama, caa_file, tmp_path):
    path, caa = caa_file
    back = load_caa_vectors(path)
    assert list(back) == ["happy"] and back["happy"].layer == 1
    assert torch.equal(back["happy"].vector, caa.vector)
    with pytest.raises(HeadsteerValueError, match="exists"):
        save_caa_vectors(path, {"happy": caa})
    with pytest.raises(HeadsteerValueError, match="name"):
        save_caa_vectors(tmp_path / "v.safetensors", {"../x": caa})
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{oops}")
    with pytest.raises(HeadsteerValueError, match="cannot be read"):
        load_caa_vectors(bad)
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(3)}, foreign)
    with pytest.raises(HeadsteerValueError, match="not a headsteer CAA vector file"):
        load_caa_vectors(foreign)
    with pytest.raises(HeadsteerValueError, match="is not a file"):
        load_caa_vectors(tmp_path / "missing.safetensors")
    wrong = tmp_path / "wrong.safetensors"
    save_caa_vectors(wrong, {"w": Caa(torch.ones(7), layer=0)})
    from viz.server.app import create_app

    with pytest.raises(HeadsteerValueError, match="CAA vector 'w': .*length 7"):
        create_app(tiny_llama, caa_vectors=load_caa_vectors(wrong))


# ------------------------------------------------------------------ a real server on loopback
@pytest.fixture(scope="module")
def served(tiny_llama_dir, caa_file, tmp_path_factory):
    """`headsteer serve --model tiny --caa-vector FILE` in a subprocess on a free loopback port."""
    logf = tmp_path_factory.mktemp("serve-methods") / "stderr.log"
    args = ["--caa-vector", str(caa_file[0]), "--batch-wait-ms", "200"]
    with serve_subprocess(tiny_llama_dir, args, logf) as base:
        yield base


def _post(base: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_real_server_serves_caa_and_adaptvis(served, tiny_llama, caa_file):
    caa = caa_file[1]
    jobs = [
        (PROMPT, [{"method": "adaptvis", "weight1": 0.2, "weight2": 4.0, "threshold": 0.0}]),
        ("Tell me about the weather", [{"method": "caa", "vector": "happy", "coefficient": 8.0}]),
        (PROMPT, [{"method": "scalingvis", "weight": 3.0}, {"method": "caa", "coefficient": 8.0}]),
    ]

    def run(job):
        prompt, steer = job
        status, reply = _post(served, {"prompt": prompt, "max_tokens": 5, "temperature": 0, "steer": steer})
        assert status == 200, reply
        return reply["choices"][0]["text"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    sm = SteeredModel(tiny_llama)
    wants = [
        [AdaptVis(weight1=0.2, weight2=4.0, threshold=0.0, target="text")],
        [Caa(caa.vector, 1, 8.0)],
        [ScalingVis(3.0, target="text"), Caa(caa.vector, 1, 8.0)],
    ]
    for (prompt, _), steer, text in zip(jobs, wants, got, strict=True):
        want = sm.generate(prompt, steer, max_new_tokens=5, min_new_tokens=5, chat=False, progress=False)
        assert text == want.text
    for body, needle in [
        ({"steer": [{"method": "caa", "vector": "/etc/passwd"}]}, "unknown vector"),
        ({"steer": [{"method": "adaptvis", "threshold": -1}]}, "threshold"),
    ]:
        status, reply = _post(served, {"prompt": PROMPT, "max_tokens": 2, **body})
        assert status == 400 and needle in reply["error"]["message"], reply


def test_serve_refuses_a_bad_vector_file_before_loading(no_load, tmp_path):
    pytest.importorskip("uvicorn")
    from typer.testing import CliRunner

    from tests.support.cli import one_line_error
    from viz.cli.main import app

    bad = tmp_path / "v.safetensors"
    bad.write_text("not safetensors")
    r = CliRunner().invoke(app, ["serve", "--caa-vector", str(bad)])
    one_line_error(r, "cannot be read", ignore=("loading ", "warning: "))


def _raw_caa_file(path: Path, vector: torch.Tensor) -> Path:
    """A CAA vector file written without `save_caa_vectors` (as a hostile or foreign tool would)."""
    from safetensors.torch import save_file

    save_file({"v": vector}, path, metadata={"format": "headsteer-caa", "layer.v": "1"})
    return path


@pytest.mark.parametrize(
    ("vector", "needle"),
    [
        (torch.full((64,), 1e38), "reaches 1e\\+38"),  # finite float32, but the next norm overflows
        (torch.full((64,), 1e39, dtype=torch.float64), "beyond float32's range"),
    ],
)
def test_huge_vector_file_is_refused_by_the_loader_and_serve(no_load, tmp_path, vector, needle):
    from typer.testing import CliRunner

    from tests.support.cli import one_line_error
    from viz.cli.main import app

    path = _raw_caa_file(tmp_path / "big.safetensors", vector)
    with pytest.raises(HeadsteerValueError, match=f"CAA vector 'v' in .*big.safetensors.*: CAA .*{needle}"):
        load_caa_vectors(path)
    r = CliRunner().invoke(app, ["serve", "--caa-vector", str(path)])
    one_line_error(r, needle.replace("\\", ""), ignore=("loading ", "warning: "))


def test_request_coefficient_that_overflows_is_a_bad_request(tiny_llama):
    """A vector that is fine at coefficient 1 but overflows at the request's coefficient: one
    line from `parse_steer` (the 400 of the server), naming the product."""
    big = Caa(torch.full((tiny_llama.d_model,), 1e16), 1)
    with pytest.raises(
        HeadsteerValueError, match=r"steer\[0\] \(caa\): CAA coefficient x vector reaches 1e\+20"
    ):
        parse_steer([{"method": "caa", "vector": "big", "coefficient": 1e4}], {"big": big})
    assert (
        parse_steer([{"method": "caa", "vector": "big", "coefficient": 10}], {"big": big})[0].coefficient
        == 10
    )


@pytest.mark.parametrize(
    ("vector", "dtype"),
    [(torch.ones(64, dtype=torch.int64), "int64"), (torch.ones(64, dtype=torch.bool), "bool")],
)
def test_non_float_vector_file_is_refused_by_dtype_name(no_load, tmp_path, vector, dtype):
    """An int or bool tensor is not cast to float: the file is refused, naming the dtype."""
    from typer.testing import CliRunner

    from tests.support.cli import one_line_error
    from viz.cli.main import app

    path = _raw_caa_file(tmp_path / "ints.safetensors", vector)
    with pytest.raises(
        HeadsteerValueError, match=f"CAA vector 'v' in .*must be floating point, got dtype {dtype}$"
    ):
        load_caa_vectors(path)
    with pytest.raises(HeadsteerValueError, match=f"got dtype {dtype}"):
        Caa(vector, 1)
    assert Caa(vector.to(torch.bfloat16), 1).vector.dtype == torch.float32  # any float dtype: kept
    r = CliRunner().invoke(app, ["serve", "--caa-vector", str(path)])
    one_line_error(r, f"must be floating point, got dtype {dtype}", ignore=("loading ", "warning: "))


@pytest.mark.parametrize(
    ("args", "entry"),
    [
        (["--alpha", "1"], {"method": "pasta", "alpha": 1}),
        (["--steer", "instaboost", "--multiplier", "1"], {"method": "instaboost", "multiplier": 1}),
    ],
)
def test_noop_is_a_cli_warning_and_a_400_with_the_same_text(tiny_llama_dir, args, entry):
    """The CLI warns and runs (exit 0); the server refuses (400 from `parse_steer`); the message
    is the same sentence, the server's prefixed by the entry (docs/serving.md)."""
    from typer.testing import CliRunner

    from viz.cli.main import app

    prompt = "Hi **there** friend"
    r = CliRunner().invoke(
        app, ["generate", prompt, "--model", tiny_llama_dir, "--max-new-tokens", "1", "--json", *args]
    )
    assert r.exit_code == 0, r.output
    lines = [ln.removeprefix("warning: ") for ln in r.stderr.splitlines() if "no-op" in ln]
    assert len(lines) == 1 and r.stderr.count("warning: ") >= 1, r.stderr
    with pytest.raises(HeadsteerValueError) as info:
        parse_steer([entry])
    assert str(info.value) == f"steer[0] ({entry['method']}): {lines[0]}"
