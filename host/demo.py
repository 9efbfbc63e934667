"""`make demo`: one prompt through plain decoding and through speculative decoding, side by side.

Both run as WebAssembly inferlets on the default model; the texts must be identical, and the
figures show what speculation bought.
"""

from __future__ import annotations

import argparse
import sys

from . import store
from .errors import PieError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)

    from .paths import resolve_inferlet
    from .runtime.runtime import Runtime

    try:
        engine = store.open_engine(args.model)
        plain, spec = resolve_inferlet("text-completion"), resolve_inferlet("cacheback-speculative-decoding")
    except PieError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    common = ["--prompt", args.prompt, "--chat", "--max-tokens", str(args.max_tokens)]
    rec = store.read_record(engine.info.name)
    print(f"model {engine.info.name}: weights {rec.format_summary()}, {rec.bytes / 1e6:.0f} MB; computing in "
          f"{engine.info.dtype} on {engine.info.device}; prompt: {args.prompt!r}\n")
    results = {}
    with Runtime(engine) as rt:
        for name, wasm in (("text-completion", plain), ("cacheback-speculative-decoding", spec)):
            rt.run(wasm, ["--prompt", "Hi", "--chat", "--max-tokens", "2"], name=name)  # warm the component cache
            print(f"--- {name} " + "-" * (60 - len(name)))
            res = rt.run(wasm, common, name=name, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
            print()
            if not res.ok:
                print(f"demo: {name} failed: {res.error}", file=sys.stderr)
                return 1
            results[name] = res
    a, b = results["text-completion"], results["cacheback-speculative-decoding"]
    sa, sb = a.stats, b.stats
    print("-" * 64)
    print(f"identical tokens: {a.token_ids == b.token_ids} ({len(b.token_ids)} tokens)")
    print(f"text-completion: {sa['tokens_per_s']:.1f} tok/s, {sa['passes']} target passes")
    print(f"cacheback:       {sb['tokens_per_s']:.1f} tok/s, {sb['passes']} target passes, "
          f"{sb['mean_accepted_per_pass']:.2f} tokens per pass, {sb['accepted_tokens']}/{sb['drafted_tokens']} drafts accepted")
    print(f"speedup: {sb['tokens_per_s'] / sa['tokens_per_s']:.2f}x")
    return 0 if a.token_ids == b.token_ids else 1


if __name__ == "__main__":
    sys.exit(main())
