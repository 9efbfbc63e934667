"""The OpenAI-compatible endpoints: /v1/models (and /v1/models/{id}), /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .choices import Choices
from .errors import APIError, ClientGone, NotFound
from .middleware import failed_in_stream
from .schemas import ChatRequest, CompletionRequest
from .service import Service, client_gone
from . import sse
from .shapes import ChatShape, CompletionShape, Ended

router = APIRouter(prefix="/v1")


def _service(request: Request) -> Service:
    return request.app.state.service


def _card(svc: Service) -> dict:
    return {"id": svc.model, "object": "model", "created": 0, "owned_by": "pie", "root": svc.model,
            "max_model_len": svc.engine.info.context_len}


@router.get("/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_card(_service(request))]}


@router.get("/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    svc = _service(request)
    if model_id != svc.model:
        raise NotFound(f"the model {model_id!r} does not exist; this server serves {svc.model!r}",
                       param="model", code="model_not_found")
    return _card(svc)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    svc = _service(request)
    plans = await svc.plan(request, body, body.prompts(), body.max_tokens)
    top = body.logprobs_top()
    shape = CompletionShape(svc.model, body.include_usage(), top, svc.token_texts)
    if body.echo:
        shape.echoes = await _unless_gone(request, svc.echoes(request, plans, top))
    if body.max_tokens == 0:  # the prompts alone: no instance runs
        return _echoed(plans, shape, body.stream)
    return await _respond(request, Choices(svc, request, plans), shape, body.stream, _metrics(svc, body))


def _metrics(svc: Service, body) -> bool:
    return svc.config.spec_metrics if body.spec_decode_metrics is None else body.spec_decode_metrics


def _echoed(plans, shape: CompletionShape, stream: bool):
    """The answer of max_tokens=0: each choice's echoed prompt, ended at its length."""
    end = Ended("length")
    usage = {"prompt_tokens": sum(p.prompt_tokens for p in plans if p.sample == 0), "completion_tokens": 0}
    usage["total_tokens"] = usage["prompt_tokens"]
    if not stream:
        return JSONResponse(shape.response([("", end, []) for _ in plans], usage))

    def chunks():
        for i in range(len(plans)):
            for c in shape.ends(i, end):
                yield sse.data(c)
        if shape.include_usage:
            yield sse.data(shape.usage_chunk(usage))
        yield sse.data(sse.DONE)
    return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    svc = _service(request)
    offered = body.offered()
    plans = await svc.plan(request, body, [await svc.render_chat(body.messages, offered)], body.token_limit())
    shape = ChatShape(svc.model, body.include_usage(), calling=offered is not None, logprobs=body.logprobs_top(),
                      texts=svc.token_texts)
    return await _respond(request, Choices(svc, request, plans), shape, body.stream, _metrics(svc, body))


async def _respond(request: Request, choices: Choices, shape: CompletionShape | ChatShape, stream: bool,
                   metrics: bool):
    """metrics: the answer ends with the choices' speculation metrics (`metrics`, vLLM's place)."""
    # the first choice's instance has started (or the request was refused) before any byte of the response
    await choices.start_first()
    if stream:
        return StreamingResponse(_events(request, choices, shape, metrics), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    out = await _unless_gone(request, choices.all())
    body = shape.response(out, choices.usage())
    if metrics:
        body["metrics"] = choices.spec_metrics()
    return JSONResponse(body)


async def _unless_gone(request: Request, work):
    """`work`'s result; if the client goes away first, `work` is cancelled (leaving the choices'
    text cancels their instances and frees their slots) and the request ends as 499."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)  # its cancel has run
        raise ClientGone("the client went away before its completion was ready")
    return task.result()


async def _events(request: Request, choices: Choices, shape: CompletionShape | ChatShape,
                  metrics: bool) -> AsyncIterator[str]:
    """The SSE stream. A client that disconnects cancels the request's task here, and leaving
    the choices' events early cancels their instances."""
    try:
        async for i, item in choices.events():
            for chunk in shape.ends(i, item) if isinstance(item, Ended) else shape.deltas(i, item):
                yield sse.data(chunk)
    except APIError as e:  # the response has begun: the error goes in the stream, as vLLM sends it
        failed_in_stream(request, e)
        yield sse.data(e.body())
    else:
        last = shape.usage_chunk(choices.usage()) if shape.include_usage else None
        if metrics:  # in the usage chunk, else in one of its own (no choices) after the last choice's
            last = (last or shape.chunk(None)) | {"metrics": choices.spec_metrics()}
        if last is not None:
            yield sse.data(last)
    finally:
        choices.abandon()  # cancelled before its text began: the instances must not run on alone
    yield sse.data(sse.DONE)
