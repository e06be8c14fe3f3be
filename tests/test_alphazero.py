"""AlphaZero's pieces (issue 38): the network from the model catalog in both board layouts and
for vectors, its evaluator for search, the loss, symmetry augmentation and batched self-play."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import OS_C4, OS_TTT, PZ_TTT
from mpirl.algorithms.alphazero.games import load_game
from mpirl.algorithms.alphazero.mcts import MCTSConfig
from mpirl.algorithms.alphazero.network import (
    AlphaZeroNet,
    TorchEvaluator,
    alphazero_loss,
    masked_logits,
)
from mpirl.algorithms.alphazero.self_play import SelfPlay, SelfPlayBatch
from mpirl.algorithms.alphazero.spec import AlphaZeroSpec, alphazero_spec, uniform_evaluate
from mpirl.algorithms.alphazero.symmetries import augment, symmetries

from mpirl.errors import ConfigError
from mpirl.models.torch_model import build_torch_model

pytest.importorskip("pyspiel")
pytest.importorskip("pettingzoo")




def positions(game, count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Observations and masks of ``count`` non-terminal positions from random play."""
    rng = np.random.default_rng(seed)
    obs, masks = [], []
    while len(obs) < count:
        state = game.new_initial_state()
        while not state.is_terminal() and len(obs) < count:
            obs.append(state.observation())
            masks.append(state.legal_action_mask())
            state.apply(int(rng.choice(np.flatnonzero(state.legal_action_mask()))))
    return np.asarray(obs, np.float32), np.asarray(masks, bool)


def test_spec_reads_the_board_layout_from_the_game():
    pz, os_ = alphazero_spec(load_game(PZ_TTT)), alphazero_spec(load_game(OS_TTT))
    assert pz.channels_last and pz.board_chw == (2, 3, 3)
    assert not os_.channels_last and os_.board_chw == (3, 3, 3)
    c4 = alphazero_spec(load_game(OS_C4), channels=8, blocks=1)
    assert c4.board_chw[1:] == (6, 7) and c4.num_actions == 7 and c4.blocks == 1
    assert not AlphaZeroSpec((10,), 4).is_board
    for bad in ({"num_actions": 0}, {"channels": 0}, {"blocks": -1}, {"hidden_sizes": (0,)}):
        with pytest.raises(ConfigError):
            AlphaZeroSpec(**{"observation_shape": (3, 3, 2), "num_actions": 9, **bad})


@pytest.mark.parametrize("game_id", [PZ_TTT, OS_TTT, OS_C4])
def test_network_shapes_on_each_game(game_id):
    game = load_game(game_id)
    net = build_torch_model(alphazero_spec(game, channels=8, blocks=2))
    assert isinstance(net, AlphaZeroNet)
    obs, _ = positions(game, 5)
    logits, values = net(torch.as_tensor(obs))
    assert logits.shape == (5, game.num_actions) and values.shape == (5,)
    assert bool((values.abs() <= 1).all())


def test_channels_last_is_the_same_network_on_transposed_planes():
    """An HWC board through a channels_last net equals its CHW transpose through the same
    weights in a channels-first net: the permute is the only difference."""
    torch.manual_seed(0)
    hwc = AlphaZeroNet(AlphaZeroSpec((3, 4, 2), 12, channels_last=True, channels=8, blocks=1))
    chw = AlphaZeroNet(AlphaZeroSpec((2, 3, 4), 12, channels_last=False, channels=8, blocks=1))
    chw.load_state_dict(hwc.state_dict())
    hwc.eval(), chw.eval()
    x = torch.randn(6, 3, 4, 2)
    for a, b in zip(hwc(x), chw(x.permute(0, 3, 1, 2)), strict=True):
        torch.testing.assert_close(a, b)


def test_vector_observations_go_through_the_mlp():
    net = build_torch_model(AlphaZeroSpec((10,), 4, hidden_sizes=(16,)))
    logits, values = net(torch.randn(3, 10))
    assert logits.shape == (3, 4) and values.shape == (3,)
    assert not any(isinstance(m, torch.nn.Conv2d) for m in net.modules())


def test_torch_evaluator_masks_illegal_moves_and_leaves_the_model_as_it_was():
    game = load_game(OS_TTT)
    net = build_torch_model(alphazero_spec(game, channels=8, blocks=1))
    net.train()
    evaluate = TorchEvaluator(net)
    obs, masks = positions(game, 7)
    priors, values = evaluate(obs, masks)
    assert priors.dtype == np.float32 and values.dtype == np.float32
    assert priors.shape == (7, 9) and values.shape == (7,)
    assert np.all(priors[~masks] == 0)
    np.testing.assert_allclose(priors.sum(1), 1, rtol=1e-5)
    assert net.training  # restored after the eval-mode forward
    # Eval mode: one position gives the same answer alone as in the batch (batch norm).
    alone = evaluate(obs[3:4], masks[3:4])
    np.testing.assert_allclose(alone[0][0], priors[3], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(alone[1][0], values[3], rtol=1e-5, atol=1e-6)


def test_uniform_evaluate():
    masks = np.array([[True, False, True, True], [False, True, False, False]])
    priors, values = uniform_evaluate(np.zeros((2, 5), np.float32), masks)
    np.testing.assert_allclose(priors, [[1 / 3, 0, 1 / 3, 1 / 3], [0, 1, 0, 0]], rtol=1e-6)
    assert priors.dtype == np.float32 and np.all(values == 0)


def test_loss_is_cross_entropy_plus_value_error_with_illegal_moves_left_out():
    spec = AlphaZeroSpec((4,), 3, hidden_sizes=(8,))
    net = AlphaZeroNet(spec)
    obs = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    masks = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], bool)
    targets = np.array([[0.5, 0.5, 0], [1, 0, 0], [0, 0.25, 0.75], [0.2, 0.3, 0.5]], np.float32)
    outcomes = np.array([1, -1, 0, 1], np.float32)
    batch = {"observations": obs, "masks": masks, "policies": targets, "outcomes": outcomes}
    loss, stats = alphazero_loss(net, batch)
    with torch.no_grad():
        logits, values = net(torch.as_tensor(obs))
    logits = logits.numpy()
    policy_loss = value_loss = entropy = 0.0
    for i in range(4):
        legal = logits[i][masks[i]]
        log_p = legal - np.log(np.exp(legal).sum())
        policy_loss -= (targets[i][masks[i]] * log_p).sum() / 4
        entropy -= (np.exp(log_p) * log_p).sum() / 4
        value_loss += (values[i].item() - outcomes[i]) ** 2 / 4
    assert math.isfinite(loss.item())
    assert stats["policy_loss"] == pytest.approx(policy_loss, rel=1e-5)
    assert stats["value_loss"] == pytest.approx(value_loss, rel=1e-5)
    assert stats["policy_entropy"] == pytest.approx(entropy, rel=1e-5)
    assert stats["loss"] == pytest.approx(policy_loss + value_loss, rel=1e-5)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_masked_logits():
    out = masked_logits(torch.zeros(1, 3), torch.tensor([[True, False, True]]))
    assert out[0, 1] == float("-inf") and torch.softmax(out, -1)[0, 1] == 0


@pytest.mark.parametrize("game_id", [PZ_TTT, OS_TTT, OS_C4])
def test_augment_moves_each_sample_by_one_symmetry_of_the_game(game_id):
    game = load_game(game_id)
    table = symmetries(game)
    rng = np.random.default_rng(1)
    obs, masks = positions(game, 40)
    policies = rng.random(masks.shape).astype(np.float32) * masks
    new_obs, new_masks, new_policies = augment(table, obs, masks, policies, rng)
    used = set()
    for i in range(len(obs)):
        matches = [k for k, s in enumerate(table)
                   if np.array_equal(s.observations(obs[i:i + 1])[0], new_obs[i])
                   and np.array_equal(s.actions(masks[i]), new_masks[i])
                   and np.array_equal(s.actions(policies[i]), new_policies[i])]
        assert matches, f"sample {i} is not any one symmetry of itself"
        used.update(matches)
    assert len(used) > 1  # not all the identity
    assert len(table) > 1


def test_augment_with_the_identity_only_changes_nothing():
    game = load_game(OS_TTT)
    obs, masks = positions(game, 5)
    table = symmetries(game)[:1]
    out = augment(table, obs, masks, masks.astype(np.float32), np.random.default_rng(0))
    for a, b in zip(out, (obs, masks, masks.astype(np.float32)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("gumbel", [False, True])
def test_self_play_scores_positions_for_their_mover_and_refills_slots(gumbel):
    game = load_game(OS_TTT)
    config = MCTSConfig(simulations=8, gumbel=gumbel, gumbel_actions=4)
    play = SelfPlay(game, uniform_evaluate, config, num_games=6,
                    rng=np.random.default_rng(0))
    batch = play.play(20)
    assert batch.games >= 20 and play.games_finished == batch.games
    assert int(batch.game_lengths.sum()) == len(batch) == play.positions_finished
    assert batch.observations.shape == (len(batch), *game.observation_shape)
    assert batch.observations.dtype == np.float32 and batch.masks.dtype == bool
    np.testing.assert_allclose(batch.policies.sum(1), 1, rtol=1e-5)
    assert np.all(batch.policies[~batch.masks] == 0)
    start = 0
    for length, first in zip(batch.game_lengths, batch.first_player_returns, strict=True):
        z = batch.outcomes[start:start + length]
        # Players alternate in tic-tac-toe: z alternates sign, the first mover's is the game's.
        assert z[0] == first
        np.testing.assert_array_equal(z[1::2], -z[0::2][:len(z[1::2])])
        # The last mover won or drew; the first position is the empty board.
        assert z[-1] >= 0 and batch.masks[start].all()
        assert length >= 5
        start += length
    stats = batch.stats()
    assert stats["games"] == batch.games and 5 <= stats["game_length_mean"] <= 9
    assert set(batch.as_dict()) == {"observations", "masks", "policies", "outcomes"}


def test_self_play_max_moves_ends_games_as_draws():
    game = load_game(OS_TTT)
    play = SelfPlay(game, uniform_evaluate, MCTSConfig(simulations=2), num_games=3,
                    rng=np.random.default_rng(0), max_moves=2)
    assert play.step().games == 0  # one move each
    batch = play.step()
    assert batch.games == 3 and np.all(batch.game_lengths == 2) and np.all(batch.outcomes == 0)


def test_self_play_checks_its_arguments_and_concatenates_nothing():
    game = load_game(OS_TTT)
    with pytest.raises(ConfigError):
        SelfPlay(game, uniform_evaluate, MCTSConfig(), 0, np.random.default_rng(0))
    with pytest.raises(ConfigError):
        SelfPlay(game, uniform_evaluate, MCTSConfig(), 1, np.random.default_rng(0),
                 max_moves=0)
    empty = SelfPlayBatch.concatenate([], game)
    assert len(empty) == 0 and empty.observations.shape == (0, 3, 3, 3)
    assert empty.stats() == {"games": 0}


@pytest.mark.parametrize("game_id", [PZ_TTT, OS_C4])
def test_self_play_with_the_network_and_a_training_step(game_id):
    """End to end on a channels-last game and a bigger board: self-play with the network's
    evaluator, then one SGD step of the loss on augmented positions."""
    game = load_game(game_id)
    torch.manual_seed(0)
    net = build_torch_model(alphazero_spec(game, channels=8, blocks=1))
    play = SelfPlay(game, TorchEvaluator(net), MCTSConfig(simulations=4), num_games=4,
                    rng=np.random.default_rng(0), max_moves=12)
    rng = np.random.default_rng(1)
    batch = play.play(4)
    obs, masks, policies = augment(symmetries(game), batch.observations, batch.masks,
                                   batch.policies, rng)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, weight_decay=1e-4)
    loss, stats = alphazero_loss(net, {"observations": obs, "masks": masks,
                                       "policies": policies, "outcomes": batch.outcomes})
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    assert all(np.isfinite(value) for value in stats.values())
    assert stats["policy_entropy"] > 0


@pytest.mark.parametrize("game_id", [OS_C4, PZ_TTT])
@pytest.mark.parametrize("gumbel", [False, True])
def test_self_play_restored_from_its_state_plays_on_identically(game_id, gumbel):
    import pickle

    game = load_game(game_id)
    net = build_torch_model(alphazero_spec(game, channels=4, blocks=1, value_hidden=8))
    config = MCTSConfig(simulations=8, gumbel=gumbel, temperature_moves=3)

    def run(rng):
        return SelfPlay(game, TorchEvaluator(net), config, num_games=5, rng=rng)

    rng = np.random.default_rng(3)
    original = run(rng)
    for _ in range(4):  # games mid-way, trees kept from earlier moves
        original.step()
    saved = pickle.loads(pickle.dumps((original.get_state(), rng.bit_generator.state)))
    expected = original.play(6)

    rng2 = np.random.default_rng(99)
    restored = run(rng2)
    restored.set_state(saved[0])
    rng2.bit_generator.state = saved[1]
    got = restored.play(6)
    for name in ("observations", "masks", "policies", "outcomes", "game_lengths"):
        assert np.array_equal(getattr(expected, name), getattr(got, name)), name
    assert restored.games_finished == original.games_finished

    with pytest.raises(ValueError, match="5 games in play cannot restore 4"):
        SelfPlay(game, TorchEvaluator(net), config, num_games=4, rng=rng2).set_state(saved[0])


@pytest.mark.parametrize("game_id", [OS_TTT, PZ_TTT])
def test_state_from_history_is_the_same_position(game_id):
    game = load_game(game_id)
    rng = np.random.default_rng(0)
    state = game.new_initial_state()
    for _ in range(5):
        state.apply(int(rng.choice(np.flatnonzero(state.legal_action_mask()))))
    again = game.state_from_history(state.history())
    assert again.key() == state.key() and again.history() == state.history()
    assert state.clone().history() == state.history()
