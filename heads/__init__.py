"""headsteer's head-scoring core: model adapter, edit engine, spans, scores and scorers."""

from .attention_mass import head_pattern, span_attention
from .attribution import attribute
from .edits import (
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
from .engine import EditNeverFired, editing
from .forward import forward
from .loading import EMBEDDED_MODEL, cache_dir, load_model, load_tokenizer
from .model import HeadModel
from .prompts import EncodedPrompts, encode_prompts
from .scores import HeadScores, HeadSet
from .spans import Span, char_to_token_range, find_span, parse_markup

__all__ = [
    "EMBEDDED_MODEL",
    "AttentionCall",
    "Edit",
    "EditNeverFired",
    "EncodedPrompts",
    "HeadModel",
    "HeadOutputEdit",
    "HeadScale",
    "HeadScores",
    "HeadSet",
    "LogitBias",
    "ProbEdit",
    "QueryEdit",
    "QueryScale",
    "Recorder",
    "Span",
    "attribute",
    "cache_dir",
    "char_to_token_range",
    "editing",
    "encode_prompts",
    "find_span",
    "forward",
    "head_pattern",
    "load_model",
    "load_tokenizer",
    "parse_markup",
    "span_attention",
]
