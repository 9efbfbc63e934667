"""What one client may cost `pie serve` before any instance runs: every limit declared once, here.

`pie serve`'s flags and the daemon table in SECURITY.md derive from the field metadata
(`python -m host.daemon.limits` prints the table). A field without a flag is fixed. Each
instance's own limits are host/runtime/limits.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..errors import InvalidArgument


def _limit(default, what: str, flag: str | None = None, unit: int = 1, kind=int):
    return field(default=default, metadata={"what": what, "flag": flag, "unit": unit, "kind": kind})


@dataclass(frozen=True)
class ServeLimits:
    body_bytes: int = _limit(8 << 20, "a JSON request body (all routes but the upload); past it 413",
                             "--max-body-mb", 1 << 20)
    upload_bytes: int = _limit(64 << 20, "an uploaded .wasm (POST /v1/inferlets); past it 413",
                               "--max-upload-mb", 1 << 20)
    # a prompt past context_len * (the tokenizer's longest vocabulary entry, in UTF-8 bytes) cannot
    # fit, so it is refused before tokenizing; this is the bound for a tokenizer without a vocabulary
    prompt_bytes_per_token: int = _limit(128, "UTF-8 bytes per context token a prompt may have before it is "
                                         "tokenized, for a tokenizer without a vocabulary (else its longest "
                                         "entry: 162 for smollm2); past it 400 context_length_exceeded at once")
    messages: int = _limit(2048, "messages of one chat completion (OpenAI's bound); past it 400")
    stops: int = _limit(4, "stop strings of one request (OpenAI's bound); past it 400")
    stop_chars: int = _limit(1024, "characters of one stop string; past it 400")
    schema_bytes: int = _limit(64 << 10, "a response_format JSON schema, as JSON text; past it 400")
    choices: int = _limit(128, "choices of one request: its prompts (a batched completion) times n, each an "
                          "instance; past it 400", "--max-choices")
    inferlet_args: int = _limit(256, "arguments of a launch or a completion's inferlet_args; past it 400")
    keep_alive_s: float = _limit(5.0, "an idle keep-alive connection's life", "--timeout-keep-alive", kind=float)
    header_timeout_s: float = _limit(10.0, "the time a connection has to send a request's headers, from "
                                     "connecting or from the previous response; past it the connection is closed",
                                     "--timeout-headers", kind=float)
    body_timeout_s: float = _limit(30.0, "the time a client has to send a JSON body once its headers came; past it 408",
                                   "--timeout-body", kind=float)
    header_bytes: int = _limit(16 << 10, "a request's line and headers; past it 431 (400 and the connection closed "
                               "while they arrive: uvicorn's h11_max_incomplete_event_size)",
                               "--max-header-kb", 1 << 10)
    loaded_components: int = _limit(16, "compiled components held in memory (least recently used dropped; the disk "
                                    "cache keeps 16)", "--max-loaded-components")
    uploads_per_key: int = _limit(64, "uploads one key stores (each content once, however named); past it 429",
                                  "--max-uploads-per-key")
    upload_storage_per_key: int = _limit(1 << 30, "the bytes of one key's stored uploads; past it 413",
                                         "--max-upload-storage-mb", 1 << 20)
    kv_share_per_key: float = _limit(0.5, "the most of the KV page pool one API key's instances hold together (each "
                                     "instance's --kv-share counts against it; only with --api-key-file); past it "
                                     "the pass fails with out-of-pages", "--kv-share-per-key", kind=float)
    requests: int = _limit(512, "requests being answered at once, streams included (not /health, /metrics); past "
                           "it 503 with Retry-After", "--limit-concurrency")
    connections: int = _limit(4096, "open connections, idle and half-sent ones included (each holds a file "
                              "descriptor until the header timeout); past it a new one is closed at once",
                              "--max-connections")

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not v > 0:
                raise InvalidArgument(f"{_name(f)} must be positive, not {v}")


def _name(f) -> str:
    return f.metadata["flag"] or f.name


def add_flags(parser) -> None:
    for f in fields(ServeLimits):
        m = f.metadata
        if m["flag"]:
            parser.add_argument(m["flag"], type=m["kind"], default=m["kind"](f.default / m["unit"]),
                                help=f"{m['what']} (default %(default)s)")


def from_args(args) -> ServeLimits:
    kw = {}
    for f in fields(ServeLimits):
        m = f.metadata
        if m["flag"]:
            kw[f.name] = m["kind"](getattr(args, m["flag"].lstrip("-").replace("-", "_")) * m["unit"])
    return ServeLimits(**kw)


def table() -> str:
    """The limits as a markdown table (SECURITY.md)."""
    rows = ["| limit | bounds | default | `pie serve` flag |", "|---|---|---|---|"]
    for f in fields(ServeLimits):
        m = f.metadata
        shown = m["kind"](f.default / m["unit"])
        rows.append(f"| `{f.name}` | {m['what']} | {shown} | {'`' + m['flag'] + '`' if m['flag'] else 'fixed'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
