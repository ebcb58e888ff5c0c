"""How the client shapes what it sends: a run request as Flower shows it
(`request_repr`), and a pydantic model as the `output_schema` the fleet validates
against (`output_schema_of`). Pure; `Client.submit` uses both (and `surfaces.client`
re-exports them)."""

from __future__ import annotations

import textwrap
from typing import Any

from pydantic import BaseModel

from cmdop_worker.models import RunRequest


def request_repr(request: RunRequest) -> str:
    """What Flower shows as `cmdop.run`'s kwargs: ids and a shortened prompt, no payload."""
    prompt = request.prompt or f"<{len(request.messages or [])} messages>"
    shown = {"run_id": request.run_id, "agent": request.agent, "machine": request.machine}
    shown["prompt"] = textwrap.shorten(prompt, 80, placeholder=" …")
    return repr({"request": {k: v for k, v in shown.items() if v is not None}})


def output_schema_of(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON Schema with `$ref`s inlined (the fleet's validator has no `$ref`)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any, depth: int) -> Any:
        if isinstance(node, list):
            return [inline(item, depth) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/") and depth < 20:
            return inline(defs[ref.removeprefix("#/$defs/")], depth + 1)
        return {key: inline(value, depth) for key, value in node.items()}

    return dict(inline(schema, 0))
