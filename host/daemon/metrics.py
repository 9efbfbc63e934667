"""Prometheus metrics, named after vLLM's (`vllm:` -> `pie:`) where vLLM has one. Each server
has its own registry, so two servers in one process (the tests) count apart."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        self.model = model
        self.requests = Counter("pie:http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.running = Gauge("pie:num_requests_running", "Inferlet instances running",
                             ["model_name"], registry=self.registry).labels(model)
        self.prompt_tokens = Counter("pie:prompt_tokens", "Prompt tokens of the requests that started",
                                     ["model_name"], registry=self.registry).labels(model)
        self.generation_tokens = Counter("pie:generation_tokens", "Tokens generated",
                                         ["model_name"], registry=self.registry).labels(model)

    def render(self) -> bytes:
        return generate_latest(self.registry)
