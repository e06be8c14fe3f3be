"""A probabilistic dynamics ensemble (PETS, MBPO), its trainer and its weight vector.

``DynamicsEnsemble`` holds all K members in one batched module: every layer is an
``EnsembleLinear`` with weights ``[K, in, out]``, and one forward pass maps ``[K, B, in]`` to
``[K, B, out]`` with ``torch.baddbmm``. Member k predicts a diagonal Gaussian over the
normalized (observation change, reward); its log-variance is soft-bounded between learned
``min_logvar`` and ``max_logvar`` (PETS's softplus bounds). Inputs (observation, action) and
targets are normalized with statistics fitted on the training split at every ``train`` call
(``RunningMeanStd``). An optional head gives one termination logit per member.

``EnsembleTrainer`` fits it: Gaussian NLL plus the bound regularizer, each member on its own
bootstrap of the training split, Adam with weight decay, early stopping on a held-out split
(each member keeps its best epoch's weights), then the ``elites`` members with the lowest
held-out MSE are the ones ``predict`` uses. A NaN or infinite loss or prediction stops it with
``ModelDivergedError`` naming the member and the epoch.

``predict`` samples one step for planning and model rollouts: TS-inf trajectory sampling, where
particle i always goes through member ``members[i]``, batched over all particles in one forward
pass (particles grouped by member and padded to ``[U, M, in]``, through the U members in use).

The vector the ensemble crosses ranks in (learner 0's broadcast to the rollout ranks, and the
``weights`` of its checkpoint) carries the whole ensemble, not only its parameters: parameters,
then the input and target normalizers (mean, std), then a mask of the elites
(``pack_ensemble``/``unpack_ensemble``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mpirl.algorithms.model_based.dynamics_spec import DynamicsSpec, EnsembleTrainerSpec
from mpirl.algorithms.model_based.transitions import DATASET_KEYS
from torch import nn

from mpirl.errors import ModelDivergedError
from mpirl.models.policy import FlatParameters
from mpirl.models.statistics import RunningMeanStd

_ACTIVATIONS = {"silu": nn.SiLU, "relu": nn.ReLU, "tanh": nn.Tanh, "elu": nn.ELU}
PREDICT_MODES = ("mean", "sample")
#: The progress columns of a fit of the ensemble (``model_columns``), NaN until the first one.
MODEL_STATS = ("model_error", "model_error_max", "model_train_nll", "model_epochs",
               "model_epochs_total")


class EnsembleLinear(nn.Module):
    """K independent linear layers applied at once: ``x [K, B, in] -> [K, B, out]``."""

    def __init__(self, members: int, in_size: int, out_size: int) -> None:
        super().__init__()
        # MBPO's initialization: truncated normal weights of std 1 / (2 sqrt(in)), zero biases.
        std = 1.0 / (2.0 * math.sqrt(in_size))
        self.weight = nn.Parameter(nn.init.trunc_normal_(
            torch.empty(members, in_size, out_size), std=std, a=-2 * std, b=2 * std))
        self.bias = nn.Parameter(torch.zeros(members, 1, out_size))

    def forward(self, x: torch.Tensor, members: torch.Tensor | None = None) -> torch.Tensor:
        """``x [K, B, in]``, or ``[len(members), B, in]`` through those members only."""
        if members is None:
            return torch.baddbmm(self.bias, x, self.weight)
        return torch.baddbmm(self.bias[members], x, self.weight[members])


class DynamicsEnsemble(FlatParameters):
    """K probabilistic dynamics members in one module (see the module's docstring).

    Every parameter has the member index as its first dimension, so one member's weights are
    the slices ``[k]`` of all of them (``member_state``). ``elites`` lists the members
    ``predict`` samples from (all of them until a trainer has chosen)."""

    def __init__(self, spec: DynamicsSpec) -> None:
        super().__init__()
        self.spec = spec
        k, obs, act = spec.ensemble_size, spec.observation_size, spec.action_size
        self.in_size, self.target_size = obs + act, spec.target_size
        self.out_size = 2 * self.target_size + int(spec.learn_termination)
        sizes = [self.in_size, *spec.hidden_sizes, self.out_size]
        self.layers = nn.ModuleList(EnsembleLinear(k, sizes[i], sizes[i + 1])
                                    for i in range(len(sizes) - 1))
        self.activation = _ACTIVATIONS[spec.activation]()
        self.max_logvar = nn.Parameter(torch.full((k, 1, self.target_size), spec.max_logvar))
        self.min_logvar = nn.Parameter(torch.full((k, 1, self.target_size), spec.min_logvar))
        # Normalizers, as buffers (they travel with state_dict and .to(device)).
        self.register_buffer("input_mean", torch.zeros(self.in_size))
        self.register_buffer("input_std", torch.ones(self.in_size))
        self.register_buffer("target_mean", torch.zeros(self.target_size))
        self.register_buffer("target_std", torch.ones(self.target_size))
        self.input_stats = RunningMeanStd((self.in_size,))
        self.target_stats = RunningMeanStd((self.target_size,))
        self.elites: list[int] = list(range(k))
        self.termination_fn = spec.load_termination_fn()

    # -- the batched network -------------------------------------------------------------------

    def forward(self, x: torch.Tensor, members: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Normalized inputs ``[K, B, in]`` -> (mean ``[K, B, T]``, bounded log-variance
        ``[K, B, T]``, termination logits ``[K, B]`` or None), all in normalized units. With
        ``members`` (indices ``[U]``), ``x`` is ``[U, B, in]`` and goes through those only."""
        for layer in self.layers[:-1]:
            x = self.activation(layer(x, members))
        out = self.layers[-1](x, members)
        t = self.target_size
        mean, logvar = out[..., :t], out[..., t:2 * t]
        max_logvar, min_logvar = self.max_logvar, self.min_logvar
        if members is not None:
            max_logvar, min_logvar = max_logvar[members], min_logvar[members]
        logvar = max_logvar - F.softplus(max_logvar - logvar)
        logvar = min_logvar + F.softplus(logvar - min_logvar)
        logits = out[..., 2 * t] if self.spec.learn_termination else None
        return mean, logvar, logits

    def normalize_inputs(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (torch.cat([obs, actions], -1) - self.input_mean) / self.input_std

    def fit_normalizers(self, obs: np.ndarray, actions: np.ndarray, targets: np.ndarray) -> None:
        """Statistics of the inputs and the (unnormalized) targets of the training split (the
        targets of its rows with a known next observation), replacing the previous ones (the
        dataset grows between calls: merging would count the old transitions twice)."""
        self.input_stats = RunningMeanStd((self.in_size,))
        self.input_stats.update(np.concatenate([obs, actions], -1).astype(np.float64))
        self.target_stats = RunningMeanStd((self.target_size,))
        self.target_stats.update(targets.astype(np.float64))
        self._sync_normalizers()

    def _sync_normalizers(self) -> None:
        """The torch buffers from the NumPy statistics (an std of 0, a constant column, is 1)."""
        for stats, mean, std in ((self.input_stats, self.input_mean, self.input_std),
                                 (self.target_stats, self.target_mean, self.target_std)):
            sd = np.sqrt(stats.var)
            sd = np.where(sd < 1e-8, 1.0, sd)
            mean.copy_(torch.as_tensor(stats.mean, dtype=torch.float32))
            std.copy_(torch.as_tensor(sd, dtype=torch.float32))

    def targets(self, obs: np.ndarray, rewards: np.ndarray, next_obs: np.ndarray) -> np.ndarray:
        """Unnormalized targets ``[N, T]``: the observation change, then the reward if learned."""
        delta = (np.asarray(next_obs, np.float32) - np.asarray(obs, np.float32))
        if not self.spec.learn_reward:
            return delta
        return np.concatenate([delta, np.asarray(rewards, np.float32).reshape(-1, 1)], -1)

    # -- prediction ----------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, obs: Any, actions: Any, rng: np.random.Generator | torch.Generator,
                mode: str = "sample", members: Any = None
                ) -> tuple[Any, Any | None, Any]:
        """One model step for N particles: ``(next_obs [N, obs], rewards [N] or None,
        terminated [N] bool)``, NumPy for NumPy inputs and torch (on the model's device) for
        torch ones.

        ``members [N]`` fixes each particle's member (TS-inf: pass the same array at every step
        of a trajectory); None draws one elite per particle from ``rng`` (TS-1).
        ``mode="mean"`` returns each member's mean; ``"sample"`` draws from its Gaussian with
        ``rng`` (a NumPy Generator, or a torch Generator on the model's device). Terminations
        come from ``termination_fn``, else the classifier (logit > 0), else are all False.
        Rewards are None when the spec does not learn them."""
        if mode not in PREDICT_MODES:
            raise ValueError(f"predict mode {mode!r}: use 'mean' or 'sample'")
        as_numpy = not isinstance(obs, torch.Tensor)
        device = self.input_mean.device
        obs_t = torch.as_tensor(obs, dtype=torch.float32, device=device)
        act_t = torch.as_tensor(actions, dtype=torch.float32, device=device)
        n = obs_t.shape[0]
        if members is None:
            if isinstance(rng, torch.Generator):
                pick = torch.randint(len(self.elites), (n,), generator=rng, device=rng.device)
            else:
                pick = torch.as_tensor(rng.integers(len(self.elites), size=n))
            members_t = torch.as_tensor(self.elites, device=device)[pick.to(device)]
        else:
            members_t = torch.as_tensor(members, dtype=torch.long, device=device).reshape(-1)
            if members_t.shape[0] != n:
                raise ValueError(f"members has {members_t.shape[0]} entries for {n} particles")
            if n and (members_t.min() < 0 or members_t.max() >= self.spec.ensemble_size):
                raise ValueError(f"members must index the {self.spec.ensemble_size} members")
        # Group the particles by member, padded to [U, M, in] for the U members in use (the
        # elites, typically): one batched forward pass through those members only.
        used, group = torch.unique(members_t, sorted=True, return_inverse=True)
        order = torch.argsort(group, stable=True)
        counts = torch.bincount(group, minlength=len(used))
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(group)
        slot[order] = torch.arange(n, device=device) - starts[group[order]]
        width = int(counts.max()) if n else 0
        x = torch.zeros(len(used), width, self.in_size, device=device)
        x[group, slot] = self.normalize_inputs(obs_t, act_t)
        everyone = len(used) == self.spec.ensemble_size
        mean, logvar, logits = self(x, None if everyone else used)
        mean, logvar = mean[group, slot], logvar[group, slot]
        if mode == "sample":
            if isinstance(rng, torch.Generator):
                noise = torch.randn(mean.shape, generator=rng, device=rng.device).to(device)
            else:
                noise = torch.as_tensor(rng.standard_normal(tuple(mean.shape), np.float32),
                                        device=device)
            mean = mean + torch.exp(0.5 * logvar) * noise
        out = mean * self.target_std + self.target_mean
        obs_size = self.spec.observation_size
        next_obs = obs_t + out[:, :obs_size]
        rewards = out[:, obs_size] if self.spec.learn_reward else None
        if self.termination_fn is not None:
            done = np.asarray(self.termination_fn(
                obs_t.cpu().numpy(), act_t.cpu().numpy(), next_obs.cpu().numpy()), bool)
            terminated = torch.as_tensor(done.reshape(n), device=device)
        elif logits is not None:
            terminated = logits[group, slot] > 0
        else:
            terminated = torch.zeros(n, dtype=torch.bool, device=device)
        if as_numpy:
            return (next_obs.cpu().numpy(), None if rewards is None else rewards.cpu().numpy(),
                    terminated.cpu().numpy())
        return next_obs, rewards, terminated

    # -- members and state ---------------------------------------------------------------------

    def member_state(self, k: int) -> dict[str, torch.Tensor]:
        """Member k's slices of every parameter (copies)."""
        return {name: p.detach()[k].clone() for name, p in self.named_parameters()}

    @torch.no_grad()
    def load_member_state(self, k: int, state: Mapping[str, torch.Tensor]) -> None:
        for name, p in self.named_parameters():
            p[k].copy_(state[name])

    def get_state(self) -> dict[str, Any]:
        """Weights, normalizers and elites: ``set_state`` of this restores the module
        bit-identically."""
        return {"weights": {name: t.detach().cpu().clone()
                            for name, t in self.state_dict().items()},
                "input_stats": self.input_stats.state(),
                "target_stats": self.target_stats.state(),
                "elites": list(self.elites)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.load_state_dict(state["weights"])
        for name in ("input_stats", "target_stats"):
            mean, var, count = state[name]
            stats = RunningMeanStd(np.shape(mean), count)
            stats.mean, stats.var = np.array(mean, np.float64), np.array(var, np.float64)
            setattr(self, name, stats)
        self.elites = [int(k) for k in state["elites"]]


def _as_dataset(data: Mapping[str, Any], spec: DynamicsSpec) -> dict[str, np.ndarray]:
    """The transitions of ``data`` as float32 arrays of the shapes the spec says."""
    missing = [key for key in DATASET_KEYS if key not in data]
    if missing:
        raise ValueError(f"dynamics dataset lacks {', '.join(missing)} (needs "
                         f"{', '.join(DATASET_KEYS)})")
    n = len(data["obs"])
    out = {key: np.asarray(data[key], np.float32).reshape(n, -1) for key in DATASET_KEYS}
    # Optional: False where next_obs is not the real next observation (a terminated step's).
    out["next_obs_observed"] = (np.asarray(data["next_obs_observed"], bool).reshape(n)
                                if "next_obs_observed" in data else np.ones(n, bool))
    for key, size in (("obs", spec.observation_size), ("actions", spec.action_size),
                      ("next_obs", spec.observation_size), ("rewards", 1), ("terminated", 1)):
        if out[key].shape[1] != size:
            raise ValueError(f"dynamics dataset {key} has {out[key].shape[1]} values per "
                             f"transition, the spec {size}")
        if not np.all(np.isfinite(out[key])):
            raise ValueError(f"dynamics dataset {key} holds NaN or infinite values")
    return out


@dataclass(frozen=True, kw_only=True)
class _FitData:
    """One ``train`` call's dataset as the epochs use it: normalized, on the model's device."""

    inputs: torch.Tensor
    """Normalized (observation, action) of every row, ``[N, in]``."""
    norm_targets: torch.Tensor
    """Normalized targets of every row, ``[N, T]``."""
    dones: torch.Tensor
    """Whether each row ended its episode by termination, ``[N]``."""
    target_weights: torch.Tensor | None
    """0 for the observation change of rows whose next observation is unknown; None: all 1."""
    pos_weight: torch.Tensor | None
    """The termination classifier's weight of a terminated row; None: no row terminated."""
    eval_idx: torch.Tensor
    """The rows early stopping and the elites go by (held out, with a known next state)."""
    termination_idx: torch.Tensor
    """The rows the termination classifier is judged on (every held-out row)."""


class EnsembleTrainer:
    """Fits a ``DynamicsEnsemble`` to real transitions (see the module's docstring).

    The optimizer and the generator (bootstraps, held-out split, minibatch order) persist across
    ``train`` calls; ``get_state``/``set_state`` hold them with the ensemble's state, so a
    resumed trainer continues bit-identically on the CPU."""

    def __init__(self, model: DynamicsEnsemble, spec: EnsembleTrainerSpec | None = None,
                 seed: int = 0, *, member_ids: Sequence[int] | None = None,
                 agree: Callable[[bool, str | None], tuple[bool, str | None]] | None = None
                 ) -> None:
        """``member_ids``: which members of a larger ensemble ``model``'s members are (a shard
        trained on one of several learner ranks); their bootstraps and minibatch orders come
        from generators seeded by (``seed``, member id), so a member trains the same whether
        alone, in a shard or in the whole ensemble. ``agree(improved, divergence)`` combines, at
        the end of every epoch, whether some member of this shard improved and this shard's
        divergence message (or None) with the other shards' (an allreduce over the learners):
        every shard stops at the same epoch, and all raise when one diverged."""
        self.model = model
        self.spec = spec or EnsembleTrainerSpec()
        decayed = [layer.weight for layer in model.layers]
        rest = [p for name, p in model.named_parameters() if not name.endswith(".weight")]
        self.optimizer = torch.optim.Adam(
            [{"params": decayed, "weight_decay": self.spec.weight_decay},
             {"params": rest, "weight_decay": 0.0}], lr=self.spec.learning_rate)
        self.member_ids = (list(range(model.spec.ensemble_size)) if member_ids is None
                           else [int(m) for m in member_ids])
        if len(self.member_ids) != model.spec.ensemble_size:
            raise ValueError(f"member_ids names {len(self.member_ids)} members for an ensemble "
                             f"of {model.spec.ensemble_size}")
        self.agree = agree
        #: The held-out split's generator: the same draws whatever members this trainer holds.
        self.rng = np.random.default_rng(seed)
        self.member_rngs = [np.random.default_rng([seed, m]) for m in self.member_ids]
        self.trained_epochs = 0
        #: Training rows of each member's bootstrap in the last call ([K, n_train]), for tests.
        self.last_bootstrap: np.ndarray | None = None

    def train(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """Train on ``data`` (``obs [N, o]``, ``actions [N, a]``, ``rewards [N]``,
        ``next_obs [N, o]``, ``terminated [N]``) until early stopping, and choose the elites.

        Returns ``member_mse`` (each member's held-out MSE, normalized units), ``elites``,
        ``epochs``, ``train_nll`` (the last epoch's mean over members; ``member_train_nll``
        each member's) and ``model_error`` (the elites' mean held-out one-step MSE, normalized
        units)."""
        model = self.model
        data = _as_dataset(data, model.spec)
        n = len(data["obs"])
        if n < 2:
            raise ValueError(f"the dynamics ensemble needs at least 2 transitions, got {n}")
        hold_idx, train_idx = self._split(n)
        fit = self._prepare(data, hold_idx, train_idx)
        bootstrap = self._bootstraps(train_idx)
        epochs, member_nll = self._fit_until_stale(fit, bootstrap)
        model.eval()
        mse = self._evaluate(fit.inputs, fit.norm_targets, fit.eval_idx, epochs)
        elites = sorted(int(m) for m in np.argsort(mse, kind="stable")[:model.spec.elites])
        model.elites = elites
        self.trained_epochs += epochs
        return {"member_mse": mse.tolist(), "elites": elites, "epochs": epochs,
                "train_nll": float(np.mean(member_nll)), "member_train_nll": member_nll.tolist(),
                "model_error": float(mse[elites].mean()),
                "holdout_size": len(hold_idx), "train_size": len(train_idx)}

    def _split(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The held-out rows and the training rows of ``n`` transitions (one permutation from
        the trainer's generator)."""
        order = self.rng.permutation(n)
        n_hold = min(int(n * self.spec.holdout_ratio), self.spec.max_holdout, n - 1)
        return order[:n_hold], order[n_hold:]

    def _prepare(self, data: dict[str, np.ndarray], hold_idx: np.ndarray,
                 train_idx: np.ndarray) -> _FitData:
        """Fit the normalizers to the training split and put the whole dataset in normalized
        tensors, with the rows each epoch is judged on."""
        model = self.model
        n = len(data["obs"])
        observed = data["next_obs_observed"]
        # Overflowing values are the members' to report (as a diverged loss), not NumPy's.
        with np.errstate(over="ignore", invalid="ignore"):
            targets = model.targets(data["obs"], data["rewards"], data["next_obs"])
            fit_idx = train_idx[observed[train_idx]] if observed[train_idx].any() else train_idx
            model.fit_normalizers(data["obs"][train_idx], data["actions"][train_idx],
                                  targets[fit_idx])
        device = model.input_mean.device
        with torch.no_grad():
            inputs = model.normalize_inputs(torch.as_tensor(data["obs"], device=device),
                                            torch.as_tensor(data["actions"], device=device))
            norm_targets = (torch.as_tensor(targets, device=device) - model.target_mean
                            ) / model.target_std
        dones = torch.as_tensor(data["terminated"][:, 0], device=device)
        # Terminations are rare (an episode ends once): weighed as much as the steps that go
        # on, so that the classifier says "ends" where it is more likely than not to.
        ended = float(data["terminated"].sum())
        pos_weight = (torch.tensor(min((n - ended) / ended, 100.0), device=device)
                      if ended else None)
        # Where the next observation is unknown (a step that ended its episode by termination,
        # kept for the termination classifier), only the reward is a target.
        target_weights = None
        if not observed.all():
            weights = np.ones(targets.shape, np.float32)
            weights[~observed, :model.spec.observation_size] = 0.0
            target_weights = torch.as_tensor(weights, device=device)
        # No held-out split (holdout_ratio 0): stop and choose elites on the training split.
        eval_rows = hold_idx if len(hold_idx) else train_idx
        if observed[eval_rows].any():  # the one-step error is of known next observations
            eval_rows = eval_rows[observed[eval_rows]]
        # The classifier is judged on every held-out row: the terminated ones are its positives.
        termination_rows = hold_idx if len(hold_idx) else train_idx
        return _FitData(inputs=inputs, norm_targets=norm_targets, dones=dones,
                        target_weights=target_weights, pos_weight=pos_weight,
                        eval_idx=torch.as_tensor(eval_rows, device=device),
                        termination_idx=torch.as_tensor(termination_rows, device=device))

    def _bootstraps(self, train_idx: np.ndarray) -> np.ndarray:
        """Each member's bootstrap of the training rows, ``[K, n_train]``, from its own
        generator."""
        n_train = len(train_idx)
        bootstrap = np.stack([train_idx[rng.integers(0, n_train, size=n_train)]
                              for rng in self.member_rngs])
        self.last_bootstrap = bootstrap
        return bootstrap

    def _fit_until_stale(self, fit: _FitData, bootstrap: np.ndarray) -> tuple[int, np.ndarray]:
        """Epochs until ``patience`` of them in a row improve no member (or ``max_epochs``);
        each member ends with its best epoch's weights. With other shards (``agree``) all stop
        at the same epoch, and all raise when one diverged. The epochs run and the last one's
        training NLL of each member ``[K]``."""
        model, spec, k = self.model, self.spec, self.model.spec.ensemble_size
        best = np.full(k, np.inf)
        best_states = [model.member_state(m) for m in range(k)]
        stale, epoch = 0, 0
        member_nll = np.full(k, np.nan)
        while epoch < spec.max_epochs and stale < spec.patience:
            epoch += 1
            try:
                member_nll, mse = self._epoch(fit.inputs, fit.norm_targets, fit.dones, bootstrap,
                                              fit.eval_idx, epoch, fit.target_weights,
                                              fit.pos_weight)
                diverged = None
            except ModelDivergedError as error:
                diverged, mse = error, None
            improved = np.zeros(k, bool)
            if mse is not None:
                # A member improves when its held-out error does, plus its classifier's
                # held-out cross-entropy: the dynamics alone may settle before the classifier.
                score = mse + self._termination_loss(fit.inputs, fit.dones, fit.termination_idx,
                                                     fit.pos_weight)
                improved = ((best - score) / np.where(np.isfinite(best), best, 1.0)
                            > spec.improvement)
                improved |= ~np.isfinite(best)
            any_improved = bool(improved.any())
            if self.agree is not None:
                any_improved, message = self.agree(any_improved, None if diverged is None
                                                   else str(diverged))
                if diverged is None and message is not None:
                    diverged = ModelDivergedError(message)
            if diverged is not None:
                raise diverged
            for m in np.flatnonzero(improved):
                best[m] = score[m]
                best_states[m] = model.member_state(int(m))
            stale = 0 if any_improved else stale + 1
        for m in range(k):
            model.load_member_state(m, best_states[m])
        return epoch, member_nll

    def _epoch(self, inputs: torch.Tensor, norm_targets: torch.Tensor, dones: torch.Tensor,
               bootstrap: np.ndarray, eval_idx: torch.Tensor, epoch: int,
               target_weights: torch.Tensor | None, pos_weight: torch.Tensor | None
               ) -> tuple[np.ndarray, np.ndarray]:
        """One pass of every member over its bootstrap, in its own order: each member's mean
        training NLL over the minibatches ``[K]`` and its held-out MSE after ``[K]``
        (``target_weights`` and ``pos_weight`` as ``_member_losses`` takes them)."""
        model, spec = self.model, self.spec
        device = inputs.device
        orders = [rng.permutation(row) for rng, row in zip(self.member_rngs, bootstrap,
                                                            strict=True)]
        shuffled = torch.as_tensor(np.stack(orders), device=device)
        losses = []
        model.train()
        for start in range(0, bootstrap.shape[1], spec.batch_size):
            idx = shuffled[:, start:start + spec.batch_size]
            nll = self._member_losses(inputs[idx], norm_targets[idx], dones[idx],
                                      None if target_weights is None else target_weights[idx],
                                      pos_weight)
            self._check(nll, epoch, "training loss")
            loss = nll.sum() + spec.logvar_bound_coef * (
                model.max_logvar.sum() - model.min_logvar.sum())
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            losses.append(nll.detach())
        member_nll = torch.stack(losses).mean(0).cpu().double().numpy()
        return member_nll, self._evaluate(inputs, norm_targets, eval_idx, epoch)

    def _member_losses(self, x: torch.Tensor, y: torch.Tensor, done: torch.Tensor,
                       weights: torch.Tensor | None = None,
                       pos_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Each member's Gaussian NLL (up to constants; over the targets ``weights`` keeps, all
        without), plus its termination cross-entropy (a terminated step weighing
        ``pos_weight``, 1 without): ``[K]``."""
        mean, logvar, logits = self.model(x)
        terms = ((mean - y) ** 2) * torch.exp(-logvar) + logvar
        if weights is None:
            nll = terms.mean((1, 2))
        else:
            nll = (terms * weights).sum((1, 2)) / weights.sum((1, 2)).clamp_min(1.0)
        if logits is not None:
            nll = nll + F.binary_cross_entropy_with_logits(
                logits, done, reduction="none", pos_weight=pos_weight).mean(1)
        return nll

    @torch.no_grad()
    def _termination_loss(self, inputs: torch.Tensor, dones: torch.Tensor, idx: torch.Tensor,
                          pos_weight: torch.Tensor | None) -> np.ndarray | float:
        """Each member's termination cross-entropy on ``idx`` ``[K]``; 0 without a classifier."""
        if not self.model.spec.learn_termination:
            return 0.0
        k = self.model.spec.ensemble_size
        _, _, logits = self.model(inputs[idx].unsqueeze(0).expand(k, -1, -1))
        loss = F.binary_cross_entropy_with_logits(
            logits, dones[idx].unsqueeze(0).expand(k, -1), reduction="none",
            pos_weight=pos_weight).mean(1)
        return loss.cpu().double().numpy()

    @torch.no_grad()
    def _evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, idx: torch.Tensor,
                  epoch: int) -> np.ndarray:
        """Each member's MSE of its mean on ``idx`` (normalized units), ``[K]``."""
        k = self.model.spec.ensemble_size
        x = inputs[idx].unsqueeze(0).expand(k, -1, -1)
        mean, _, _ = self.model(x)
        mse = ((mean - targets[idx]) ** 2).mean((1, 2))
        self._check(mse, epoch, "held-out prediction")
        return mse.cpu().double().numpy()

    def _check(self, values: torch.Tensor, epoch: int, what: str) -> None:
        bad = torch.nonzero(~torch.isfinite(values.detach())).flatten()
        if len(bad):
            member = self.member_ids[int(bad[0])]
            raise ModelDivergedError(
                f"dynamics ensemble member {member} diverged at epoch "
                f"{self.trained_epochs + epoch}: its {what} is "
                f"{float(values[int(bad[0])].detach())} "
                f"(lower the dynamics learning_rate, or check the transitions for NaN or "
                f"huge values)", member=member)

    def get_state(self) -> dict[str, Any]:
        """The ensemble's state, the optimizer's, the generator's and the epoch count."""
        return {"model": self.model.get_state(),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "rng": copy.deepcopy(self.rng.bit_generator.state),
                "member_rngs": [copy.deepcopy(r.bit_generator.state) for r in self.member_rngs],
                "trained_epochs": self.trained_epochs}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.model.set_state(state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.rng.bit_generator.state = copy.deepcopy(state["rng"])
        for rng, saved in zip(self.member_rngs, state.get("member_rngs", []), strict=False):
            rng.bit_generator.state = copy.deepcopy(saved)
        self.trained_epochs = int(state["trained_epochs"])



def model_columns(stats: dict[str, Any], trained_epochs: int) -> dict[str, float]:
    """The progress columns of one fit of the whole ensemble (``EnsembleTrainer.train``'s
    ``stats``, or the gathered members'): the elites' and the worst member's held-out error,
    the mean training NLL, the epochs of this fit and of the run."""
    mse = np.asarray(stats["member_mse"])
    return {"model_error": float(mse[stats["elites"]].mean()),
            "model_error_max": float(np.max(mse)),
            "model_train_nll": float(np.mean(stats["member_train_nll"])),
            "model_epochs": float(stats["epochs"]),
            "model_epochs_total": float(trained_epochs)}


# -- the weight vector -----------------------------------------------------------------------


def _buffers(model: DynamicsEnsemble) -> list[torch.Tensor]:
    return [model.input_mean, model.input_std, model.target_mean, model.target_std]


def ensemble_vector_size(model: DynamicsEnsemble) -> int:
    """Length of ``pack_ensemble``'s vector."""
    return (model.num_weights() + sum(b.numel() for b in _buffers(model))
            + model.spec.ensemble_size)


def pack_ensemble(model: DynamicsEnsemble) -> np.ndarray:
    """Everything ``predict`` uses as one float32 vector: parameters, normalizers, elites."""
    mask = np.zeros(model.spec.ensemble_size, np.float32)
    mask[model.elites] = 1.0
    buffers = [b.detach().reshape(-1).cpu().numpy() for b in _buffers(model)]
    return np.concatenate([model.get_flat_weights(), *buffers, mask]).astype(np.float32)


@torch.no_grad()
def unpack_ensemble(model: DynamicsEnsemble, flat: np.ndarray) -> None:
    """Load ``pack_ensemble``'s vector into ``model``."""
    flat = np.asarray(flat, np.float32)
    if flat.size != ensemble_vector_size(model):
        raise ValueError(f"ensemble vector has {flat.size} values, the ensemble "
                         f"{ensemble_vector_size(model)}")
    n = model.num_weights()
    model.set_flat_weights(flat[:n])
    offset = n
    for buffer in _buffers(model):
        size = buffer.numel()
        buffer.copy_(torch.as_tensor(flat[offset:offset + size]).view_as(buffer))
        offset += size
    model.elites = [int(k) for k in np.flatnonzero(flat[offset:] > 0.5)]
