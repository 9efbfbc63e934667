"""Running a traced speculative program (cacheback, constrained) as one device loop."""

from .api import Channel, ForwardPass, StateGeometry, emit_channel


def head_prompt_pass(model, ws, prompt, program, window, seed):
    """A draft head's prompt pass (`mtp.mtp_prefill_program`): the whole prompt, readout on every
    row, all but its last token folded; the epilogue runs the head over the prompt and writes the
    first window into channel `window`."""
    ep = model.register_epilogue(program, {"window": window})
    m = len(prompt)
    ForwardPass(ws, prompt, geometry=StateGeometry(m, fold=m - 1), readout=list(range(m)), epilogue=ep,
                seed=seed).execute()
    ep.release()


def run_window_loop(model, ws, program, specs, draft_len, max_tokens, seed, bind=None, prefill=None):
    """Create the program's channels from its specs ({name, capacity, init}; i32: the cells use -1
    as "none"), have the host stream "out", register the program, let bind(epilogue) bind what
    else it uses, and loop a pass whose window is channel "window" (readout on every row, the fold
    from the program) until the program stops. The guest only waits: no call per round. Then the
    epilogue and the channels are released. prefill(channels), if given, runs after the channels
    are made and before the loop (a prompt pass whose epilogue writes the first window)."""
    chans = {}
    for spec in specs:
        ch = Channel("i32", spec["capacity"])
        if spec["init"]:
            ch.put(spec["init"])
        chans[spec["name"]] = ch
    if prefill is not None:
        prefill(chans)
    emit_channel(chans["out"])  # the host streams what the loop commits
    ep = model.register_epilogue(program, chans)
    if bind is not None:
        bind(ep)
    ForwardPass(ws, chans["window"], geometry=StateGeometry(draft_len + 1, fold="epilogue"),
                readout=list(range(draft_len + 1)), epilogue=ep, seed=seed).run_loop(max_tokens)
    while chans["out"].take():  # the host emits; this only waits for the loop ([] once it has ended)
        pass
    ep.release()
    for ch in chans.values():
        ch.release()
