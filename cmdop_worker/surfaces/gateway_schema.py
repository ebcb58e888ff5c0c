"""The gateway's HTTP shapes and its OpenAPI document, from the same pydantic models.

The bodies the API takes and gives (`CancelBody`, `ApprovalBody`, `RunCreated`,
`RunView`, `ApprovalAnswered`, `ErrorBody`) are declared here; the run request, the
result, machines and the events are the product's own models (`models`,
`typed_events`), so the document `/openapi.json` serves describes exactly what
`schemas/` publishes. Pure: no I/O.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cmdop_worker.models import MachinePresence, RunRequest, RunResult
from cmdop_worker.surfaces.approvals import by_problem
from cmdop_worker.surfaces.typed_events import TYPED_EVENT

REF = "#/components/schemas/{model}"
_SEQ = {"type": "string", "pattern": "^[0-9]{1,20}$"}  # ASCII digits: a seq to resume after
_SELECTOR = {
    "name": "selector",
    "in": "query",
    "description": "a Kubernetes label selector (`role=web,env!=staging`, `region in (eu,us)`, "
    "`!canary`), or `*` for every machine",
    "schema": {"type": "string"},
}


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CancelBody(_Body):
    channel: Literal["ui", "operation"] = "operation"
    reason: str = Field(default="api", max_length=500)


class ApprovalBody(_Body):
    approve: bool = True
    input: dict[str, Any] | None = None  # run the call with these arguments instead
    reason: str | None = Field(default=None, max_length=2000)  # a denial's: the model is told
    by: str | None = Field(default=None, max_length=200)  # who answers (default "gateway")
    # The APPROVAL_REQUEST's data as the person saw it: the answer is refused "changed"
    # (409) unless the call's record asks the same (any machine may write events).
    shown: dict[str, Any] | None = None

    @field_validator("by")
    @classmethod
    def _by_is_one_line(cls, by: str | None) -> str | None:
        problem = None if by is None else by_problem(by)
        if problem is not None:
            raise ValueError(problem)
        return by


class RunCreated(BaseModel):
    run_id: str
    # running: a coordinator took it; queued: it waits (for its thread, or for a
    # coordinator to take it); steered: no new run, the text joined `run_id`.
    status: Literal["running", "queued", "steered"]
    steered_from: str | None = None  # the request's own id, when it steered `run_id`
    # What the request was accepted despite, such as its machine being known but
    # offline now (a machine never seen is refused, 422); absent when nothing.
    warnings: list[str] | None = None


class RunView(BaseModel):
    run_id: str
    status: Literal["running", "done", "error", "cancelled"]
    last_seq: int  # the newest event's seq: `?after=` it to follow from here
    turn: int | None = None
    thread_id: str | None = None
    result: RunResult | None = None


class ApprovalAnswered(BaseModel):
    run_id: str
    tool_call_id: str
    verdict: Literal["approved", "denied"]
    tool: str
    machine: str | None


class ErrorBody(BaseModel):
    error: str  # invalid_request, unauthorized, forbidden, not_found, thread_busy, ...
    message: str  # one line, naming the field or the reason
    why: str | None = None  # for approval_not_pending: no_request, answered, expired, ...


def _json(schema: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _errors(*codes: int) -> dict[str, Any]:
    meaning = {
        400: "a Host the gateway does not answer to (invalid_host)",
        401: "no token, or a wrong one",
        403: "a read-only token on a write; a browser's request from another site "
        "(cross_site); a write without X-Cmdop-Client to a gateway with no token",
        404: "no such run (or call)",
        409: "refused: thread busy, duplicate id, call not waiting, run ended",
        413: "body too large",
        415: "a POST whose Content-Type is not application/json",
        422: "invalid: the message names the field, the header or what is wrong with the body",
        429: "too many requests (Retry-After)",
        503: "Redis is unreachable (Retry-After)",
    }
    every = (400, 401, 429, 503)
    return {str(code): _json("ErrorBody", meaning[code]) for code in (*every, *codes)}


def _path(summary: str, responses: dict[str, Any], body: str | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    return op


def _paths() -> dict[str, Any]:
    sse = {"text/event-stream": {"schema": _ref("Event")}}
    events = {
        "200": {"description": "SSE: `id:` is the event's seq, `data:` the event", "content": sse},
        "204": {"description": "the run has ended and nothing is after the given seq"},
    }
    created = {"201": _json("RunCreated", "started or queued"), **_errors(403, 409, 413, 415, 422)}
    return {
        "/v1/runs": {"post": _path("Start a run", created, "RunRequest")},
        "/v1/runs/{run_id}": {
            "get": _path(
                "A run's status and result", {"200": _json("RunView", "the run"), **_errors(404)}
            )
        },
        "/v1/runs/{run_id}/events": {
            "get": {
                **_path("Replay and follow a run's events", {**events, **_errors(404, 422)}),
                "parameters": [
                    {"name": "after", "in": "query", "schema": _SEQ},
                    {"name": "Last-Event-ID", "in": "header", "schema": _SEQ},
                ],
            }
        },
        "/v1/runs/{run_id}/cancel": {
            "post": _path(
                "Cancel a run",
                {
                    "202": {"description": "the run is being cancelled"},
                    **_errors(403, 404, 409, 413, 415, 422),
                },
                "CancelBody",
            )
        },
        "/v1/runs/{run_id}/approvals/{tool_call_id}": {
            "post": _path(
                "Approve, deny or edit a parked tool call",
                {
                    "200": _json("ApprovalAnswered", "answered"),
                    **_errors(403, 404, 409, 413, 415, 422),
                },
                "ApprovalBody",
            )
        },
        "/v1/threads/{thread_id}/runs": {
            "post": _path(
                "A run on a thread, as its on_busy says",
                {**created, "200": _json("RunCreated", "steered the running run")},
                "RunRequest",
            )
        },
        "/v1/machines": {
            "get": {
                **_path(
                    "Machines online (those a label selector matches)",
                    {
                        "200": {
                            "description": "presence",
                            "content": {
                                "application/json": {
                                    "schema": {"type": "array", "items": _ref("MachinePresence")}
                                }
                            },
                        },
                        **_errors(422),
                    },
                ),
                "parameters": [_SELECTOR],
            }
        },
        "/healthz": {
            "get": _path(
                "Liveness (no token needed)",
                {"200": {"description": "Redis answers"}, "503": {"description": "it does not"}},
            )
        },
    }


def _schemas() -> dict[str, Any]:
    found: dict[str, Any] = {}
    models: list[type[BaseModel]] = [
        RunRequest, RunResult, MachinePresence, CancelBody, ApprovalBody,
        RunCreated, RunView, ApprovalAnswered, ErrorBody,
    ]  # fmt: skip
    for model in models:
        schema = model.model_json_schema(ref_template=REF)
        found.update(schema.pop("$defs", {}))
        found[model.__name__] = schema
    event: dict[str, Any] = TYPED_EVENT.json_schema(ref_template=REF)
    found.update(event.pop("$defs", {}))
    found["Event"] = event
    return found


@cache
def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "cmdop-worker gateway",
            "version": "1",
            "description": "Start, follow, cancel and approve runs over HTTP. Send "
            "`Authorization: Bearer TOKEN` when the gateway has tokens configured; without "
            "tokens, send `X-Cmdop-Client` (any value) with every write. A POST body is "
            "`Content-Type: application/json` (UTF-8).",
        },
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": _paths(),
    }
