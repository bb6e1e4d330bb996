"""`MapsRequest`: the parameters of static MAPS relation scores (`heads.maps_scores`), as a
checked value (see `heads.scorers.request_base`). The relations are the input."""

from __future__ import annotations

from dataclasses import dataclass

from heads._util.validation import check_bool
from heads.scorers.request_base import Request

__all__ = ["MapsRequest"]


@dataclass(frozen=True)
class MapsRequest(Request):
    """Static MAPS: how strongly each head's OV circuit maps a relation's sources to its targets.

    Attributes:
        apply_first_mlp: read sources as `MLP_0(Norm_0(E))` for heads in layers >= 1 (default True).

    Raises:
        HeadsteerTypeError: `apply_first_mlp` not a bool.
    """

    NAME = "maps_scores"

    apply_first_mlp: bool = True

    def __post_init__(self) -> None:
        check_bool("apply_first_mlp", self.apply_first_mlp)
