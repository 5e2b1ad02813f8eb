"""Request bodies in /openapi.json for routes that parse their body by hand.

The routes read `Model.model_validate_json(await raw.body())` themselves (so any
Content-Type is read as JSON and every parse error gets one OpenAI error body), which
leaves FastAPI nothing to document: without this, the schema shows no request bodies and
generated clients and fuzzers (openapi-generator, schemathesis) send none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF_TEMPLATE = "#/components/schemas/{model}"


def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` give each POST path in `bodies` a required JSON request body of
    its model, the models' schemas (nested ones included) in components/schemas.

    Call it after the routes are added: a path with no POST route is a ValueError here rather
    than a silently undocumented endpoint.
    """
    posted = {route.path for route in app.routes if isinstance(route, APIRoute) and "POST" in route.methods}
    if missing := sorted(set(bodies) - posted):
        raise ValueError(f"no POST route to document a request body for: {', '.join(missing)}")
    generate: Callable[[], dict[str, Any]] = app.openapi
    documented: dict[str, Any] | None = None

    def openapi() -> dict[str, Any]:
        # FastAPI caches its schema and rebuilds it when routes change; each new one is amended once.
        nonlocal documented
        schema = generate()
        if schema is not documented:
            _add_request_bodies(schema, bodies)
            documented = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_request_bodies(schema: dict[str, Any], bodies: dict[str, type[BaseModel]]) -> None:
    refs, definitions = models_json_schema([(model, "validation") for model in bodies.values()],
                                           ref_template=REF_TEMPLATE)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in definitions.get("$defs", {}).items():
        # FastAPI names its own schemas by model too; one name for two schemas would break the $refs.
        if components.get(name, definition) != definition:
            raise ValueError(f"two different schemas are named {name!r} in the OpenAPI document")
    components.update(definitions.get("$defs", {}))
    for path, model in bodies.items():
        operation = schema["paths"].get(path, {}).get("post")
        if operation is None:  # a route left out of the schema (include_in_schema=False)
            continue
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[(model, "validation")]}},
        }
