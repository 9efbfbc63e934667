"""Where a speculative round's time goes: the target's pass, the draft head's steps, the rest.

    python -m bench.round_split [--model NAME] [--per-category 1] [--new-tokens 128] [--repeats 2]
                                [--min-prob P,...] [--draft-len K]

Runs text-completion, mtp-speculative-decoding and the hybrid (cacheback --drafter) greedy on
dev prompts (chat template) through the real runtime and engine, on a model with a head attached
(`pie model import ... --drafter`), and times, per run, the calls a round makes:

- target pass: `Engine.run` (the decoder over the window's rows, the lm_head over its readout);
- head catch-up: the head's block over the rows the round committed (`HeadRunner._catch_up`);
- head steps: each chained draft's block step (`HeadRunner._run` past the first draft);
- head readout: the head's projection onto its draft vocabulary, one per draft;
- head other: the rest of `HeadRunner.propose` (argmax, the chain's bookkeeping);
- epilogue other: the rest of the epilogue (`CompiledProgram.run`: compare, fold, next window);
- host and guest: the rest of the run's wall time (scheduling, page bookkeeping, WebAssembly).

Each is reported in milliseconds per round (a round: one target pass after the prompt's, and
what follows it up to the next), with tokens committed per round and milliseconds per token; the
prompt's pass and its epilogue are left out. A prompt's run with the fastest rounds of --repeats
counts; the median over prompts is reported. Writes JSON, a table and a stacked-bar chart to results/.
"mtp" and "hybrid" run the inferlets' defaults, the confidence stop at cacheback.HEAD_MIN_PROB
(0.2) included; --min-prob adds MTP and the hybrid with the stop at each P (`--min-prob P`; 0: no
stop), MTP with --draft-len K where given (a stopped chain can afford a longer one).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict

from .common import RESULTS, head_engine, load_prompts, machine, per_category, table, write

CONTENDERS = [("text-completion", "text-completion", []),
              ("mtp", "mtp-speculative-decoding", []),
              ("hybrid", "cacheback-speculative-decoding", ["--drafter", "{drafter}"])]
PARTS = ["target pass", "head catch-up", "head steps", "head readout", "head other", "epilogue other",
         "host and guest"]


class Clocks:
    """Wall time inside each wrapped call, summed by name while a run is timed, the rounds apart
    from the prompt's: a call that starts before the run's second target pass belongs to the
    prompt pass (its round: the prefill and, for a head, the catch-up over the whole prompt)."""

    def __init__(self):
        self.spent: dict[str, float] = defaultdict(float)
        self.passes = 0  # target passes of this run
        self.rounds_from = 0.0  # perf_counter when the second began
        self._undo: list = []

    def reset(self) -> None:
        self.spent.clear()
        self.passes, self.rounds_from = 0, 0.0

    def wrap(self, obj, attr: str, name, counts_pass: bool = False) -> None:
        """obj.attr timed under `name` (or name(args, kwargs) -> the name, None for not counted)."""
        real = getattr(obj, attr)
        clocks = self

        def timed(*a, **k):
            t0 = time.perf_counter()
            if counts_pass:
                clocks.passes += 1
                if clocks.passes == 2:
                    clocks.rounds_from = t0
            in_rounds = clocks.passes >= 2
            try:
                return real(*a, **k)
            finally:
                label = name(a, k) if callable(name) else name
                if label is not None and in_rounds:
                    clocks.spent[label] += time.perf_counter() - t0
        setattr(obj, attr, timed)
        self._undo.append((obj, attr, real))

    def close(self) -> None:
        for obj, attr, real in reversed(self._undo):
            setattr(obj, attr, real)


def instrument(engine) -> Clocks:
    from host.engine.drafting import HeadRunner
    from host.engine.engine import Engine
    from host.epilogue.compile import CompiledProgram

    c = Clocks()
    c.wrap(Engine, "run", "target pass", counts_pass=True)
    c.wrap(CompiledProgram, "run", "epilogue")
    c.wrap(HeadRunner, "propose", "propose")
    c.wrap(HeadRunner, "_catch_up", "head catch-up")
    c.wrap(HeadRunner, "_run", lambda a, k: None if k.get("target") else "head steps")
    for runner in engine.heads.values():
        c.wrap(runner, "_out", "head readout")  # an instance attribute: the head's Readout
    return c


def split(spent: dict[str, float], wall: float) -> dict[str, float]:
    """The wrapped calls' times (nested ones inside others) as PARTS that add up to `wall`."""
    head = spent["head catch-up"] + spent["head steps"] + spent["head readout"]
    out = {p: spent[p] for p in ("target pass", "head catch-up", "head steps", "head readout")}
    out["head other"] = spent["propose"] - head
    out["epilogue other"] = spent["epilogue"] - spent["propose"]
    out["host and guest"] = wall - spent["target pass"] - spent["epilogue"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model with a draft head attached (default: the default model)")
    ap.add_argument("--per-category", type=int, default=1, help="the first N dev prompts of each category")
    ap.add_argument("--prompts", type=int, default=None, help="only the first N of those")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--min-prob", default="", help="comma-separated confidence stops to add MTP and hybrid runs at")
    ap.add_argument("--draft-len", type=int, default=None, help="the stopped MTP runs' --draft-len")
    args = ap.parse_args(argv)
    k = [] if args.draft_len is None else ["--draft-len", str(args.draft_len)]
    contenders = CONTENDERS + [(f"{label} p={p}" + (f" k={args.draft_len}" if k and label == "mtp" else ""),
                                inferlet, [*extra, *(k if label == "mtp" else []), "--min-prob", p])
                               for p in filter(None, args.min_prob.split(","))
                               for label, inferlet, extra in CONTENDERS[1:]]

    from host.paths import resolve_inferlet
    from host.runtime.runtime import Runtime

    engine, drafter = head_engine(args.model)
    rows = per_category(load_prompts(), args.per_category)[:args.prompts]
    clocks = instrument(engine)
    per = []
    try:
        with Runtime(engine) as rt:
            def run(inferlet, extra, prompt, n):
                clocks.reset()
                res = rt.run(resolve_inferlet(inferlet), ["--prompt", prompt, "--chat", "--max-tokens", str(n),
                                                          *[a.format(drafter=drafter) for a in extra]],
                             name=inferlet, prefix_caching=False)
                if not res.ok:
                    raise SystemExit(f"{inferlet} failed: {res.error}")
                # the rounds after the prompt's: their wall time, their count, the tokens they committed
                wall = time.perf_counter() - clocks.rounds_from
                return res, defaultdict(float, clocks.spent), wall, clocks.passes - 1

            for _, inferlet, extra in contenders:  # warm-up: compile components, touch the model
                run(inferlet, extra, "Hello", 4)
            for r in rows:
                rec = {"id": r["id"], "category": r["category"]}
                for label, inferlet, extra in contenders:
                    best = None
                    for _ in range(args.repeats):
                        res, spent, wall, rounds = run(inferlet, extra, r["prompt"], args.new_tokens)
                        if best is None or wall / rounds < best["wall_s"] / best["rounds"]:
                            best = {"wall_s": wall, "rounds": rounds, "tokens": len(res.token_ids) - 1,
                                    "ms_per_round": {p: 1e3 * v / rounds for p, v in split(spent, wall).items()},
                                    "token_ids": res.token_ids}
                    rec[label] = best
                ref = rec["text-completion"]["token_ids"]
                for label, _, _ in contenders:
                    rec[label]["same"] = rec[label].pop("token_ids") == ref
                per.append(rec)
                print(f"prompt {r['id']} ({r['category']}): " + ", ".join(
                    f"{lb} {1e3 * rec[lb]['wall_s'] / rec[lb]['rounds']:.2f} ms/round" for lb, _, _ in contenders),
                      flush=True)
    finally:
        clocks.close()

    summary = {}
    for label, _, _ in contenders:
        got = [x[label] for x in per]
        parts = {p: statistics.median(g["ms_per_round"][p] for g in got) for p in PARTS}
        summary[label] = {"ms_per_round": parts,
                          "round_ms": statistics.median(1e3 * g["wall_s"] / g["rounds"] for g in got),
                          "tokens_per_round": statistics.median(g["tokens"] / g["rounds"] for g in got),
                          "ms_per_token": statistics.median(1e3 * g["wall_s"] / g["tokens"] for g in got),
                          "identical_to_text_completion": all(g["same"] for g in got)}
    result = {"benchmark": "round_split", "model": engine.info.name, "drafter": drafter, "dtype": engine.info.dtype,
              "device": engine.info.device, "prompts": [r["id"] for r in rows], "new_tokens": args.new_tokens,
              "repeats": args.repeats, "machine": machine(), "summary": summary, "per_prompt": per}
    base = summary["text-completion"]["round_ms"]
    md = (f"A round's time by part (ms per round, median over prompts of each prompt's fastest of {args.repeats} "
          f"runs), {engine.info.name} with {drafter}, {engine.info.dtype} on {engine.info.device}; dev prompts "
          f"{result['prompts']}, chat template, {args.new_tokens} new tokens, greedy, no prefix cache.\n\n"
          + table(["contender", *PARTS, "round", "round / plain", "tokens a round", "ms a token", "same tokens"],
                  [[lb, *(summary[lb]["ms_per_round"][p] for p in PARTS), summary[lb]["round_ms"],
                    summary[lb]["round_ms"] / base, summary[lb]["tokens_per_round"], summary[lb]["ms_per_token"],
                    summary[lb]["identical_to_text_completion"]] for lb, _, _ in contenders]))
    path = write("round_split", result, md)
    chart(summary)
    print(md)
    print(f"\nwrote {path} and results/round_split.png")
    return result


def chart(summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(summary)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(labels)), 4.5))
    bottom = [0.0] * len(labels)
    for p in PARTS:
        vals = [max(summary[lb]["ms_per_round"][p], 0.0) for lb in labels]
        ax.bar(labels, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per round (median)")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with contextlib.suppress(OSError):
        RESULTS.mkdir(exist_ok=True)
    fig.savefig(RESULTS / "round_split.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
