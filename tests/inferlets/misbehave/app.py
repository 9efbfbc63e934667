"""A test inferlet that misbehaves (or exercises a primitive) according to --mode."""

import wit_world
from componentize_py_types import Err
from inferlet import (Channel, Epilogue, ForwardPass, Model, PieError, StateGeometry, arguments, emit_channel,
                      send)
from inferlet.trace import Program
from wit_world.imports import working_sets as _ws


def run(mode: str) -> None:
    model = Model()
    if mode == "loop":
        n = 0
        while True:
            n += 1
    if mode == "sleep":  # asleep on the WASI clock, then a little work: not CPU time
        import time

        time.sleep(1.5)
        send("slept")
        return
    if mode == "alloc":
        hoard = []
        while True:
            hoard.append(bytearray(1 << 20))
    if mode == "sandbox":  # what the guest can see of the host: nothing
        import os

        seen = []
        for probe in (lambda: open("/etc/passwd").read(1), lambda: os.listdir("/"), lambda: os.listdir(".")):
            try:
                probe()
                seen.append("open")
            except OSError:
                seen.append("denied")
        seen.append(str(len(os.environ)))
        try:
            import socket

            socket.create_connection(("127.0.0.1", 80), timeout=1)
            seen.append("connected")
        except Exception:
            seen.append("no-network")
        print("hello from the guest")
        send(" ".join(seen))
        return
    if mode == "trap":
        raise RuntimeError("deliberate guest exception")
    ws = model.working_set()
    if mode == "dropped":
        ws.release()
        ForwardPass(ws, [1, 2, 3]).execute()
    if mode == "raw-handle":  # a handle that never existed, straight through the bindings
        _ws.frozen_length(987654)
    if mode == "oov":
        ForwardPass(ws, [model.vocab_size + 5]).execute()
    if mode == "window":
        ForwardPass(ws, [1] * (model.context_length + 1)).execute()
    if mode == "fold":
        ForwardPass(ws, [1, 2], StateGeometry(2, 3)).execute()
    if mode == "epilogue":
        model.register_epilogue('{"version": 1, "inputs": [{"kind": "logits"}], '
                                '"ops": [{"op": "frobnicate", "args": [0]}]}', {})
    if mode == "epilogue-handle":
        ForwardPass(ws, [1], StateGeometry(1, "epilogue"), epilogue=Epilogue(7)).execute()
    if mode in ("loop-dims", "loop-emit-negative"):  # a device loop whose epilogue fails
        out, window = Channel("u32", 64), Channel("u32", 1)
        window.put([1])
        p = Program(readout=1, vocab=7 if mode == "loop-dims" else None)  # loop-dims: not the model's
        p.channel("out", "i64", 64)
        p.channel("window", "i64", 1)
        tok = p.logits().argmax()
        p.set("window", tok)
        if mode == "loop-emit-negative":  # -1 from the fourth round on, into a channel the host decodes
            tok = p.where(p.round() < 3, tok, -1)
        p.put("out", tok)
        emit_channel(out)
        ep = model.register_epilogue(p.to_json(), {"out": out, "window": window})
        ForwardPass(ws, window, StateGeometry(1), readout=[0], epilogue=ep).run_loop(40)
        while out.take():
            pass
        return
    if mode == "print":  # guest stdout without end
        line = "x" * 1023
        while True:
            print(line)
    if mode == "endless-loop":  # a device loop of 2^32-1 rounds; the guest waits on a channel it never fills
        quiet, window = Channel("u32", 1), Channel("u32", 1)
        window.put([1])
        p = Program(readout=1)
        p.channel("quiet", "i64", 1)
        p.channel("window", "i64", 1)
        p.set("window", p.logits().argmax())
        ep = model.register_epilogue(p.to_json(), {"quiet": quiet, "window": window})
        # fold 0: the row is scratch each round, so the loop holds one page however long it runs
        ForwardPass(ws, window, StateGeometry(1, 0), readout=[0], epilogue=ep).run_loop((1 << 32) - 1)
        send("looping")
        quiet.take()
        return
    if mode == "channels":
        ch = Channel("u32", 8)
        ch.put([5, 6, 7])
        first = ch.read(0, 2)
        n = len(ch)
        taken = ch.take()
        after = len(ch)
        try:
            ch.put(list(range(9)))
            full = "no"
        except PieError as e:
            full = e.code
        f = Channel("f32", 2)
        f.put([0.5])
        b = Channel("bool", 2)
        b.put([True, False])
        ch.close()
        try:
            ch.put([1])
            closed = "no"
        except PieError as e:
            closed = e.code
        send(f"{first} {n} {taken} {after} {full} {f.take()} {b.read()} {closed}")
        return
    if mode == "working-sets":
        prompt = model.encode("The quick brown fox jumps over the lazy dog")
        ForwardPass(ws, prompt).execute()
        child = ws.fork()
        ForwardPass(child, [13]).execute()
        a = (ws.frozen, child.frozen, child.tokens()[-1])
        child.truncate(3)
        ws.evict(1, 3)
        b = (child.frozen, ws.frozen, ws.tokens()[:2] == [prompt[0], prompt[3]])
        try:
            ws.truncate(999)
            bad = "no"
        except PieError as e:
            bad = e.code
        send(f"{a} {b} {bad}")
        return
    raise ValueError(f"unknown mode {mode}")


class WitWorld(wit_world.WitWorld):
    def run(self) -> None:
        args = arguments()
        try:
            run(args[args.index("--mode") + 1])
        except PieError as e:
            raise Err(str(e))
        except Err as e:  # a raw binding call's typed error
            raise Err(f"{e.value.code.name}: {e.value.message}")
