import wit_world
from wit_world.imports import host


class WitWorld(wit_world.WitWorld):
    def run(self) -> None:
        host.shout("hello")
