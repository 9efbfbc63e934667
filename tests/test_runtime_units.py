"""Runtime pieces that need neither a model nor a built inferlet: channels, sampler, cache checks, CLI."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from host.errors import InvalidArgument
from host.runtime.cache import check_header
from host.runtime.channels import Channel
from host.runtime.errors import ChannelClosed, ChannelFull, InferletError
from host.runtime.sampling import Sampler, argmax


def test_channel_put_read_take():
    ch = Channel("uint32", 4, torch.device("cpu"))
    ch.put([1, 2])
    ch.put_tensor(torch.tensor([3]))
    assert len(ch) == 3 and ch.read(1, 2) == [2, 3]
    assert ch.buf[:ch.length].tolist() == [1, 2, 3]
    with pytest.raises(ChannelFull):
        ch.put([4, 5])
    with pytest.raises(InvalidArgument):
        ch.read(2, 2)
    with pytest.raises(InvalidArgument):
        ch.put([-1])
    assert ch.take() == [1, 2, 3] and len(ch) == 0
    assert ch.take() == []  # no producer attached: returns at once
    ch.close()
    with pytest.raises(ChannelClosed):
        ch.put([1])


def test_channel_take_waits_for_an_attached_producer():
    ch = Channel("float32", 8, torch.device("cpu"))
    ch.attach_producer()

    def produce():
        time.sleep(0.05)
        ch.put([0.5, 1.5])
        ch.detach_producer()

    threading.Thread(target=produce).start()
    assert ch.take() == [0.5, 1.5]


def test_channel_rejects_bad_shapes():
    with pytest.raises(InvalidArgument):
        Channel("uint32", 0, torch.device("cpu"))
    with pytest.raises(InvalidArgument):
        Channel("float64", 4, torch.device("cpu"))


def test_sampler_is_seeded_and_respects_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    a = Sampler(1.0, 1.0, 7)
    b = Sampler(1.0, 1.0, 7)
    draws = [a.sample(logits, pos)[0] for pos in range(50)]
    assert draws == [b.sample(logits, pos)[0] for pos in range(50)]  # keyed by (seed, position)
    assert len(set(draws)) > 1 and draws != [Sampler(1.0, 1.0, 8).sample(logits, pos)[0] for pos in range(50)]
    nucleus = Sampler(1.0, 0.5, 3)  # token 0 alone holds > 50% of the mass
    assert {nucleus.sample(logits, pos)[0] for pos in range(50)} == {0}
    assert Sampler(0.0, 1.0, 0).sample(logits, 0) == argmax(logits) == [0]
    with pytest.raises(InvalidArgument):
        Sampler(-1.0, 1.0, 0)
    with pytest.raises(InvalidArgument):
        Sampler(1.0, 0.0, 0)


def test_component_header_checks():
    with pytest.raises(InferletError, match="not a WebAssembly file"):
        check_header(b"hello world")
    with pytest.raises(InferletError, match="core WebAssembly module"):
        check_header(b"\0asm\x01\0\0\0")
    check_header(b"\0asm\x0d\0\x01\0")  # a component header passes


def test_pie_run_argument_split():
    import argparse

    from host.cli.run import add_run_parser, _split_rest

    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["run", "text-completion", "--json", "--model", "m", "--", "--prompt", "hi", "--chat"])
    assert _split_rest(args) == ["--prompt", "hi", "--chat"]
    assert args.json and args.model == "m" and args.inferlet == "text-completion"
    # options before the name: argparse eats the `--`; the inferlet's arguments still get through
    early = parser.parse_args(["run", "--json", "x", "--", "--prompt", "hi", "--max-tokens", "3"])
    assert _split_rest(early) == ["--prompt", "hi", "--max-tokens", "3"] and early.json


def test_error_codes_are_declared_once_and_match_the_wit():
    """Each PieError class declares its code; the codes a guest is told are the WIT's enum,
    and every case of that enum has its class."""
    import importlib
    import pkgutil

    import host
    from host.errors import PieError

    for mod in pkgutil.walk_packages(host.__path__, "host."):  # every error class the host declares
        if not mod.name.endswith("__main__"):
            importlib.import_module(mod.name)
    from host.runtime.bindings import WIT_ERROR_CODES
    from host.runtime.imports import error_codes

    def subclasses(c):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)

    codes = {c.code: c for c in subclasses(PieError)}
    assert set(error_codes()) <= set(codes), "a WIT error code without its PieError class"
    host_only = {c for c in codes if c not in error_codes()}
    # errors of the host's own commands and of a run as a whole, never returned to a guest
    # (and "server": pie run --server's client, for a daemon that refused or could not be reached)
    assert host_only == {"model-not-found", "import-failed", "inferlet-failed", "cancelled", "server"}, host_only
    assert WIT_ERROR_CODES == set(error_codes())


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_the_sampler_draws_what_a_traced_sample_draws(temperature, top_p):
    """One sampling rule: the host's Sampler (a guest-driven decode) and the epilogue's traced
    p.sample (a device loop) give the same token for the same seed and position."""
    from guest import trace
    from host.epilogue import Env, SimpleChannel, compile_program

    p = trace.Program(readout=1)
    p.channel("out", "i64", 1)
    p.put("out", p.sample(p.logits(), temperature=temperature, top_p=top_p if top_p < 1 else None))
    prog = compile_program(p.to_json())
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        logits = torch.randn(1, 300, generator=g) * 3
        seed, position = 11 + trial % 3, 5 * trial
        out = SimpleChannel.empty(1)
        prog.run([Env(logits=logits.clone(), channels={"out": out}, seed=seed, position=position)])
        assert out.buf.tolist() == Sampler(temperature, top_p, seed).sample(logits, position), trial


def test_wasmtime_lowering_keeps_one_case_set_per_thread():
    """wasmtime-py's lowering picks a result's case through a module-global set; the bindings give
    each thread its own (wasmtime_internals), so instances returning at once cannot read each other's classes."""
    import threading

    import host.runtime.bindings  # noqa: F401  (installs the repair)
    from wasmtime.component import _types

    cache = _types.case_test_cache
    cache.clear()
    cache.add(int)
    seen = []
    t = threading.Thread(target=lambda: (cache.clear(), cache.add(str), seen.append(set(cache))))
    t.start()
    t.join()
    assert seen == [{str}] and set(cache) == {int}
