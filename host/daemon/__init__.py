"""`pie serve`: the host as a long-running daemon with an OpenAI-compatible HTTP API.

One engine and one Runtime serve every request; each request runs one inferlet instance
(--default-inferlet, or the one its `inferlet` field names), so the engine batches concurrent
requests' passes together. The inferlet API (inferlet_routes.py) uploads, launches, attaches to
and cancels any inferlet in the same runtime; admission.py gives every instance its slot
(--max-instances), queues past them (--max-queue) and bounds each key (--max-instances-per-key).
"""
