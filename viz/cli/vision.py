"""`headsteer vision generate` (VAR / VHR / AdaptVis / ScalingVis / CARVE / head-specific visual
modulation steered generation, with an image or a marked context) and `headsteer report vision`.
Registered by `register_vision(app, report_app)` in `viz.cli.main`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from heads._util.progress import offset_progress
from heads._util.validation import short_repr
from heads.errors import HeadsteerValueError
from viz.cli.common import Run, _at_most, _positive, command

vision_app = typer.Typer(
    help="Vision-aware steering (VAR, VHR, AdaptVis, ScalingVis, CARVE, visual modulation) on a "
    "vision-language model or a marked text context.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def register_vision(app: typer.Typer, report_app: typer.Typer) -> None:
    """Add `vision generate` to `app` and `vision` to its `report` group."""
    app.add_typer(vision_app, name="vision")
    command(vision_app, "generate", writes_files=False)(vision_generate)
    command(report_app, "vision")(report_vision)


PROMPT_HELP = "prompt; without --image, mark the context in **double stars**"
ImageOpt = Annotated[
    Path | None, typer.Option("--image", help="image file (PNG/JPEG); none: the **marked** passage is used")
]
VarPOpt = Annotated[float, typer.Option(help="VAR: fraction of sink mass moved")]
VarRhoOpt = Annotated[float, typer.Option(help="VAR: least non-sink image ratio")]
VISION_METHODS = ("var", "vhr", "adaptvis", "scalingvis", "carve", "modulation")
"""The `--steer` choices of `headsteer vision generate`."""
WeightOpt = Annotated[float, typer.Option(help="ScalingVis: factor on the last token's image logits")]
Weight1Opt = Annotated[float, typer.Option(help="AdaptVis: factor when the confidence is below --threshold")]
Weight2Opt = Annotated[float, typer.Option(help="AdaptVis: factor otherwise")]
ThresholdOpt = Annotated[float, typer.Option(help="AdaptVis: confidence threshold in [0, 1]")]
GeneralOpt = Annotated[str, typer.Option(help="CARVE: the general instruction contrasted with the prompt")]
KeepOpt = Annotated[float, typer.Option(help="CARVE: share of the image's pixels kept, in (0, 1]")]
GammaOpt = Annotated[float, typer.Option(help="modulation: amplification strength (0 = no-op)")]
LocalRatioOpt = Annotated[
    float, typer.Option(help="modulation: share of the tokens the local stream selects")
]
RegionsOpt = Annotated[int, typer.Option(help="modulation: grid blocks per side of the spatial stream")]
DimsOpt = Annotated[
    str | None,
    typer.Option("--sink-dims", help='sink dimensions for VAR, e.g. "1415,2533" (default: known backbones)'),
]


def _image(path: Path | None):
    if path is None:
        return None
    from PIL import Image

    if not path.is_file():
        raise HeadsteerValueError(f"--image {str(path)!r} is not a file")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except OSError as exc:  # unreadable, or not an image PIL can decode
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise HeadsteerValueError(f"--image {str(path)!r} cannot be read as an image: {first}") from None


def check_vision_prompt(
    prompt: str, image: Path | None, *, option: str = "prompt", needs_image: str | None = None
) -> None:
    """Refuse, before the model loads, an empty prompt, or one without an image and without a
    **marked** context passage (VAR, VHR, AdaptVis and ScalingVis need the image or the passage).

    Raises:
        ValueError: naming the option.
    """
    from heads.inputs.spans import parse_markup

    if not prompt.strip():
        raise HeadsteerValueError(f"{option} is empty")
    if needs_image is not None and image is None:
        raise HeadsteerValueError(f"{needs_image} needs --image (it refines the image; no text variant)")
    _, spans = parse_markup(prompt)  # also refuses unbalanced ** markup
    if image is None and not spans:
        raise HeadsteerValueError(f"{option} has no **marked** context passage and no --image is given")


def refuse_unused(steer: str, given: dict[str, bool], *, option: str = "--steer") -> None:
    """ValueError naming the options the user gave that `option steer` does not use.

    `given` maps each option name to whether the user gave it (`Run.gave`: on the command line
    even at its default value, so `--weight 0.8` with a method that has no weight is refused). An option that
    changes nothing is refused rather than warned about: the user expects it to act. `option`
    names the choosing option in the message (`--steer` for `generate`, `--method` for `eval`).
    """
    unused = [name for name, on in given.items() if on]
    if unused:
        verb, it = ("is", "it") if len(unused) == 1 else ("are", "them")
        raise HeadsteerValueError(f"{', '.join(unused)} {verb} not used by {option} {steer}; drop {it}")


def _dims(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise HeadsteerValueError(
            f"--sink-dims must be comma-separated ints, got {short_repr(text)}"
        ) from None


def _steer(
    kind: str,
    alpha: float,
    p: float,
    rho: float,
    tau: float | None,
    dims: str | None,
    without: str = "delete",
    adaptvis: dict | None = None,
    carve: dict | None = None,
    modulation: dict | None = None,
):
    """The intervention of `--steer kind`; `adaptvis`: `weight`, `weight1`, `weight2`, `threshold`;
    `carve`: `general`, `keep`; `modulation`: `gamma`, `local_ratio`, `regions` (default: the
    methods' defaults). Every value is checked here, before the model loads."""
    from steer import AdaptVis, Carve, ScalingVis, Var, Vhr, VisualModulation
    from steer.adaptvis import DEFAULT_SCALING_WEIGHT, DEFAULT_THRESHOLD, DEFAULT_WEIGHT1, DEFAULT_WEIGHT2

    av = {
        "weight": DEFAULT_SCALING_WEIGHT,
        "weight1": DEFAULT_WEIGHT1,
        "weight2": DEFAULT_WEIGHT2,
        "threshold": DEFAULT_THRESHOLD,
        **(adaptvis or {}),
    }
    if kind == "vhr":
        return Vhr(alpha=alpha, without_image=without)  # type: ignore[arg-type]  # Vhr checks the value
    if kind == "var":
        return Var(p=p, rho=rho, tau=tau, sink_dims=_dims(dims))
    if kind == "scalingvis":
        return ScalingVis(weight=av["weight"])
    if kind == "adaptvis":
        return AdaptVis(weight1=av["weight1"], weight2=av["weight2"], threshold=av["threshold"])
    if kind == "carve":
        return Carve(**(carve or {}))
    if kind == "modulation":
        return VisualModulation(**(modulation or {}))
    raise HeadsteerValueError(f"--steer must be one of {', '.join(VISION_METHODS)}, got {short_repr(kind)}")


_LABELS = {
    "var": "VAR",
    "vhr": "VHR",
    "adaptvis": "AdaptVis",
    "scalingvis": "ScalingVis",
    "carve": "CARVE",
    "modulation": "visual modulation",
}


def steered_pair(
    run: Run,
    prompt: str,
    kind: str,
    image: Path | None,
    *,
    alpha: float,
    p: float,
    rho: float,
    tau: float | None,
    sink_dims: str | None,
    max_new_tokens: int,
    without_image: str = "delete",
    adaptvis: dict | None = None,
    carve: dict | None = None,
    modulation: dict | None = None,
) -> dict:
    """Unsteered and VAR-, VHR-, AdaptVis-, ScalingVis-, CARVE- or modulation-steered answers to
    `prompt` (with `image`, or on its marked passage), printed side by side; shared by `headsteer
    generate --steer <vision method>` and `headsteer vision generate`."""
    from steer import AdaptVis, Carve, SteeredModel, VisualModulation

    _positive(max_new_tokens=max_new_tokens)
    run.check_new_tokens(max_new_tokens)  # from the config, before the weights
    method = _steer(kind, alpha, p, rho, tau, sink_dims, without_image, adaptvis, carve, modulation)
    check_vision_prompt(prompt, image, needs_image="--steer carve" if kind == "carve" else None)
    img = _image(image)
    hm = run.load()
    sm = SteeredModel(hm)
    images = None if img is None else [img]
    n = max_new_tokens
    label = _LABELS[kind]
    with run.progress(2 * n, f"generating (baseline, then {label}) tokens") as step:
        base = sm.generate(
            [prompt], [], images=images, max_new_tokens=n, progress=offset_progress(step, 0, 2 * n)
        )
        steered = sm.generate(
            [prompt], method, images=images, max_new_tokens=n, progress=offset_progress(step, n, 2 * n)
        )
    table = Table(show_lines=True, expand=True)  # ratio=1 columns: equal widths
    table.add_column("baseline", ratio=1)
    table.add_column(label, ratio=1)
    table.add_row(escape(base.text), escape(steered.text))
    run.show(table)
    out: dict[str, object] = {"baseline": base.text, "steered": steered.text, "steer": kind}
    if isinstance(method, AdaptVis):  # the probe's confidence and the factor it picked
        out["confidence"] = float(method.last["confidence"][0])
        out["weight"] = float(method.last["weight"][0])
    if isinstance(method, Carve) and method.last.get("maps"):  # the pixels kept, the contrast map
        m = method.last["maps"][0][0]
        out["kept"] = round(float(m.mask.float().mean()), 4)
        out["contrast"] = [round(float(x), 5) for x in m.contrast]
        out["grid"] = list(m.task.grid)
    if isinstance(method, VisualModulation) and method.last.get("selection"):  # tokens and heads chosen
        sel = method.last["selection"][0]
        out["selected_tokens"] = [
            int(t) for s_ in sel for t in (s_.selected.nonzero().flatten() + s_.span[0])
        ]
        sens = method.last["sensitivity"][0]
        out["sensitivity"] = {
            str(la): [round(float(x), 4) for x in sens[la]]
            for la in range(sens.shape[0])
            if not sens[la].isnan().any()
        }
    return out


def vision_generate(
    run: Run,
    prompt: Annotated[str, typer.Argument(help=PROMPT_HELP)],
    steer: Annotated[
        str, typer.Option("--steer", help="var | vhr | adaptvis | scalingvis | carve | modulation")
    ] = "vhr",
    image: ImageOpt = None,
    alpha: Annotated[float, typer.Option(help="VHR factor on the selected heads")] = 2.0,
    p: VarPOpt = 0.6,
    rho: VarRhoOpt = 0.5,
    tau: Annotated[float | None, typer.Option(help="VAR sink threshold [default: 20 sqrt(D/4096)]")] = None,
    sink_dims: DimsOpt = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 48,
    without_image: Annotated[
        str,
        typer.Option(
            "--without-image",
            help="VHR's second probe row: 'delete' the image / passage (renumber positions) or 'mask' it "
            "(keep positions; docs/methods/vhr.md)",
        ),
    ] = "delete",
    weight: WeightOpt = 0.8,
    weight1: Weight1Opt = 0.5,
    weight2: Weight2Opt = 1.5,
    threshold: ThresholdOpt = 0.4,
    general: GeneralOpt = "Describe the image.",
    keep: KeepOpt = 0.5,
    gamma: GammaOpt = 1.0,
    local_ratio: LocalRatioOpt = 0.1,
    regions: RegionsOpt = 2,
) -> dict:
    """Print the unsteered and the VAR-, VHR-, AdaptVis-, ScalingVis-, CARVE- or modulation-steered
    answers side by side."""
    if steer not in VISION_METHODS:
        raise HeadsteerValueError(
            f"--steer must be one of {', '.join(VISION_METHODS)}, got {short_repr(steer)}"
        )
    given = {  # option -> (given by the user, even at its default; the methods that use it)
        "--alpha": (run.gave("alpha", alpha, 2.0), ("vhr",)),
        "--without-image": (run.gave("without_image", without_image, "delete"), ("vhr", "modulation")),
        "--p": (run.gave("p", p, 0.6), ("var",)),
        "--rho": (run.gave("rho", rho, 0.5), ("var",)),
        "--tau": (run.gave("tau", tau, None), ("var",)),
        "--sink-dims": (run.gave("sink_dims", sink_dims, None), ("var",)),
        "--weight": (run.gave("weight", weight, 0.8), ("scalingvis",)),
        "--weight1": (run.gave("weight1", weight1, 0.5), ("adaptvis",)),
        "--weight2": (run.gave("weight2", weight2, 1.5), ("adaptvis",)),
        "--threshold": (run.gave("threshold", threshold, 0.4), ("adaptvis",)),
        "--general": (run.gave("general", general, "Describe the image."), ("carve",)),
        "--keep": (run.gave("keep", keep, 0.5), ("carve",)),
        "--gamma": (run.gave("gamma", gamma, 1.0), ("modulation",)),
        "--local-ratio": (run.gave("local_ratio", local_ratio, 0.1), ("modulation",)),
        "--regions": (run.gave("regions", regions, 2), ("modulation",)),
    }
    refuse_unused(steer, {name: on and steer not in users for name, (on, users) in given.items()})
    adaptvis = dict(weight=weight, weight1=weight1, weight2=weight2, threshold=threshold)
    carve = dict(general=general, keep=keep)
    modulation = dict(gamma=gamma, local_ratio=local_ratio, regions=regions, without_image=without_image)
    return steered_pair(
        run,
        prompt,
        steer,
        image,
        alpha=alpha,
        p=p,
        rho=rho,
        tau=tau,
        sink_dims=sink_dims,
        max_new_tokens=max_new_tokens,
        without_image=without_image,
        adaptvis=adaptvis,
        carve=carve,
        modulation=modulation,
    )


def report_vision(
    run: Run,
    prompt: Annotated[str, typer.Option(help=PROMPT_HELP)],
    out: Annotated[Path, typer.Option(help="HTML file to write")],
    image: ImageOpt = None,
    alpha: Annotated[float, typer.Option(help="VHR factor")] = 2.0,
    p: VarPOpt = 0.6,
    rho: VarRhoOpt = 0.5,
    tau: Annotated[float | None, typer.Option(help="VAR sink threshold")] = None,
    sink_dims: DimsOpt = None,
    trace_tokens: Annotated[
        int, typer.Option(help="T-VHD per token over this many generated tokens (0: off)")
    ] = 16,
) -> dict:
    """VHD heatmap, T-VHD per generated token, VAR image-centric head map and sink positions
    over the image grid."""
    from steer import Var, Vhr
    from viz.reports.vision import vision_report

    check_vision_prompt(prompt, image, option="--prompt")
    vhr = Vhr(alpha=alpha)
    var = Var(p=p, rho=rho, tau=tau, sink_dims=_dims(sink_dims))
    if trace_tokens < 0:
        raise HeadsteerValueError(f"--trace-tokens must be >= 0, got {trace_tokens}")
    _at_most("--trace-tokens", trace_tokens, 4096)
    img = _image(image)
    out = run.output(out, suffixes=(".html", ".htm"))
    hm = run.load()
    with run.status("VHD, VAR and sinks…"):
        path, res = vision_report(
            hm, out, prompt, img, vhr=vhr, var=var, overwrite=run.force, trace_tokens=trace_tokens
        )
    run.show(f"T-VHD {res.t_vhd:.3g}")
    trace = None if res.trace is None else res.trace[["token", "t_vhd"]].to_dict("records")
    return {
        "html": str(path),
        "t_vhd": res.t_vhd,
        "t_vhd_per_token": trace,
        "vhr_heads": res.vhr_heads,
        "var_error": res.var_error,
    }
