"""``POST /v1/responses``: the OpenAI Responses API on acb serve (stateless)."""

from __future__ import annotations

from typing import Any


def add_routes(app: Any, state: Any) -> None:
    """Add the Responses API's route to ``app`` (built by :func:`acb.serve.app.build_app`)."""
