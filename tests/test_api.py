"""The Python API (mpirl.train, mpirl.Algorithm), the examples/ scripts, and plug-in algorithms
run through the CLI with its checkpoints, resume, signals, dumps and Slurm rendering."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BIN, latest_checkpoint_iteration, mpi_env, mpiexec_command, run_mpi

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
PLUGINS = EXAMPLES / "plugins"
MPIRL = str(BIN / "mpirl")


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "progress.csv") as file:
        return list(csv.DictReader(file))


def run_local(*args: str, timeout: float = 180, env: dict | None = None
              ) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([*args], capture_output=True, text=True, timeout=timeout,
                              env=mpi_env(env), cwd=REPO)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{' '.join(args)} hung for {timeout} s:\n{error.stdout}\n{error.stderr}")


def run_script(script: Path, run_dir: Path, ranks: int) -> subprocess.CompletedProcess:
    """``python SCRIPT RUN_DIR`` in local mode (1 rank) or under ``mpiexec -n ranks``."""
    if ranks == 1:
        proc = run_local(sys.executable, str(script), str(run_dir))
    else:
        proc = run_mpi(ranks, sys.executable, str(script), str(run_dir), timeout=240)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.parametrize("ranks", [1, 3])
def test_train_example(tmp_path, ranks):
    run_dir = tmp_path / "run"
    proc = run_script(EXAMPLES / "train_ppo.py", run_dir, ranks)
    # Rank 0 alone prints the returned row; the others got None.
    printed = [x for x in proc.stdout.splitlines() if x.startswith("episode_return_mean ")]
    result = json.loads((run_dir / "result.json").read_text())
    assert printed == [f"episode_return_mean {result['episode_return_mean']:.1f} after "
                       f"{result['timesteps_total']} env steps"]
    assert len(rows(run_dir)) == result["iteration"]
    params = json.loads((run_dir / "params.json").read_text())
    assert params["algo"] == "PPO" and params["world_size"] == ranks
    assert list(run_dir.glob("events.out.tfevents.*"))
    if ranks > 1:
        _assert_rollout_ranks_import_no_torch(run_dir)


def _assert_rollout_ranks_import_no_torch(run_dir: Path) -> None:
    """A rollout rank of a script acts in NumPy and imports no torch, as under the CLI (about
    70 MB; torch alone takes 200): every rank used to check the request, importing torch."""
    sizes = [float(row["perf/max_rollout_rss_mb"]) for row in rows(run_dir)]
    assert max(sizes) < 150, sizes


@pytest.mark.parametrize("ranks", [1, 3])
def test_step_by_step_example(tmp_path, ranks):
    run_dir = tmp_path / "run"
    proc = run_script(EXAMPLES / "step_by_step.py", run_dir, ranks)
    # Only rank 0 runs past build(): one line per iteration, one greedy episode.
    assert proc.stdout.count("greedy episode return") == 1
    iterations = [line for line in proc.stdout.splitlines() if line.startswith("iteration ")]
    assert len(iterations) == len(rows(run_dir)) >= 1
    assert latest_checkpoint_iteration(run_dir) == len(iterations)
    if ranks > 1:
        _assert_rollout_ranks_import_no_torch(run_dir)


STEP_PROGRAM = """
import sys, mpirl
algo = mpirl.Algorithm.build("PPO", "CartPole-v1", run_dir=sys.argv[1],
                             config={"num_envs_per_worker": 2, "rollout_fragment_length": 16})
first = algo.train()
saved = algo.save()
second = algo.train()
restored = algo.restore(saved)
third = algo.train()
actions = algo.compute_actions([[0.0, 0.0, 0.0, 0.0]] * 5)
assert actions.shape == (5,) and set(actions.tolist()) <= {0, 1}, actions
code = algo.stop()
try:
    algo.train()
except mpirl.MpirlError as error:
    after_stop = str(error)
print("RESULT", [first["iteration"], second["iteration"], third["iteration"],
                 third["timesteps_total"] == second["timesteps_total"], code, after_stop])
"""


@pytest.mark.parametrize("ranks", [1, 3])
def test_algorithm_save_restore_and_actions(tmp_path, ranks):
    program = tmp_path / "step.py"
    program.write_text(STEP_PROGRAM)
    proc = run_script(program, tmp_path / "run", ranks)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    first, second, third, same_steps, code, after_stop = eval(line[len("RESULT "):])
    # Restoring the checkpoint of iteration 1 puts the counters back: the next one is 2 again.
    assert (first, second, third, same_steps, code) == (1, 2, 2, True, 0)
    assert "stopped" in after_stop


def test_train_rejects_bad_input_with_its_own_message(tmp_path):
    program = ("import mpirl\n"
               "for kwargs in [dict(algo='PPO', env='CartPole-v1', config={'lrr': 1}),\n"
               "               dict(algo='no_such_algo', env='CartPole-v1'),\n"
               "               dict(algo='PPO', env='NoSuchEnv-v0')]:\n"
               "    try:\n"
               "        mpirl.train(**kwargs)\n"
               "    except mpirl.ConfigError as error:\n"
               "        print('ERROR', error)\n")
    proc = run_local(sys.executable, "-c", program, timeout=120)
    assert proc.returncode == 0, proc.stderr
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 3, proc.stdout
    assert "lrr" in errors[0]
    assert "unknown algorithm 'no_such_algo'" in errors[1] and "PYTHONPATH" in errors[1]
    assert "NoSuchEnv-v0" in errors[2]


UNCAUGHT_PROGRAM = """
import sys
import mpirl
from mpi4py import MPI

try:
    mpirl.train("PPO", "CartPole-v1", config={"lrr": 1})
except mpirl.ConfigError as error:
    print("CAUGHT", MPI.COMM_WORLD.Get_rank(), "'lrr'" in str(error), "torch" in sys.modules,
          flush=True)
mpirl.train("PPO", "CartPole-v1", run_dir=sys.argv[1])
"""


def test_an_uncaught_config_error_reads_as_one_line_on_rank_0(tmp_path):
    """docs/python-api.md's example run twice with its run_dir ended in a 12-line traceback on
    every rank. Under mpiexec rank 0 alone checks the request (and imports torch); every rank
    raises the ConfigError it found, and uncaught it is one line and exit code 2."""
    program, run_dir = tmp_path / "train.py", tmp_path / "run"
    program.write_text(UNCAUGHT_PROGRAM)
    run_dir.mkdir()
    (run_dir / "progress.csv").write_text("iteration\n1\n")
    proc = run_mpi(3, sys.executable, str(program), str(run_dir), timeout=120)
    caught = sorted(line for line in proc.stdout.splitlines() if line.startswith("CAUGHT"))
    assert caught == ["CAUGHT 0 True True", "CAUGHT 1 True False", "CAUGHT 2 True False"], \
        proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "mpirl." in line]
    assert errors == [f"{program}:11: mpirl.ConfigError: run directory {run_dir} already holds "
                      f"a run (progress.csv); nothing was overwritten. Continue it with --resume "
                      f"{run_dir}, choose a new --run-dir, or leave it out for a fresh "
                      f"timestamped one."], proc.stderr
    assert "Traceback" not in proc.stderr and proc.returncode == 2, proc.stderr


# Plug-in algorithms through the CLI.

PLUGIN_ENV = {"PYTHONPATH": str(PLUGINS)}


def plugin_train(n: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_mpi(n, MPIRL, "train", "--progress", "plain", *args, timeout=timeout,
                   env=PLUGIN_ENV)


def test_plugin_checkpoints_dumps_stops_on_a_signal_and_resumes(tmp_path):
    """A plug-in run with its own config key, checkpoints and dumps: SIGUSR1 to mpiexec after two
    iterations checkpoints it where it is and exits 75; --resume goes on to two more and
    checkpoints at the end."""
    run_dir, dumps = tmp_path / "run", tmp_path / "dumps"
    command = mpiexec_command(3, MPIRL, "train", "--progress", "plain", "--algo", "vanilla_pg",
                              "--env", "CartPole-v1", "--run-dir", str(run_dir),
                              "--dump-trajectories", str(dumps),
                              "--config", '{"checkpoint_every": 2, "sgd_steps": 2}',
                              "--stop", '{"timesteps_total": 100000000}')
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(PLUGIN_ENV))
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "progress.csv").exists() or len(rows(run_dir)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "no progress"
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)  # mpiexec forwards it to every rank
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    stopped_at = latest_checkpoint_iteration(run_dir)
    assert stopped_at >= 2
    params = json.loads((run_dir / "params.json").read_text())
    assert params["algo"] == "vanilla_pg" and params["config"]["sgd_steps"] == 2
    assert "policy_loss" in rows(run_dir)[0]
    inspect = run_local(MPIRL, "inspect", str(dumps), "--json")
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["episodes"] > 0
    proc = plugin_train(3, "--resume", str(run_dir), "--stop",
                        json.dumps({"training_iteration": stopped_at + 2}))
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout
    assert [int(r["iteration"]) for r in rows(run_dir)] == list(range(1, stopped_at + 3))
    assert latest_checkpoint_iteration(run_dir) == stopped_at + 2


def test_plugin_slurm_script(tmp_path):
    proc = run_local(MPIRL, "slurm", "--time", "00:10:00", "--nodes", "1", "--",
                     "train", "--algo", "vanilla_pg", "--env", "CartPole-v1",
                     env=PLUGIN_ENV)
    assert proc.returncode == 0, proc.stderr
    assert "--algo vanilla_pg" in proc.stdout


def test_plugin_errors(tmp_path):
    """A missing plug-in through the CLI; a module that is no algorithm in-process, through the
    make_request that ``mpirl train`` calls first."""
    from mpirl.commands.train import make_request
    from mpirl.errors import ConfigError

    proc = run_local(MPIRL, "train", "--algo", "no_such_plugin", "--env", "CartPole-v1",
                     timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "no module named 'no_such_plugin'" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(ConfigError) as raised:
        make_request("json", "CartPole-v1", None, {}, {}, None, str(tmp_path / "run"))
    assert raised.value.exit_code == 2
    assert "algorithm module 'json' does not define Config (nor loss, ROLLOUT_WORKER" in str(
        raised.value)
