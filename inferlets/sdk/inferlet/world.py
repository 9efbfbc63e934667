"""The world's `run`, written once for every generation inferlet.

An app.py exports the class componentize-py looks for with

    WitWorld = generation_world(generate, {"--draft-len": (6, int)})

`generate(args)` gets the parsed standard arguments (args.py) plus the inferlet's own; a
usage error or a host error ends the run with its message as the run's error result.
"""

import wit_world
from componentize_py_types import Err

from .api import PieError, arguments
from .args import UsageError, parse_generation_args


def generation_world(generate, extra: dict = None) -> type:
    class WitWorld(wit_world.WitWorld):
        def run(self) -> None:
            try:
                generate(parse_generation_args(arguments(), extra))
            except (PieError, UsageError) as e:
                raise Err(str(e))

    return WitWorld
