"""text-completion: plain autoregressive decoding, streaming text as it goes.

One prefill pass over the prompt, then one pass per token; each step is two crossings
(execute with a host-side argmax/sample readout, then emit).
"""

import wit_world
from componentize_py_types import Err
from inferlet import Model, ForwardPass, PieError, Sampler, UsageError, arguments, emit, parse_generation_args


def generate(args) -> None:
    model = Model()
    text = model.chat_prompt([("user", args.prompt)]) if args.chat else args.prompt
    prompt = model.encode(text)
    if not prompt:
        raise UsageError("the prompt is empty; pass --prompt TEXT")
    if args.max_tokens == 0:
        return
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    ws = model.working_set()
    eos = set(model.eos_ids)
    window = prompt
    for _ in range(args.max_tokens):
        token = ForwardPass(ws, window).next_token(sampler)
        emit([token])
        if token in eos:
            break
        window = [token]
    ws.release()
    sampler.release()


class WitWorld(wit_world.WitWorld):
    def run(self) -> None:
        try:
            generate(parse_generation_args(arguments()))
        except (PieError, UsageError) as e:
            raise Err(str(e))
