"""OpenAPI documentation of the routes whose bodies the handlers validate themselves: each
route's request body schema (every body documented here is added to the document's
components, so generated clients and the schemathesis fuzz test see it) and its answers."""

from __future__ import annotations

from pydantic import BaseModel

from xllm_py.entrypoints.openai_protocol import ERROR_STATUSES, ErrorResponse

BODIES: list[type[BaseModel]] = []  # in the order the routes were documented


def error_docs(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": ERROR_STATUSES[s]} for s in statuses}


CHUNKS = "`data: {...}` chunks, then `data: [DONE]`"  # chat's and completions' stream


def post_doc(body: type[BaseModel], what: str, stream: bool = True, events: str = CHUNKS) -> dict:
    """Route arguments that document a POST route whose body the handler validates itself:
    the request body's schema (registered in BODIES, which api_server's `_openapi` adds
    to the document's components) and every answer."""
    if body not in BODIES:
        BODIES.append(body)
    return {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{body.__name__}"}
                    }
                },
            }
        },
        "responses": {
            200: {
                "description": f"{what}: one JSON object, or with `stream: true` server-sent "
                f"events ({events})",
                "content": {"application/json": {}, "text/event-stream": {}},
            }
            if stream
            else {"description": what, "content": {"application/json": {}}},
            **error_docs(400, 401, 404, 413, 429, 500, 503),
        },
    }
