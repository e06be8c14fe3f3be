"""The actor-critic's forward pass in NumPy, for ranks that only act: no torch to import.

``NumpyPolicy(spec)`` takes the same flat float32 weight vector as the torch ``Policy`` built
from ``spec`` (``set_flat_weights``; the same parameter order) and gives the same actions,
log-probabilities and values (``act``), sampling with a NumPy generator of its own. It covers
the models most rollout ranks run: vector, Dict/Tuple-of-vector and Discrete observations through
MLP heads, with Discrete, MultiDiscrete, MultiBinary and Box actions. Anything else (images, an
LSTM, a custom model, a centralized critic) needs torch: ``numpy_unsupported`` says why.

Nothing here crosses ranks: the weights arrive as the torch policy's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np

from mpirl.models.spaces import action_layout, env_actions, has_image, head_sizes, is_image

__all__ = ["ACTIVATIONS"]

if TYPE_CHECKING:
    from mpirl.models.policy_spec import PolicySpec

ACTIVATIONS = {"tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0),
               "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))}
_LOG_SQRT_2PI = 0.5 * np.log(2.0 * np.pi)


def numpy_unsupported(spec: PolicySpec) -> str | None:
    """Why ``spec``'s policy needs torch to act, or None when ``NumpyPolicy`` can run it."""
    options = spec.model
    if options.custom_model:
        return "a custom_model is a torch module"
    if options.use_lstm:
        return "use_lstm"
    if spec.critic_inputs:
        return "a centralized critic"
    if is_image(spec.observation_space) or has_image(spec.observation_space):
        return "image observations go through a CNN"
    if spec.activation not in ACTIVATIONS:
        return f"activation {spec.activation!r}"
    obs, act = spec.observation_space, spec.action_space
    if not isinstance(obs, gym.spaces.Box | gym.spaces.Discrete):
        return f"observation space {obs}"
    if action_layout(act) is None:
        return f"action space {act}"
    return None


class FlatNumpyModel:
    """A torch model's parameters as NumPy arrays, taken from its flat float32 weight vector (the
    same order: ``shapes``), and its input features (one-hot for a Discrete observation, else
    the flat vector). ``NumpyPolicy`` and ``NumpyQPolicy`` build on it."""

    #: Names the model in errors.
    WHAT = "model"

    def _set_inputs(self, obs_space: gym.Space) -> None:
        self.one_hot = int(obs_space.n) if isinstance(obs_space, gym.spaces.Discrete) else 0
        self.in_dim = self.one_hot or int(np.prod(obs_space.shape))

    def _set_shapes(self, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        """The parameters' names and shapes, in the torch model's order; all zeros until the
        first weights arrive."""
        self.shapes = shapes
        self.params: dict[str, np.ndarray] = {}
        self.set_flat_weights(np.zeros(self.num_weights(), np.float32))

    def num_weights(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.shapes)

    def set_flat_weights(self, flat: np.ndarray) -> None:
        """The torch model's ``get_flat_weights()`` vector; views into a float32 copy."""
        flat = np.array(flat, dtype=np.float32)
        if flat.size != self.num_weights():
            raise ValueError(f"weight vector has {flat.size} values, the {self.WHAT} has "
                             f"{self.num_weights()}")
        offset = 0
        for name, shape in self.shapes:
            n = int(np.prod(shape))
            self.params[name] = flat[offset:offset + n].reshape(shape)
            offset += n

    def get_flat_weights(self) -> np.ndarray:
        return np.concatenate([self.params[name].ravel() for name, _ in self.shapes])

    def _features(self, obs: Any) -> np.ndarray:
        if self.one_hot:
            index = np.asarray(obs).astype(np.int64).reshape(-1)
            return np.eye(self.one_hot, dtype=np.float32)[index]
        return np.asarray(obs).reshape(-1, self.in_dim).astype(np.float32, copy=False)


class NumpyPolicy(FlatNumpyModel):
    """``Policy.act`` without torch, for the specs ``numpy_unsupported`` accepts."""

    WHAT = "policy"

    def __init__(self, spec: PolicySpec, seed: int | None = None) -> None:
        reason = numpy_unsupported(spec)
        if reason is not None:
            raise ValueError(f"NumpyPolicy cannot run this policy: {reason}")
        self.spec = spec
        obs_space, act_space = spec.observation_space, spec.action_space
        self._set_inputs(obs_space)
        self.kind, self.nvec, out = action_layout(act_space)
        hidden = list(head_sizes(obs_space, spec.model, spec.hidden_sizes))
        self.activation = ACTIVATIONS[spec.activation]
        # The torch Policy's parameter order: log_std (Box), then the actor's and the critic's
        # layers, each weight [out, in] before its bias. A vector encoder has no parameters.
        shapes: list[tuple[str, tuple[int, ...]]] = []
        if self.kind == "box":
            shapes.append(("log_std", (out,)))
        self.layers: dict[str, int] = {}
        for head, sizes in (("actor", [self.in_dim, *hidden, out]),
                            ("critic", [self.in_dim, *hidden, 1])):
            self.layers[head] = len(sizes) - 1
            for i in range(len(sizes) - 1):
                shapes += [(f"{head}.{i}.weight", (sizes[i + 1], sizes[i])),
                           (f"{head}.{i}.bias", (sizes[i + 1],))]
        # Zeros until the first weights arrive: a uniform (or unit-Gaussian) policy, value 0.
        self._set_shapes(shapes)
        self.rng = np.random.default_rng(seed)

    def mlp(self, head: str, x: np.ndarray) -> np.ndarray:
        layers = self.layers[head]
        for i in range(layers):
            x = x @ self.params[f"{head}.{i}.weight"].T + self.params[f"{head}.{i}.bias"]
            if i < layers - 1:
                x = self.activation(x)
        return x

    def act(self, obs: Any, deterministic: bool = False
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(actions, log_probs, values)`` for a batch, as ``Policy.act`` gives them."""
        x = self._features(obs)
        out = self.mlp("actor", x)
        values = self.mlp("critic", x)[:, 0].astype(np.float32)
        if self.kind == "box":
            std = np.exp(self.params["log_std"])
            actions = out if deterministic else out + std * self.rng.standard_normal(out.shape)
            actions = actions.astype(np.float32)
            logp = (-0.5 * ((actions - out) / std) ** 2 - self.params["log_std"]
                    - _LOG_SQRT_2PI).sum(-1)
            return actions, logp.astype(np.float32), values
        picks, logps = [], []
        start = 0
        for n in self.nvec:
            logits = out[:, start:start + n].astype(np.float64)
            start += n
            log_probs = logits - logits.max(-1, keepdims=True)
            log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
            if deterministic:
                pick = log_probs.argmax(-1)
            else:  # inverse CDF: one uniform draw per row
                cdf = np.exp(log_probs).cumsum(-1)
                u = self.rng.random((len(cdf), 1)) * cdf[:, -1:]
                pick = np.minimum((cdf < u).sum(-1), n - 1)
            picks.append(pick)
            logps.append(np.take_along_axis(log_probs, pick[:, None], -1)[:, 0])
        logp = np.sum(logps, axis=0).astype(np.float32)
        actions = picks[0] if self.kind == "discrete" else np.stack(picks, -1)
        return actions.astype(np.int64), logp, values

    def value(self, obs: Any) -> np.ndarray:
        """The critic's values of a batch."""
        return self.mlp("critic", self._features(obs))[:, 0].astype(np.float32)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Actions as the env takes them (``mpirl.models.spaces.env_actions``)."""
        return env_actions(self.spec.action_space, self.kind, actions)

