"""The explorer's FastAPI routers, one module per concern (`create_explorer` includes them all).

- `page`: `GET /`, `GET /plotly.min.js`, `GET /api/info`.
- `views`: `POST /api/prepare`, `POST /api/pattern`, `POST /api/head` (a head's pattern and card).
- `scores`: `POST /api/scores` (the overview grid).
- `generate`: `POST /api/generate`, `POST /api/cancel`.
- `patching`: `POST /api/patch`.
- `qk`: `POST /api/qk` (a pattern cell's QK attribution).
"""

from viz.explorer.routes import generate, page, patching, qk, scores, views

ROUTERS = (page.router, views.router, scores.router, generate.router, patching.router, qk.router)
"""Every router of the explorer, in the order `create_explorer` includes them."""

__all__ = ["ROUTERS"]
