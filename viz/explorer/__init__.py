"""The interactive head explorer: a local FastAPI app (`headsteer explore`)."""

from viz.explorer.app import MAX_BODY_BYTES, MAX_NEW_TOKENS, MAX_PROMPT_CHARS, create_explorer

__all__ = ["MAX_BODY_BYTES", "MAX_NEW_TOKENS", "MAX_PROMPT_CHARS", "create_explorer"]
