"""`make bench`: the speculative-decoding benchmark over every dev prompt (bench/spec.py; BENCH_ARGS
go to it), then the constrained-decoding benchmark over every dev JSON schema (bench/constrained.py).
`make bench BENCH_ARGS="constrained --repeats 2"`: only the constrained one, with its arguments.
`make bench BENCH_ARGS="serve --quick"`: the serving benchmark instead (bench/serve.py)."""

import sys

from . import constrained, serve, spec

if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve.main(sys.argv[2:])
    elif sys.argv[1:2] == ["constrained"]:
        constrained.main(sys.argv[2:])
    else:
        spec.main()
        constrained.main([])
