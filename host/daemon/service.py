"""What one server holds (the runtime, its model, instances and metrics) and how an OpenAI
request becomes the inferlet's arguments."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from ..grammar import GrammarError
from ..paths import BUILD, pie_home
from ..runtime.grammars import grammars_for
from ..runtime.runtime import Runtime
from .admission import Admission
from .errors import BadRequest, NotFound, UnknownModel
from .instances import Generation, Instances, cache_namespace
from .limits import ServeLimits
from ..engine.logprobs import score_tokens
from .logprobs import Echo, TokenTexts
from .metrics import Metrics
from .inferlets import Inferlet, Inferlets, Shelf
from .runs import Runs
from . import tools
from .schemas import ChatMessage, Constraint, SamplingRequest, utf8_len
from .tools import Tool

CONSTRAINED = "constrained-speculative-decoding"  # serves a response_format


@dataclass(frozen=True)
class ServeConfig:
    inferlet: Path  # the .wasm that serves completions unless a request names another (text-completion)
    max_instances: int = 8  # OpenAI requests and launched inferlets together
    max_queue: int = 32  # requests waiting for a slot; past them 429
    max_instances_per_key: int | None = None  # running and waiting, per API key; None: no limit
    api_keys: list[str] | None = None  # None: no authentication
    metrics_need_key: bool = False  # /metrics asks for a key (with api_keys) instead of being open
    builtin_dir: Path = BUILD  # the built inferlets the inferlet API lists and launches by name
    upload_dir: Path | None = None  # None: $PIE_HOME/inferlets
    max_upload_bytes: int = ServeLimits.upload_bytes
    limits: ServeLimits = ServeLimits()  # what one request may cost before an instance runs
    spec_metrics: bool = False  # every answer carries its speculation's metrics (a request may ask alone)
    replica: str | None = None  # this server's id as a replica of a deployment (host/cluster); None: alone


class Service:
    def __init__(self, runtime: Runtime, config: ServeConfig, shelf: Shelf | None = None):
        """shelf: where a deployment's replicas share their uploads (None: one server's folder)."""
        self.runtime = runtime
        self.engine = runtime.engine
        self.config = config
        self.model = self.engine.info.name
        self.token_texts = TokenTexts(self.engine.tokenizer)  # logprobs' token texts, cached per id
        self.metrics = Metrics(self.model)
        self.admission = Admission(config.max_instances, config.max_queue, config.max_instances_per_key)
        self.metrics.watch(lambda: self.admission.running, lambda: self.admission.waiting)
        if self.engine.prefix is not None:
            self.metrics.watch_prefix_cache(self.engine.prefix)
        if self.engine.suffix is not None:
            self.metrics.watch_suffix_index(self.engine.suffix)
        self.instances = Instances(runtime, self.admission, self.metrics,
                                   config.limits.kv_share_per_key if config.api_keys else None)
        self.inferlets = Inferlets(runtime, config.builtin_dir, config.upload_dir or pie_home() / "inferlets",
                                   config.max_upload_bytes, config.limits.uploads_per_key,
                                   config.limits.upload_storage_per_key, shelf)
        runtime.cache.max_loaded = config.limits.loaded_components
        self.runs = Runs(self.instances, config.replica)
        wasm = config.inferlet.read_bytes()
        self.default_inferlet = Inferlet(config.inferlet.stem, hashlib.sha256(wasm).hexdigest(), len(wasm), True,
                                         config.inferlet)
        # a prompt longer than this many UTF-8 bytes cannot fit the context: refused before tokenizing
        self.max_prompt_bytes = self.engine.info.context_len * _longest_token_bytes(
            self.engine.tokenizer, config.limits.prompt_bytes_per_token)

    async def admit(self, request: Request) -> tuple[str | None, float]:
        """A slot for the request's key (waiting in the queue if need be; leaving it if the
        client goes away): (its owner, when it arrived)."""
        arrived = time.perf_counter()
        owner = owner_of(request)
        await self.admission.acquire(owner, lambda: client_gone(request))
        return owner, arrived

    async def completion_inferlet(self, name: str | None, owner: str | None = None) -> Inferlet:
        """The inferlet a completion names (a built-in's or an upload's name, or a sha256), else the default."""
        if name is None:
            return self.default_inferlet
        try:
            return await self.inferlets.find(name, owner)
        except NotFound as e:  # a bad field of the request, as OpenAI reports one
            raise BadRequest(e.message, param="inferlet", code="inferlet_not_found") from None

    async def constrained_inferlet(self, name: str | None, c: Constraint, owner: str | None = None) -> Inferlet:
        """The inferlet that serves a constrained request: constrained-speculative-decoding (or the
        one the request names). The grammar is compiled here (off the event loop: it may take a
        while), so a bad one is a 400 before any work."""
        limit = self.config.limits.schema_bytes
        if len(c.source) > limit:  # json.dumps' ASCII: characters are bytes
            raise BadRequest(f"{c.param}: the grammar's {len(c.source)} bytes exceed this server's limit of {limit}",
                             param=c.param)
        try:
            await asyncio.to_thread(grammars_for(self.engine).compile, c.kind, c.source)
        except GrammarError as e:
            raise BadRequest(f"{c.param}: {e}", param=c.param) from None
        return await self.completion_inferlet(name or CONSTRAINED, owner)

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise UnknownModel(f"the model {name!r} does not exist; this server serves {self.model!r}",
                               param="model")

    async def render_chat(self, messages: list[ChatMessage], offered: list[Tool] | None = None) -> str:
        """All messages in the model's chat template, with the assistant's turn opened. For one
        user message this is the text `--chat` renders inside the inferlet (the same bindings
        call), so the tokens match `pie run text-completion --chat`; for a conversation it keeps
        the system message and earlier turns, which `--chat` on the last message would drop.
        `offered`: the tools the model may call. A template with tool support renders them and
        previous calls itself; for one without, tools.py's default rendering: the tools in the
        system message, a previous turn's calls as the model writes them."""
        tok = self.engine.tokenizer
        template = getattr(tok, "chat_template", None)
        if not template:
            raise BadRequest(f"model {self.model} has no chat template; use /v1/completions", param="messages")
        if len(messages) > self.config.limits.messages:
            raise BadRequest(f"{len(messages)} messages exceed this server's limit of {self.config.limits.messages}",
                             param="messages")
        native = "tool_calls" in template or "tools" in template
        msgs = [_message(m, native) for m in messages]
        kw = {}
        if offered and native:
            kw["tools"] = [t.model_dump(exclude_none=True) for t in offered]
        elif offered:
            head = tools.system_text(offered)
            if msgs[0]["role"] == "system":
                msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + head}
            else:
                msgs.insert(0, {"role": "system", "content": head})
        self.check_prompt_bytes(sum(utf8_len(m.get("content") or "", "messages") for m in msgs), "messages")
        try:  # jinja is slow on long conversations: off the event loop
            return await asyncio.to_thread(tok.apply_chat_template, msgs, tokenize=False, add_generation_prompt=True,
                                           **kw)
        except Exception as e:  # jinja raises its own exceptions for conversations a template rejects
            raise BadRequest(f"the chat template rejected the messages: {e}", param="messages") from None

    def check_prompt_bytes(self, n: int, param: str) -> None:
        if n > self.max_prompt_bytes:
            raise BadRequest(f"the prompt's {n} bytes cannot fit the model's context of {self.engine.info.context_len} "
                             "tokens", param=param, code="context_length_exceeded")

    async def plan(self, request: Request, req: SamplingRequest, prompts: list[str | list[int]],
                   max_tokens: int | None) -> list[Plan]:
        """The request's choices (each prompt `n` times, in OpenAI's order), every one checked
        before any starts. A prompt is text (already templated: passed without --chat) or token ids."""
        self.check_model(req.model)
        req.check_supported()
        limits = self.config.limits
        n = req.n or 1
        if len(prompts) * n > limits.choices:
            raise BadRequest(f"{len(prompts)} prompts times n={n} make {len(prompts) * n} choices, past this server's "
                             f"limit of {limits.choices} (pie serve --max-choices)",
                             param="n" if len(prompts) == 1 else "prompt")
        stops = req.stops(limits.stops, limits.stop_chars)
        extra = req.extra_args(limits.inferlet_args) + req.bias_arg(self.engine.info.vocab_size) + req.penalty_args()
        for p in prompts:
            if isinstance(p, str):
                self.check_prompt_bytes(utf8_len(p, "prompt"), "prompt")
            else:
                self.check_prompt_ids(p)
        c = req.constraint()
        if c is None:
            inferlet = await self.completion_inferlet(req.inferlet, owner_of(request))
        else:
            inferlet = await self.constrained_inferlet(req.inferlet, c, owner_of(request))
            extra += [c.flag, c.source]
        logprobs = req.logprobs_top()
        seed = req.seed if req.seed is not None else secrets.randbits(63)  # unseeded requests differ
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        plans = []
        for i, p in enumerate(prompts):
            # the same encoding as the inferlet's (the bindings' encode): the prompt's token count; a
            # long prompt takes seconds, so off the event loop
            n_prompt = len(p) if isinstance(p, list) else len(
                await asyncio.to_thread(self.engine.tokenizer.encode, p, add_special_tokens=False))
            if n_prompt == 0:
                raise BadRequest("the prompt is empty", param="prompt")
            room = self.engine.info.context_len - n_prompt
            most = room if max_tokens is None else max_tokens  # as vLLM: up to the end of the context
            if most > room or room < 1 and most > 0:
                raise BadRequest(f"the prompt's {n_prompt} tokens and max_tokens={most} exceed the model's context "
                                 f"of {self.engine.info.context_len} tokens", param="max_tokens",
                                 code="context_length_exceeded")
            given = ["--prompt", p] if isinstance(p, str) else ["--prompt-ids", ",".join(map(str, p))]
            for j in range(n):  # choice j of every prompt draws from seed + j: as n requests seeded so
                args = [*given, "--max-tokens", str(most), "--temperature", repr(temperature), "--top-p", repr(top_p),
                        "--top-k", str(max(req.top_k or 0, 0)), "--min-p", repr(req.min_p or 0.0),
                        "--seed", str((seed + j) % 2**64), *extra]
                plans.append(Plan(inferlet, args, n_prompt, stops, i, j, logprobs, p))
        return plans

    def check_prompt_ids(self, ids: list[int]) -> None:
        vocab = self.engine.info.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        if len(ids) > self.engine.info.context_len:
            raise BadRequest(f"the prompt's {len(ids)} tokens cannot fit the model's context of "
                             f"{self.engine.info.context_len} tokens", param="prompt", code="context_length_exceeded")

    async def echoes(self, request: Request, plans: list[Plan], top: int | None) -> list[Echo]:
        """Each choice's echoed prompt: its text and, with `top`, its tokens' logprobs (one prompt
        pass per distinct prompt, in a slot of its own, its pages counted against the key's quota)."""
        by_prompt: dict[int, Echo] = {}
        for plan in plans:
            if plan.prompt_index in by_prompt:
                continue
            p = plan.prompt
            ids = p if isinstance(p, list) else await asyncio.to_thread(self.engine.tokenizer.encode, p,
                                                                         add_special_tokens=False)
            scored = None
            if top is not None:
                owner, _ = await self.admit(request)
                try:
                    scored = await asyncio.to_thread(score_tokens, self.engine, self.runtime.scheduler, ids, top,
                                                     self.instances.key_quota(owner), cache_namespace(owner))
                finally:
                    self.admission.release(owner)
            by_prompt[plan.prompt_index] = Echo.of(p, ids, scored, self.engine.tokenizer)
        return [by_prompt[plan.prompt_index] for plan in plans]

    async def start(self, request: Request, plan: Plan) -> Generation:
        """Start one choice's inferlet once admission gives it a slot."""
        owner, arrived = await self.admit(request)
        gen = Generation(self.instances, plan.inferlet, plan.args, plan.prompt_tokens, plan.stops, owner,
                         arrived, plan.logprobs)  # a failed start frees its slot
        self.metrics.started(plan.inferlet.metric_label, plan.prompt_tokens)
        return gen


@dataclass(frozen=True)
class Plan:
    """One choice of a request, checked and ready to start."""

    inferlet: Inferlet
    args: list[str]
    prompt_tokens: int
    stops: list[str]
    prompt_index: int  # which prompt of a batch
    sample: int  # which of its n
    logprobs: int | None = None  # each token's logprob with this many alternatives; None: none
    prompt: str | list[int] = ""  # as the request gave it (text, or token ids)


def _message(m: ChatMessage, native: bool) -> dict:
    """One message as the template takes it. "developer" is OpenAI's newer name for the system
    role; templates know "system"."""
    role = "system" if m.role == "developer" else m.role
    if not m.tool_calls:
        return {"role": role, "content": m.text()}
    if not native:  # the calls as the model writes them, after any text of the turn
        return {"role": role, "content": "\n".join(filter(None, [m.text(), tools.render_calls(m.tool_calls)]))}
    calls = [{"type": "function", "id": c.id, "function": {"name": c.function.name,
                                                             "arguments": json.loads(c.function.arguments)}}
             for c in m.tool_calls]
    return {"role": role, "content": m.text(), "tool_calls": calls}


def _longest_token_bytes(tokenizer, default: int) -> int:
    """An upper bound on the UTF-8 bytes one token covers: the longest vocabulary entry (byte-level
    and SentencePiece entries are at least as long in UTF-8 as the text they stand for)."""
    try:
        vocab = tokenizer.get_vocab()
        return max(len(k.encode("utf-8", "surrogatepass")) for k in vocab) if vocab else default
    except Exception:  # no vocabulary to read (a test tokenizer): the declared bound
        return default


def owner_of(request: Request) -> str | None:
    """Who sent the request: its API key's id (set by the ApiKeys middleware), None without keys."""
    return request.scope.get("state", {}).get("owner")


async def client_gone(request: Request) -> None:
    """Returns once the client has closed its connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a server that answers at once with empty bodies: do not spin
