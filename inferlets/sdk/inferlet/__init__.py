"""The guest SDK: a small Pythonic layer over the generated `wit_world` bindings.

Inferlets import from here, never from `wit_world` directly, so the bindings can change
shape without touching every inferlet. Pure Python: it runs inside the component.
"""

from .api import (Channel, Epilogue, ForwardPass, Grammar, Matcher, Model, PieError, Sampler, StateGeometry,
                  WorkingSet, arguments, emit, emit_channel, send)
from .args import GenerationArgs, UsageError, parse_generation_args

__all__ = ["Channel", "Epilogue", "ForwardPass", "GenerationArgs", "Grammar", "Matcher", "Model", "PieError", "Sampler", "StateGeometry",
           "UsageError", "WorkingSet", "arguments", "emit", "emit_channel", "parse_generation_args", "send"]
