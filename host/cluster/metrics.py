"""The deployment's /metrics: every replica's own series under the same names, each with a
`replica` label (the deployment's totals are their sums: `sum without (replica)`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Merged:
    def __init__(self, texts: dict[str, bytes]):
        self.texts = texts

    def collect(self):
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for fam in text_string_to_metric_families(text.decode()):
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
        yield from families.values()


def merge(texts: dict[str, bytes]) -> bytes:
    """One exposition of several replicas' (replica id -> its /metrics text)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts))
    return generate_latest(registry)
