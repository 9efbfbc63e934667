"""The FastAPI application of `pie serve`: routes, middleware, and every error in OpenAI's shape."""

from __future__ import annotations

import logging
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from . import inferlet_routes, openai_routes
from .errors import APIError, BadRequest, NotFound
from .middleware import ApiKeys, BodyLimit, RequestLog, RunningLimit
from .service import Service

log = logging.getLogger("pie.serve")


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 (a malformed body, a wrong type, a missing field) as OpenAI's 400."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return BadRequest(f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}",
                          code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return BadRequest(f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)


class Deployment(Protocol):
    """What a server that is one replica of several (host/cluster) answers for the whole
    deployment: /health and /metrics over every replica, given this one's own."""

    async def health(self, local: dict) -> dict: ...

    async def metrics(self, local: bytes) -> bytes: ...


def create_app(service: Service, deployment: Deployment | None = None) -> FastAPI:
    app = FastAPI(title="pie", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.include_router(openai_routes.router)
    app.include_router(inferlet_routes.router)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = service.metrics.render()
        if deployment is not None:
            body = await deployment.metrics(body)
        return Response(body, media_type=service.metrics.content_type)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the server takes requests, 503 once it is shutting down (open, as /metrics)."""
        adm = service.admission
        ok = not adm.closed
        body = {"status": "ok" if ok else "shutting_down", "model": service.model,
                "running": adm.running, "waiting": adm.waiting}
        if deployment is not None:
            body = await deployment.health(body)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return _error(NotFound(f"no route {request.url.path}"))
        err = BadRequest(str(exc.detail), code=None)
        err.status = exc.status_code
        return _error(err)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error serving %s", request.url.path)
        return _error(APIError(f"internal error: {type(exc).__name__}"))

    # added last = outermost: a refused key is logged and counted too, and refused before its body is read
    lim = service.config.limits
    app.add_middleware(BodyLimit, limit=lim.body_bytes, header_limit=lim.header_bytes, timeout=lim.body_timeout_s,
                       exempt={("POST", "/v1/inferlets")})
    app.add_middleware(ApiKeys, keys=service.config.api_keys, metrics=service.config.metrics_need_key)
    app.add_middleware(RunningLimit, limit=lim.requests)
    app.add_middleware(RequestLog, metrics=service.metrics, replica=service.config.replica)
    return app
