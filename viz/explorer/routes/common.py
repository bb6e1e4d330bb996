"""What every explorer route takes: the app's `ExplorerState` and its checked request body."""

from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel

from viz.explorer.limits import MAX_BODY_BYTES
from viz.explorer.state import ExplorerState
from viz.web.body import json_object, read_body, validated

__all__ = ["State", "body", "explorer_state"]

R = TypeVar("R", bound=BaseModel)


def explorer_state(request: Request) -> ExplorerState:
    """The app's `ExplorerState` (`app.state.explorer`)."""
    st: ExplorerState = request.app.state.explorer
    return st


State = Annotated[ExplorerState, Depends(explorer_state)]
"""A route parameter: the app's `ExplorerState`."""


def body(cls: type[R]) -> Any:
    """A route dependency: the request's JSON body (at most `MAX_BODY_BYTES`) checked by the
    pydantic model `cls` against the app's model (`viz.web.body.validated`)."""

    async def read(request: Request) -> R:
        obj = json_object(await read_body(request, MAX_BODY_BYTES))
        return validated(cls, obj, {"model": request.app.state.explorer.model})

    return Depends(read)
