"""`make bench`: the speculative-decoding benchmark over every dev prompt (see bench/spec.py)."""

from . import spec

if __name__ == "__main__":
    spec.main()
