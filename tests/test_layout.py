"""Layout resolution and config parsing: pure functions, no MPI launch."""

import pytest

from mpirl.config.parse import build, parse_json_object, split_by_dataclass
from mpirl.errors import ConfigError, LayoutError
from mpirl.runtime.driver import RuntimeSettings
from mpirl.runtime.layout import Layout


def test_fixed_layout_assigns_roles_in_order():
    placement = Layout(num_rollout_workers=2, num_replay_shards=1, num_learners=2).resolve(6)
    assert placement.roles == ("driver", "rollout", "rollout", "replay", "learner", "learner")
    assert placement.ranks("learner") == [4, 5]
    assert [placement.role_index(r) for r in range(6)] == [0, 0, 1, 0, 0, 1]
    assert placement.summary() == "driver 1, rollout 2, replay 1, learner 2 (world size 6)"


def test_auto_rollout_takes_every_rank_left():
    placement = Layout(num_learners=1).resolve(8)
    assert placement.count("rollout") == 6
    assert placement.ranks("learner") == [7]
    assert Layout(num_learners=2).resolve(3).count("rollout") == 0


def test_world_too_small_names_the_count_and_the_fix():
    with pytest.raises(LayoutError) as info:
        Layout(num_rollout_workers=2, num_learners=2).resolve(4)
    message = str(info.value)
    assert "needs 5 ranks" in message and "world has 4" in message
    assert "mpiexec -n 5" in message and "num_rollout_workers=-1" in message


def test_auto_layout_too_small():
    with pytest.raises(LayoutError, match="at least 4 ranks"):
        Layout(num_replay_shards=1, num_learners=2).resolve(3)


def test_world_too_large_for_a_fixed_layout():
    with pytest.raises(LayoutError, match="needs 3 ranks"):
        Layout(num_rollout_workers=2).resolve(8)


def test_local_mode_puts_every_requested_role_in_process():
    placement = Layout(num_rollout_workers=4, num_learners=2).resolve(1)
    assert placement.local
    assert placement.ranks("rollout") == [0] and placement.ranks("learner") == [0]
    assert placement.ranks("replay") == []
    assert "local mode" in placement.summary()
    assert Layout().resolve(1).local_roles == ("rollout",)


def test_local_mode_says_what_it_folded_and_records_what_ran():
    placement = Layout(num_rollout_workers=4, num_learners=2).resolve(1)
    assert placement.fold_note() == (
        "local mode (world size 1) runs one in-process worker per role: num_rollout_workers 4 "
        "-> 1, num_learners 2 -> 1; launch 7 ranks (mpiexec -n 7) to run the layout as "
        "configured")
    assert placement.record() == {
        "summary": "driver 1, rollout 1, replay 0, learner 1 (local mode, all roles in-process)",
        "world_size": 1, "local_mode": True,
        "ranks": {"driver": [0], "rollout": [0], "replay": [], "learner": [0]},
        "folded": {"rollout": 4, "learner": 2}}
    # Nothing folded: no note, and no "folded" entry.
    assert Layout(num_rollout_workers=-1, num_learners=1).resolve(1).fold_note() is None
    assert Layout(num_learners=1).resolve(1).record()["ranks"]["learner"] == [0]
    distributed = Layout(num_rollout_workers=2, num_learners=2).resolve(5).record()
    assert distributed["ranks"] == {"driver": [0], "rollout": [1, 2], "replay": [],
                                    "learner": [3, 4]}
    assert "folded" not in distributed and not distributed["local_mode"]


@pytest.mark.parametrize("kwargs", [
    {"num_rollout_workers": -2}, {"num_learners": -1}, {"num_replay_shards": 1.5},
    {"num_learners": True},
])
def test_bad_counts_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        Layout(**kwargs)


def test_unknown_key_lists_close_matches():
    with pytest.raises(ConfigError) as info:
        split_by_dataclass({"num_learner": 2}, Layout, RuntimeSettings)
    assert "unknown config key 'num_learner'" in str(info.value)
    assert "'num_learners'" in str(info.value)


def test_config_values_are_type_checked():
    with pytest.raises(ConfigError, match="must be a finite number > 0"):
        build(RuntimeSettings, {"heartbeat_timeout_s": "10"})
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        build(RuntimeSettings, {"max_calls_in_flight": 2.5})
    with pytest.raises(ConfigError, match="true or false"):
        build(RuntimeSettings, {"print_layout": 1})
    assert build(RuntimeSettings, {"heartbeat_timeout_s": 5}).heartbeat_timeout_s == 5


@pytest.mark.parametrize("text", ["{", "[1, 2]", "num_learners=2"])
def test_bad_json_is_explained(text):
    with pytest.raises(ConfigError, match="--config"):
        parse_json_object(text, "--config")


def test_an_automatic_rollout_count_with_no_rank_left_says_so_first():
    """mpiexec -n 3 for a layout of two learners: legitimate (the driver samples), but the
    note, printed first, says what ran and what -n gives a rollout rank; an explicit
    num_rollout_workers 0, or a rank left, gives no note."""
    placement = Layout(num_learners=2).resolve(3)
    assert placement.count("rollout") == 0 and placement.note() == (
        "no rank is left for rollout workers (world size 3 = 1 driver + 2 learner): the driver "
        "samples (rollout 0); launch 4 ranks (mpiexec -n 4) for one rollout rank, or set "
        "num_rollout_workers 0 if none is meant")
    assert "1 replay + 1 learner" in Layout(num_replay_shards=1, num_learners=1).resolve(3).note()
    assert Layout(num_rollout_workers=0, num_learners=2).resolve(3).note() is None
    assert Layout(num_learners=2).resolve(4).note() is None
    assert Layout(num_rollout_workers=4).resolve(1).note() == \
        Layout(num_rollout_workers=4).resolve(1).fold_note()


def test_env_groups_follow_their_rollout_rank_and_learners_stay_last():
    placement = Layout(ranks_per_env=2, envs_per_rollout=2, num_learners=1).resolve(12)
    assert placement.roles == ("driver", "rollout", "env", "env", "env", "env",
                               "rollout", "env", "env", "env", "env", "learner")
    assert [(g.index, g.rollout_rank, g.members) for g in placement.env_groups] == [
        (0, 1, (2, 3)), (1, 1, (4, 5)), (2, 6, (7, 8)), (3, 6, (9, 10))]
    assert [g.index for g in placement.groups_of(6)] == [2, 3]
    assert placement.group_of(8).index == 2 and placement.group_of(6) is None
    assert placement.role_index(7) == 4
    assert placement.summary() == ("driver 1, rollout 2, env 8 (4 groups x 2), replay 0, "
                                   "learner 1 (world size 12)")
    record = placement.record(["n0"] * 6 + ["n1"] * 6)
    assert record["ranks"]["env"] == [2, 3, 4, 5, 7, 8, 9, 10]
    assert record["ranks_per_env"] == 2
    assert record["env_groups"][3] == {"group": 3, "rollout_rank": 6, "ranks": [9, 10],
                                       "external": False, "hosts": ["n1", "n1"]}
    assert placement.env_group_rows(["n0"] * 6 + ["n1"] * 6)[0] == (0, 1, "2-3", "n0")
    # An explicit rollout count that fits, too; without groups the record has no env role.
    assert Layout(num_rollout_workers=2, ranks_per_env=1).resolve(5).count("env") == 2
    assert "env" not in Layout().resolve(3).record()["ranks"]


def test_a_world_env_groups_do_not_fit_is_one_line_with_the_sizes_that_would():
    with pytest.raises(LayoutError) as info:
        Layout(ranks_per_env=2, envs_per_rollout=4).resolve(12)
    assert str(info.value) == (
        "ranks_per_env 2 with num_envs_per_worker 4 needs 1 + R x (1 + 4 x 2) + 0 replay + "
        "0 learner ranks: 10, 19 or 28 for 1, 2 or 3 rollout ranks; the MPI world has 12. "
        "Launch with mpiexec -n 10 (or 19), or change ranks_per_env / num_envs_per_worker.")
    with pytest.raises(LayoutError, match="19 for 2 rollout ranks .*world has 12"):
        Layout(num_rollout_workers=2, ranks_per_env=2, envs_per_rollout=4).resolve(12)
    with pytest.raises(LayoutError, match="needs rollout ranks"):
        Layout(num_rollout_workers=0, ranks_per_env=2).resolve(3)
    with pytest.raises(ConfigError, match="ranks_per_env must be >= 0"):
        Layout(ranks_per_env=-1)


def test_external_groups_are_consecutive_solver_ranks_owned_by_rollout_index():
    placement = Layout(ranks_per_env=2, envs_per_rollout=2).resolve(3, solver_ranks=8)
    assert placement.roles == ("driver", "rollout", "rollout")
    assert [(g.rollout_rank, g.members, g.external) for g in placement.env_groups] == [
        (1, (0, 1), True), (1, (2, 3), True), (2, (4, 5), True), (2, (6, 7), True)]
    assert placement.group_of(1) is None and placement.env_groups[3].describe() == (
        "env group 3 (solver ranks 6-7)")
    assert placement.summary() == ("driver 1, rollout 2, replay 0, learner 0, solver 8 "
                                   "(4 groups x 2) (world size 3 + 8 solver ranks)")
    assert placement.record()["solver_ranks"] == 8
    local = Layout(ranks_per_env=2).resolve(1, solver_ranks=2)
    assert local.note() is None and local.groups_of(0)[0].members == (0, 1)
    with pytest.raises(LayoutError) as info:
        Layout(ranks_per_env=2, envs_per_rollout=4).resolve(3, solver_ranks=6)
    assert str(info.value).startswith("the MPMD job has 6 solver ranks; 2 rollout x 4 envs "
                                      "(num_envs_per_worker) x ranks_per_env 2 need 16.")
    with pytest.raises(LayoutError, match="ranks_per_env is 0"):
        Layout().resolve(2, solver_ranks=2)


def test_local_mode_runs_env_groups_in_process():
    placement = Layout(ranks_per_env=2, envs_per_rollout=4).resolve(1)
    assert placement.env_groups == () and placement.count("env") == 0
    assert placement.note() == (
        "local mode (world size 1) runs one in-process worker per role: ranks_per_env 2 -> envs "
        "in-process (k=1); launch 10 ranks (mpiexec -n 10) to run the layout as configured")
