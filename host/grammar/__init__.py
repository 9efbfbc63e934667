"""Grammars on the host: JSON Schema, regex and Lark grammars compiled by llguidance, and the
per-sequence matchers that constrain generation (WIT `grammars`, the epilogue's grammar ops)."""

from .matcher import Grammar, GrammarError, Grammars, Kind, Matcher

__all__ = ["Grammar", "GrammarError", "Grammars", "Kind", "Matcher"]
