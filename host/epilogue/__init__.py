"""Epilogue programs: the IR, its validator, and the batched torch executor."""

from host.epilogue.compile import CompiledProgram, compile_program, host_readable
from host.epilogue.env import ChannelWrite, DeviceChannel, DraftBinding, DraftRunner, Env, GrammarMatcher, Result, SimpleChannel, SuffixSource, apply_writes
from host.epilogue.ir import ProgramError

__all__ = ["CompiledProgram", "compile_program", "host_readable", "ChannelWrite", "DeviceChannel", "DraftBinding", "DraftRunner", "Env", "GrammarMatcher", "Result", "SimpleChannel", "SuffixSource",
           "apply_writes", "ProgramError"]
