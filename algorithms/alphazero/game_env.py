"""The environment of an AlphaZero run: a two-player board game, which each rank that plays
it loads (``games.load_game``), in place of a gymnasium env."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
from mpirl.algorithms.alphazero.games import OPENSPIEL_PREFIX, Game, game_spaces, load_game

from mpirl.errors import ConfigError, MissingPackage
from mpirl.workers.env_spec import EnvSpec


@dataclass(frozen=True)
class GameEnvSpec(EnvSpec):
    """A two-player board game for search (``games``): ``openspiel/<name>`` or a
    PettingZoo classic module, which ``load_game`` loads on every rank that plays it. Its
    ``spaces()`` are ``game_spaces``': positions and actions, for the model spec."""

    def is_multi_agent(self) -> bool:
        return False  # both players are the one network, in self-play

    def game(self) -> Game:
        self._import_env_module()
        return load_game(self.env_id, self.env_config)

    def make(self) -> gym.Env:
        raise ConfigError(f"{self.env_id!r} is a game for search, not a gymnasium env")

    def check(self) -> None:
        self.spaces()
        return None

    def spaces(self) -> tuple[gym.Space, gym.Space]:
        cached = self.__dict__.get("_spaces")
        if cached is None:
            cached = game_spaces(self.game())
            object.__setattr__(self, "_spaces", cached)
        return cached


def game_env_spec(env_id: str, env_module: str | None, config: Any) -> GameEnvSpec:
    """The GameEnvSpec of a run with ``config`` (AlphaZero's) on ``env_id``, the module's
    ``env_spec``; ConfigError, naming what ids it takes, when ``env_id`` is no game that search
    can play."""
    spec = GameEnvSpec(env_id, env_module, dict(config.env_config or {}))
    try:
        spec.check()
    except MissingPackage:
        raise
    except ConfigError as error:
        raise ConfigError(f"AlphaZero plays two-player board games: --env must be "
                          f"{OPENSPIEL_PREFIX}<name> (OpenSpiel) or a PettingZoo classic module "
                          f"(pettingzoo.classic.tictactoe_v3), and {env_id!r} is not one that "
                          f"search can play: {error}") from None
    return spec
