"""headsteer's head-scoring core: model adapter, edit engine, spans, scores and scorers.

Layering (docs/architecture.md, enforced by `tests/test_layering.py`): `heads` <- `steer`, `probes` <-
`viz`. `heads` imports nothing from `steer`, `probes` or `viz`, not even inside a function.

Where a head scorer lives, and why:

* **Read-only scorers are here**, because they need only the model and the generic edits of
  `heads.engine.edits` (recorders, query/output scaling): span attention (`attention_mass`), sinks
  and massive activations (`sinks`), MAPS from the weights and its validation (`maps`,
  `maps_inference`, the whole study in `maps_analysis`), Ships / dataset-level Ships /
  Sahara with UA or SC ablation (`ships`), all on the batched variant engine (`variants`).
* **Scorers that need a method's own edit live beside that method in `steer/`**, since
  `heads` cannot import the method: PASTA profiling (`steer.pasta.profiling.profile_heads`,
  `select_heads`) uses `PastaBias`; ACT head calibration (`steer.act.calibration`) uses
  `ActEdit`. They still run on `heads.engine.variants`.
* **Scorers that judge generated text are in `probes/`**: the safety-head study with the
  attack success rate (`probes.studies.safety.safety_analysis`) needs the refusal judge, and task
  evaluation (`probes.studies.evaluate`) the task metrics.

Long-running functions report progress as numbers, `progress(done, total)` (`heads._util.progress`).

Shape letters in docstrings (`[B, T]`: a batch of token rows): B batch rows;
N rows of a flattened batch (prompts x variants, or examples); T token positions of a
sequence; P the padded prompt length (the T of an encoded prompt batch, before generation);
Q query positions and K key positions of one attention call; H query heads; G KV heads
(H / G query heads share one, GQA); D d_model; d d_head; L layers; V vocabulary; M head
variants (`heads.engine.variants`). A head selection in any accepted form is a `HeadSpec`.
"""

import sys as _sys

from heads._util import aliases as _aliases
from heads._version import __version__
from heads.engine.activations import ActivationEdit, ActivationRecorder
from heads.engine.context import editing
from heads.engine.edits import (
    AttentionCall,
    Edit,
    HeadOutputEdit,
    HeadScale,
    LogitBias,
    ProbEdit,
    QueryEdit,
    QueryScale,
    Recorder,
)
from heads.engine.forward import forward
from heads.engine.hooks import hook_names, record, run_with_hooks
from heads.engine.options import SweepOptions
from heads.errors import (
    EditNeverFired,
    HeadsteerError,
    HeadsteerTypeError,
    HeadsteerValueError,
    MissingDependency,
)
from heads.inputs.prompts import EncodedPrompts, encode_prompts
from heads.inputs.spans import Span, char_to_token_range, find_span, parse_markup
from heads.model.adapter import HeadModel
from heads.model.loading import EMBEDDED_MODEL, cache_dir, load_model, load_tokenizer
from heads.planning import MemoryPlan, MemoryRequest, plan_memory
from heads.results.activations import ActivationCache
from heads.results.composition import CompositionScores
from heads.results.evaluation import PairEvaluation
from heads.results.knockout import KnockoutResult
from heads.results.protocol import Result
from heads.results.qk import QKAttribution
from heads.results.roles import RoleScores
from heads.results.scores import HeadScores, HeadSet, HeadSpec
from heads.scorers.attention_mass import head_pattern, position_attention, span_attention
from heads.scorers.circuits import Circuit, find_circuit
from heads.scorers.circuits.request import CircuitRequest
from heads.scorers.circuits.scores import EdgeScores
from heads.scorers.dispatch import run
from heads.scorers.gating.chg import GateTask, GatingResult, gate_heads
from heads.scorers.gating.request import GatingRequest
from heads.scorers.maps.request import MapsRequest
from heads.scorers.maps.static import MapsScores, maps_scores
from heads.scorers.patching.activation import PatchResult, patch
from heads.scorers.patching.evaluate import evaluate_pairs
from heads.scorers.patching.knockout import knockout
from heads.scorers.patching.logit import DLAResult, LensResult, direct_logit_attribution, logit_lens
from heads.scorers.patching.pairs import PairBatch, PromptPair, encode_pairs, load_pairs
from heads.scorers.patching.path import path_patch
from heads.scorers.patching.request import (
    DLARequest,
    KnockoutRequest,
    LensRequest,
    PatchRequest,
    PathPatchRequest,
)
from heads.scorers.qk import composition_scores, data_composition_scores, qk_attribution
from heads.scorers.qk.request import CompositionRequest, QKRequest
from heads.scorers.request_base import Request
from heads.scorers.retrieval.qrhead import qrhead_scores
from heads.scorers.retrieval.request import QRHeadRequest
from heads.scorers.roles.atlas import HeadAtlas, head_atlas
from heads.scorers.roles.detectors import detect_roles
from heads.scorers.roles.lens import AttentionLens, train_lens
from heads.scorers.roles.request import AtlasRequest, DetectRolesRequest, LensTrainRequest
from heads.scorers.safety.attribution import attribute as attribution_patching
from heads.scorers.safety.common import ShipsResult
from heads.scorers.safety.request import AttributionRequest, DatasetShipsRequest, SaharaRequest, ShipsRequest
from heads.scorers.safety.ships import SaharaResult, dataset_ships, sahara, ships
from heads.scorers.sink_dims import SinkDims, find_sink_dims
from heads.scorers.sink_requests import SinkDimsRequest, SinkStatsRequest
from heads.scorers.sinks import SinkStats, sink_stats

__all__ = [
    "__version__",
    "EMBEDDED_MODEL",
    "AttentionCall",
    "Edit",
    "EditNeverFired",
    "EncodedPrompts",
    "HeadModel",
    "HeadOutputEdit",
    "HeadScale",
    "HeadScores",
    "HeadsteerError",
    "HeadsteerTypeError",
    "HeadsteerValueError",
    "HeadSet",
    "HeadSpec",
    "LogitBias",
    "MissingDependency",
    "ProbEdit",
    "QueryEdit",
    "QueryScale",
    "Recorder",
    "Span",
    "SweepOptions",
    "Circuit",
    "find_circuit",
    "cache_dir",
    "char_to_token_range",
    "editing",
    "encode_prompts",
    "find_sink_dims",
    "find_span",
    "forward",
    "head_pattern",
    "load_model",
    "load_tokenizer",
    "parse_markup",
    "span_attention",
    "path_patch",
    "CompositionScores",
    "QKAttribution",
    "composition_scores",
    "data_composition_scores",
    "qk_attribution",
    "ActivationCache",
    "ActivationEdit",
    "ActivationRecorder",
    "hook_names",
    "record",
    "run_with_hooks",
    "PairEvaluation",
    "evaluate_pairs",
    "MemoryPlan",
    "MemoryRequest",
    "plan_memory",
    "position_attention",
    # the analyses (the front door: issue 38), their requests and results
    "patch",
    "direct_logit_attribution",
    "logit_lens",
    "knockout",
    "detect_roles",
    "train_lens",
    "head_atlas",
    "ships",
    "dataset_ships",
    "sahara",
    "attribution_patching",
    "maps_scores",
    "qrhead_scores",
    "gate_heads",
    "sink_stats",
    "run",
    "PairBatch",
    "PromptPair",
    "encode_pairs",
    "load_pairs",
    "GateTask",
    "Request",
    "PatchRequest",
    "PathPatchRequest",
    "DLARequest",
    "LensRequest",
    "KnockoutRequest",
    "CircuitRequest",
    "DetectRolesRequest",
    "LensTrainRequest",
    "AtlasRequest",
    "ShipsRequest",
    "DatasetShipsRequest",
    "SaharaRequest",
    "AttributionRequest",
    "MapsRequest",
    "QRHeadRequest",
    "GatingRequest",
    "SinkStatsRequest",
    "SinkDimsRequest",
    "QKRequest",
    "CompositionRequest",
    "Result",
    "PatchResult",
    "DLAResult",
    "LensResult",
    "KnockoutResult",
    "RoleScores",
    "EdgeScores",
    "HeadAtlas",
    "AttentionLens",
    "ShipsResult",
    "SaharaResult",
    "MapsScores",
    "GatingResult",
    "SinkStats",
    "SinkDims",
]


def __getattr__(name: str) -> object:
    """`heads.attribute`: the old name of `attribution_patching`, kept one release (warns)."""
    if name == "attribute":
        import warnings

        warnings.warn(
            "heads.attribute is deprecated: use heads.attribution_patching (attribution patching, AtP); "
            "the old name is removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return attribution_patching
    raise AttributeError(f"module 'heads' has no attribute {name!r}")


_aliases.install()  # the moved modules' old paths, one release (heads._util.aliases)
_aliases.keep_functions(
    _sys.modules[__name__], ("ships",)
)  # `import heads.ships` (old path) keeps heads.ships()
