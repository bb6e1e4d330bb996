"""`QRHeadRequest`: the parameters of QRHead retrieval scores (`heads.qrhead_scores`), as a
checked value (see `heads.scorers.request_base`). The question / passages items are the input."""

from __future__ import annotations

from dataclasses import dataclass

from heads._util.validation import check_bool, short_repr
from heads.errors import HeadsteerValueError
from heads.scorers.request_base import Request

__all__ = ["DEFAULT_NULL_QUERY", "QRHeadRequest"]

DEFAULT_NULL_QUERY = "N/A"
"""QRHead's calibration query (Zhang et al. 2025): its attention is subtracted from the query's."""


@dataclass(frozen=True)
class QRHeadRequest(Request):
    """QRHead: each head's query-to-gold-passage attention, calibrated by a null query.

    Attributes:
        null_query: the calibration query (default `"N/A"`).
        chat: apply the chat template (default None: when the tokenizer has one).

    Raises:
        HeadsteerValueError: an empty null query.
        HeadsteerTypeError: `chat` neither None nor a bool.
    """

    NAME = "qrhead_scores"

    null_query: str = DEFAULT_NULL_QUERY
    chat: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.null_query, str) or not self.null_query.strip():
            raise HeadsteerValueError(
                f"null_query must be a non-empty string, got {short_repr(self.null_query)}"
            )
        if self.chat is not None:
            check_bool("chat", self.chat, what="None, True or False")
