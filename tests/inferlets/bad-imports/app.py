import wit_world
from wit_world.imports import runtime


class WitWorld(wit_world.WitWorld):
    def run(self) -> None:
        runtime.send(7)
