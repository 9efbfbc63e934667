"""`pie serve`: the host as a long-running daemon with an OpenAI-compatible HTTP API.

One engine and one Runtime serve every request; each request runs one inferlet instance
(text-completion by default), so the engine batches concurrent requests' passes together.
The inferlet API (inferlet_routes.py) uploads, launches, attaches to and cancels any inferlet
in the same runtime and the same instance slots.
"""
