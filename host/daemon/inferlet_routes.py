"""The inferlet API: /v1/inferlets (upload, list) and /v1/instances (launch, list, attach, cancel)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from starlette.requests import ClientDisconnect

from .errors import BadRequest, ClientGone, TooLarge
from .runs import capped_limits
from .schemas import utf8_len
from .service import Service, owner_of

router = APIRouter(prefix="/v1")


def _service(request: Request) -> Service:
    return request.app.state.service


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass `limit` bytes."""
    too_large = TooLarge(f"the component is larger than this server's limit of {limit >> 20} MiB "
                         "(pie serve --max-upload-mb)")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    data = bytearray()
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise too_large
    except ClientDisconnect:  # the client left mid-body: nobody reads an answer (499, not a 500)
        raise ClientGone("the client went away while sending its body") from None
    return bytes(data)


@router.post("/inferlets")
async def upload(request: Request, name: str | None = None):
    """The body is the .wasm itself (any content type); `?name=` names it."""
    svc = _service(request)
    wasm = await _body(request, svc.config.max_upload_bytes)
    if not wasm:
        raise BadRequest("the body is empty: send the .wasm component's bytes", param="file")
    inferlet, new = await svc.inferlets.upload(wasm, name, owner_of(request))
    return JSONResponse(inferlet.card(), status_code=201 if new else 200)


@router.get("/inferlets")
async def list_inferlets(request: Request) -> dict:
    return {"object": "list", "data": [p.card() for p in await _service(request).inferlets.listing(owner_of(request))]}


class LaunchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field would silently change a run

    inferlet: str = Field(min_length=1)  # a built-in's name, an upload's name, or a sha256
    args: list[str] = []
    limits: dict[str, float] = {}  # named as `pie run`'s flags without dashes, in their units; capped
    detach: bool = False  # keep running when an attached client goes away


@router.post("/instances")
async def launch(body: LaunchRequest, request: Request):
    svc = _service(request)
    if len(body.args) > svc.config.limits.inferlet_args:
        raise BadRequest(f"args: {len(body.args)} arguments exceed this server's limit of "
                         f"{svc.config.limits.inferlet_args}", param="args")
    for arg in body.args:
        utf8_len(arg, "args")
    inferlet = await svc.inferlets.find(body.inferlet, owner_of(request))
    limits = capped_limits(body.limits, svc.runtime.limits)
    owner, arrived = await svc.admit(request)  # waits for a slot as a completion does
    run = svc.runs.launch(inferlet, body.args, limits, body.detach, owner, arrived)
    return JSONResponse(run.card(), status_code=201)


@router.get("/instances")
async def list_instances(request: Request) -> dict:
    return {"object": "list", "data": [r.card() for r in _service(request).runs.list(owner_of(request))]}


@router.get("/instances/{instance_id}")
async def get_instance(instance_id: str, request: Request) -> dict:
    return _service(request).runs.get(instance_id, owner_of(request)).card()


@router.get("/instances/{instance_id}/events")
async def attach(instance_id: str, request: Request):
    run = _service(request).runs.get(instance_id, owner_of(request))
    return StreamingResponse(run.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.post("/instances/{instance_id}/cancel")
async def cancel(instance_id: str, request: Request) -> dict:
    run = _service(request).runs.get(instance_id, owner_of(request))
    run.cancel("a client asked to cancel it")
    return run.card()
