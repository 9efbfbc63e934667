"""`pie serve`: the host as a long-running daemon with an OpenAI-compatible HTTP API.

One engine and one Runtime serve every request; each request runs one inferlet instance
(text-completion by default), so the engine batches concurrent requests' passes together.
"""
