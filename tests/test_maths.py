"""The maths: bootstrapping at episode ends, gradients of uneven learners, prioritized replay's
importance weights and beta schedule, MARWIL's advantage scale, and the address learners meet on.
"""

import ipaddress
import json
import sys

import gymnasium as gym
import numpy as np
import pytest
from conftest import PROGRAMS, parse_result, run_mpi
from mpirl.algorithms.q_learning import dqn
from test_env_failures import GAMMA, local_context
from test_replay import add_column, counter_buffer
from test_train import MPIRL, rows, train

from mpirl.data.replay_buffer import SumTree
from mpirl.errors import ConfigError
from mpirl.execution.replay_ops import check_q_config, replay_beta
from mpirl.models.policy import PolicySpec
from mpirl.testing import CountingEnv
from mpirl.workers import learner as learner_module
from mpirl.workers.env_spec import EnvSpec
from mpirl.workers.learner import bootstrap_address
from mpirl.workers.rollout import RolloutSettings, RolloutWorker

# CountingEnv's episodes end (terminated) after `episode_length` steps; gymnasium's TimeLimit
# truncates them after `max_episode_steps`. When both are 5, step 5 is terminated and truncated.
if "MathsCounting-v0" not in gym.registry:
    gym.register("MathsCounting-v0", entry_point=CountingEnv)


def counting_worker(episode_length: int, max_episode_steps: int) -> RolloutWorker:
    spec = EnvSpec("MathsCounting-v0", env_config={"episode_length": episode_length,
                                                   "max_episode_steps": max_episode_steps})
    policy = PolicySpec(*spec.spaces(), (8,), "tanh")
    worker = RolloutWorker(local_context("rollout"), RolloutSettings(
        env=spec, policy=policy, num_envs=1, seed=0, gamma=GAMMA))
    # A critic far from 0, so that a bootstrap would show: its output bias is the last weight.
    weights = worker.get_weights()
    weights[-1] = 3.0
    worker.set_weights(weights)
    return worker


@pytest.mark.parametrize("trajectories", [False, True])
def test_a_step_both_terminated_and_truncated_is_not_bootstrapped(trajectories):
    worker = counting_worker(episode_length=5, max_episode_steps=5)
    batch = worker.sample(5, form="fragments" if trajectories else "advantages")["batch"]
    if trajectories:  # V-trace's fragments (IMPALA): rewards as sampled
        assert batch["rewards"][0].tolist() == [1.0] * 5
        assert batch["dones"][0].tolist() == [0, 0, 0, 0, 1]
    else:  # GAE with lambda 1 (PPO, A2C, A3C): plain discounted returns, no V(final) added
        expected = [sum(GAMMA**j for j in range(5 - k)) for k in range(5)]
        np.testing.assert_allclose(batch["value_targets"], expected, rtol=1e-5)


def test_a_step_only_truncated_is_bootstrapped_from_its_final_observation():
    worker = counting_worker(episode_length=50, max_episode_steps=5)
    rewards = worker.sample(5, form="fragments")["batch"]["rewards"][0]
    final_value = float(worker.policy.value(np.array([[5.0]], np.float32))[0])
    assert abs(final_value) > 1.0
    np.testing.assert_allclose(rewards, [1, 1, 1, 1, 1 + GAMMA * final_value], rtol=1e-5)


def test_uneven_learners_take_the_step_one_learner_takes_on_all_rows():
    # Two learner ranks share 10 rows 7:3 and 10:0; one learner on COMM_SELF takes all 10.
    # PPO (rows), IMPALA (fragments weighted by the steps their masks keep) and MARWIL (with
    # its moving average of squared advantages), over the MPI and gloo allreduces.
    proc = run_mpi(2, sys.executable, str(PROGRAMS / "uneven_learners.py"), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = parse_result(proc.stdout)
    # Gloo's own connections use the interface on the route to learner 0, not what the host
    # name resolves to (loopback here): the same one on both ranks of this one host.
    route = learner_module._route_to(learner_module._DEFAULT_ROUTE_PROBE)
    expected = None if route is None else learner_module._interface_with(route)
    assert result["gloo_interfaces"] == [expected, expected]
    result = result["cases"]
    assert sorted(result) == sorted(
        f"{backend}/{algo}/{split}" for backend in ("mpi", "gloo")
        for algo, splits in (("ppo", ("uneven", "empty_share")),
                             ("impala", ("uneven", "empty_share")), ("marwil", ("uneven",)))
        for split in splits)
    for case, numbers in result.items():
        assert numbers["gradient_max_abs"] > 0.1, case  # a gradient worth comparing
        assert numbers["gradient_max_diff"] <= 1e-6, (case, numbers)
        if "scale" in numbers:
            shared, alone = numbers["scale"]
            assert numbers["scales_equal"], case  # both learners hold the same average
            assert shared == pytest.approx(alone, rel=1e-6), case


# Prioritized replay.


def test_importance_weights_are_normalized_by_the_lowest_priority_in_the_buffer():
    buffer = counter_buffer(capacity=64, n_step=1, prioritized=True, alpha=1.0, beta=0.5)
    add_column(buffer, 0, np.arange(40))
    batch = buffer.sample(8)
    td = np.linspace(0.5, 4.0, 8)
    buffer.update_priorities(batch["indices"], batch["generations"], td)
    lowest = int(batch["indices"][0])  # now the lowest priority (0.5) of the buffer
    for _ in range(20):
        batch = buffer.sample(16)
        stored = buffer.tree[batch["indices"]]
        np.testing.assert_allclose(batch["weights"], (buffer.tree[lowest] / stored) ** 0.5,
                                   rtol=1e-5)
        if lowest not in batch["indices"]:
            # The batch's own largest weight is not 1: the weights do not depend on what else
            # a minibatch happened to draw.
            assert batch["weights"].max() < 0.99
    assert buffer.tree.min_priority == pytest.approx(0.5, rel=1e-3)


def test_the_lowest_priority_follows_every_update():
    rng = np.random.default_rng(4)
    size = 1000  # 16 blocks, the last one partly filled
    tree = SumTree(size)
    assert tree.min_priority == 0.0
    values = np.zeros(size)
    for _ in range(200):
        leaves = rng.choice(size, rng.integers(1, 40), replace=False)
        new = rng.lognormal(0.0, 3.0, len(leaves)) * (rng.random(len(leaves)) > 0.3)
        tree.update(leaves, new)
        values[leaves] = new
        stored = tree[np.arange(size)]
        assert tree.min_priority == (stored[stored > 0].min() if (stored > 0).any() else 0.0)
    copy = SumTree(size)
    copy.set_state(tree.get_state())
    assert copy.min_priority == tree.min_priority
    tree.update(np.arange(size), np.zeros(size))
    assert tree.min_priority == 0.0


def test_beta_anneals_linearly_to_its_final_value():
    config = dqn.Config()
    assert (config.prioritized_replay_beta, config.prioritized_replay_beta_final,
            config.prioritized_replay_beta_anneal_steps) == (0.4, 1.0, 100_000)
    assert [replay_beta(config, t) for t in (0, 50_000, 100_000, 300_000)] == pytest.approx(
        [0.4, 0.7, 1.0, 1.0])
    constant = dqn.Config(prioritized_replay_beta_anneal_steps=0)
    assert replay_beta(constant, 10**6) == 0.4


@pytest.mark.parametrize("key,value", [("prioritized_replay_beta_final", 1.5),
                                       ("prioritized_replay_beta_anneal_steps", -1)])
def test_beta_schedule_keys_are_range_checked(key, value):
    with pytest.raises(ConfigError, match=key):
        check_q_config(dqn.Config(**{key: value}), EnvSpec("CartPole-v1"), "DQN")


def test_dqn_reports_the_annealed_beta(tmp_path):
    config = {"prioritized_replay": True, "learning_starts": 256,
              "prioritized_replay_beta_anneal_steps": 1024, "num_envs_per_worker": 2,
              "rollout_fragment_length": 64, "hidden_sizes": [16]}
    _, run_dir, result = train(1, tmp_path, "--algo", "DQN", "--env", "CartPole-v1",
                               "--config", json.dumps(config),
                               "--stop", '{"timesteps_total": 1536}', timeout=120)
    betas = [float(row["prioritized_replay_beta"]) for row in rows(run_dir)]
    steps = [int(row["timesteps_total"]) for row in rows(run_dir)]
    # Each iteration trains with the beta of the env steps sampled so far.
    expected = [min(1.0, 0.4 + 0.6 * t / 1024) for t in steps]
    assert betas == pytest.approx(expected), (betas, steps)
    assert betas[-1] == 1.0 and result["timesteps_total"] == 1536


# The address the learners' gloo/NCCL group meets on.


@pytest.fixture
def routes(monkeypatch):
    """``_route_to`` made a table: each launcher address has a local address on its route."""
    asked = []
    table = {"10.9.8.7": "10.9.0.1", "10.20.30.40": "10.20.0.1", "192.168.5.5": "192.168.0.1"}

    def route_to(address):
        asked.append(address)
        return table.get(address)

    monkeypatch.setattr(learner_module, "_route_to", route_to)
    return asked


def test_the_config_key_wins_over_master_addr():
    assert bootstrap_address("127.0.0.1", {"MASTER_ADDR": "localhost"}) == "127.0.0.1"
    assert bootstrap_address("", {"MASTER_ADDR": "localhost"}) == "localhost"


@pytest.mark.parametrize("configured,environ,named", [
    ("192.0.2.77", {}, "learner_master_addr"),
    ("", {"MASTER_ADDR": "192.0.2.77"}, "MASTER_ADDR"),
    ("", {"MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR"),
])
def test_an_address_not_of_this_host_is_refused(configured, environ, named):
    with pytest.raises(ConfigError, match=f"{named} is .*no address of"):
        bootstrap_address(configured, environ)


def test_master_addr_wins_over_the_launcher(routes):
    environ = {"MASTER_ADDR": "127.0.0.1", "SLURM_LAUNCH_NODE_IPADDR": "10.9.8.7"}
    assert bootstrap_address("", environ) == "127.0.0.1" and routes == []


def test_the_address_on_the_route_to_the_launcher(routes):
    pmix = "prterun-vm-7877@0.0;tcp4://127.0.0.1:39497"  # a loopback URI says nothing
    environ = {"PMIX_SERVER_URI41": pmix, "SLURM_LAUNCH_NODE_IPADDR": "10.9.8.7",
               "OMPI_MCA_orte_hnp_uri": "3236691968.0;tcp://10.20.30.40,192.168.5.5:44577"}
    assert bootstrap_address("", environ) == "10.9.0.1"  # srun's node first
    del environ["SLURM_LAUNCH_NODE_IPADDR"]
    assert bootstrap_address("", environ) == "10.20.0.1"  # Open MPI 4's mpirun
    routes.clear()
    environ["OMPI_MCA_orte_hnp_uri"] = "3236691968.0;tcp://192.0.2.200,192.168.5.5:44577"
    assert bootstrap_address("", environ) == "192.168.0.1"  # no route to the first: the next
    assert routes == ["192.0.2.200", "192.168.5.5"]


def test_without_any_hint_a_non_loopback_address_of_this_host():
    # The old choice, gethostbyname(gethostname()), is 127.0.0.1 on this machine and often
    # 127.0.1.1 elsewhere: no other node could reach it.
    if learner_module._route_to(learner_module._DEFAULT_ROUTE_PROBE) is None:
        pytest.skip("this host has no default route to a non-loopback interface")
    address = bootstrap_address("", {"PMIX_SERVER_URI41": "ns@0.0;tcp4://127.0.0.1:1"})
    assert not ipaddress.ip_address(address).is_loopback, address


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interfaces by ioctl: Linux")
def test_the_interface_of_an_address():
    assert learner_module._interface_with("127.0.0.1") == "lo"
    assert learner_module._interface_with("192.0.2.254") is None  # TEST-NET: no interface


def test_a_bad_master_addr_ends_the_run_with_exit_code_2(tmp_path):
    config = {"num_learners": 2, "num_rollout_workers": 1, "learner_backend": "gloo"}
    proc = run_mpi(4, *MPIRL, "train", "--algo", "PPO", "--env", "CartPole-v1",
                   "--run-dir", str(tmp_path / "run"), "--config", json.dumps(config),
                   "--stop", '{"training_iteration": 1}', timeout=180,
                   env={"MASTER_ADDR": "192.0.2.77"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "MASTER_ADDR is '192.0.2.77', which is no address of" in proc.stderr
    assert "Traceback" not in proc.stderr
