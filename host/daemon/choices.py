"""The choices of one OpenAI request (a batch's prompts times `n`): one instance each, started in
order as admission gives each a slot, their text merged into one stream of (index, event).
A prompt's further samples start once its first has emitted: its prompt's blocks are in the
prefix cache by then, so they are prefilled once, not n times (host/engine/prefix_cache.py)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request

from ..engine.loop import LoopStats
from .errors import APIError, TooManyRequests
from .instances import Generation
from .service import Plan, Service
from .shapes import Delta, Ended


class Choices:
    """A request's choices hold at most one queue place at a time: the next starts once the one
    before it has a slot. A choice refused for a full queue or the key's instance limit waits for
    one of its own to end and tries again, so a batch larger than the limits still runs."""

    def __init__(self, service: Service, request: Request, plans: list[Plan]):
        self.service, self.request, self.plans = service, request, plans
        self.gens: list[Generation | None] = [None] * len(plans)

    async def start_first(self) -> None:
        """Before the response begins: the first choice's refusal is the request's HTTP answer."""
        self.gens[0] = await self.service.start(self.request, self.plans[0])

    async def events(self) -> AsyncIterator[tuple[int, Delta | Ended]]:
        """(index, Delta) as the choices generate and (index, Ended) as each ends, until all have.
        A choice's failure is raised; leaving early cancels every choice."""
        queue: asyncio.Queue[tuple[int, Delta | Ended | APIError]] = asyncio.Queue()
        pumps: list[asyncio.Task] = []

        async def pump(i: int, gen: Generation) -> None:
            try:
                async for text in gen.text():
                    queue.put_nowait((i, Delta(text, gen.logprobs())))
                rest = gen.logprobs()  # tokens without text of their own (an EOS), or held at the end
                if rest:
                    queue.put_nowait((i, Delta("", rest)))
                queue.put_nowait((i, Ended(gen.finish_reason, gen.limit)))
            except APIError as e:
                queue.put_nowait((i, e))

        async def starter() -> None:
            first_of = {p.prompt_index: i for i, p in reversed(list(enumerate(self.plans)))}
            for i in range(1, len(self.plans)):
                j = first_of[self.plans[i].prompt_index]  # the prompt's first sample
                first = self.gens[j]
                if self.service.engine.prefix is not None and first is not None and i != j:
                    await first.began.wait()
                try:
                    self.gens[i] = await self._start(i)
                except APIError as e:
                    queue.put_nowait((i, e))
                    return
                pumps.append(asyncio.ensure_future(pump(i, self.gens[i])))

        pumps.append(asyncio.ensure_future(pump(0, self.gens[0])))
        starting = asyncio.ensure_future(starter())
        done = 0
        try:
            while done < len(self.plans):
                i, item = await queue.get()
                if isinstance(item, APIError):
                    raise item
                done += isinstance(item, Ended)
                yield i, item
        finally:
            starting.cancel()
            for t in pumps:
                t.cancel()
            self.abandon()

    async def _start(self, i: int) -> Generation:
        while True:
            running = [g for g in self.gens[:i] if not g.ended.is_set()]
            try:
                return await self.service.start(self.request, self.plans[i])
            except TooManyRequests:
                if not running:
                    raise  # none of ours holds a slot: waiting would not free one
            waits = [asyncio.ensure_future(g.ended.wait()) for g in running]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    def abandon(self) -> None:
        for g in self.gens:
            if g is not None:
                g.abandon()

    async def all(self) -> list[tuple[str, Ended, list | None]]:
        """Every choice's text, end and logprobs (None: not asked for), in index order."""
        texts: list[list[str]] = [[] for _ in self.plans]
        ends: list[Ended | None] = [None] * len(self.plans)
        logprobs: list[list | None] = [None] * len(self.plans)
        async for i, item in self.events():
            if isinstance(item, Ended):
                ends[i] = item
            else:
                texts[i].append(item.text)
                if item.logprobs is not None:
                    logprobs[i] = (logprobs[i] or []) + item.logprobs
        return [("".join(t), e, lp) for t, e, lp in zip(texts, ends, logprobs)]

    def spec_metrics(self) -> dict:
        """The answer's `metrics`: the choices' speculation together (LoopStats.summary)."""
        stats = [g.handle.draft_stats for g in self.gens if g is not None and g.handle.draft_stats is not None]
        return {"speculative_decoding": LoopStats.summary(stats)}

    def usage(self) -> dict:
        """A prompt counted once however many samples it had, as OpenAI counts it."""
        prompt = sum(p.prompt_tokens for p in self.plans if p.sample == 0)
        completion = sum(g.completion_tokens for g in self.gens if g is not None)
        cached = sum(g.cached_tokens for g in self.gens if g is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}
