"""No parser takes an abbreviated option: ``mpirl train --run DIR`` is an error, not --run-dir.

``mpirl launch`` and ``mpirl slurm`` read --run-dir, --resume and --config from the job's
command by their exact spelling; had mpirl accepted ``--run``, the job would have used another
run directory than the one they resume. Every option of every parser (mpirl's subcommands and
the benchmarks' scripts) is tried with an abbreviation that argparse would have taken: each must
end with exit code 2 and argparse's "unrecognized arguments", before anything runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BIN, mpi_env

from mpirl.cli import _parser

MPIRL = str(BIN / "mpirl")
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TRAIN = ["train", "--algo", "PPO", "--env", "CartPole-v1", "--stop", '{"training_iteration": 1}']


def abbreviation(option: str, options: list[str]) -> str | None:
    """The longest strict prefix of ``option`` that argparse would have completed to it alone."""
    for end in range(len(option) - 1, 2, -1):
        prefix = option[:end]
        if prefix not in options and [o for o in options if o.startswith(prefix)] == [option]:
            return prefix
    return None


def abbreviated_command_lines(parser: argparse.ArgumentParser,
                              words: tuple[str, ...] = ()) -> Iterator[tuple[list[str], str]]:
    """(argv, abbreviation) for every long option of ``parser`` and of its subcommands: the
    abbreviation, then whatever else the parser requires, so that only the abbreviation is
    wrong."""
    options = [s for a in parser._actions for s in a.option_strings]
    required, tail = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from abbreviated_command_lines(sub, (*words, name))
            tail = ["doctor"]  # for the top-level options
        elif not action.option_strings:
            tail += ["--", "true"] if action.nargs == argparse.REMAINDER else ["X"]
        elif action.required:
            required += [action.option_strings[-1], "10"]
    for action in parser._actions:
        for option in (s for s in action.option_strings if s.startswith("--")):
            short = abbreviation(option, options)
            if short is None:
                continue
            value = [] if action.nargs == 0 else [
                str(sorted(action.choices)[0]) if action.choices else "1"]
            # Required options first: a REMAINDER (launch, slurm) takes all from the value on.
            yield [*words, *required, short, *value, *tail], short


def assert_refused(parser: argparse.ArgumentParser, argv: list[str], short: str,
                   capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as caught:
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2, (argv, err)
    last = err.strip().splitlines()[-1]
    assert "error: unrecognized arguments: " in last and short in last.split(": ", 2)[-1], (
        argv, err)


def test_no_mpirl_option_can_be_abbreviated(capsys):
    lines = list(abbreviated_command_lines(_parser()))
    # Every subcommand is reached (the gaps were in subparsers), and some options of each.
    reached = {argv[0] for argv, _ in lines if not argv[0].startswith("-")}
    assert reached >= {"doctor", "train", "inspect", "evaluate", "launch", "slurm", "plot"}
    assert len(lines) > 40
    for argv, short in lines:
        assert_refused(_parser(), argv, short, capsys)


def benchmark_parsers(monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.ArgumentParser]:
    """The parser each benchmark's main() builds, taken at its parse_args (nothing runs)."""

    class Built(Exception):
        pass

    def stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise Built(self)

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    parsers = {}
    for path in sorted(BENCHMARKS.glob("*.py")):
        if "ArgumentParser(" not in path.read_text() or path.stem == "harness":
            continue
        spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look it up
        spec.loader.exec_module(module)
        with monkeypatch.context() as patch:
            patch.setattr(argparse.ArgumentParser, "parse_args", stop)
            with pytest.raises(Built) as built:
                module.main()
        parsers[path.stem] = built.value.args[0]
    return parsers


def test_no_benchmark_option_can_be_abbreviated(monkeypatch, capsys):
    parsers = benchmark_parsers(monkeypatch)
    assert set(parsers) >= {"dispatch", "learning", "recovery", "replay", "sampling",
                            "slurm_requeue", "straggler"}
    for name, parser in parsers.items():
        lines = list(abbreviated_command_lines(parser))
        assert lines, name
        for argv, short in lines:
            assert_refused(parser, argv, short, capsys)


def mpirl(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([MPIRL, *args], capture_output=True, text=True, timeout=timeout,
                          env=mpi_env(), cwd=cwd)


def test_train_refuses_run_for_run_dir(tmp_path):
    proc = mpirl(*TRAIN, "--run", "runs/foo", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "mpirl: error: unrecognized arguments: --run runs/foo" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_launch_stops_at_an_abbreviation_instead_of_resuming_another_directory(tmp_path):
    """launch reads --run-dir by its exact spelling; mpirl train refuses --run, and exit 2 is
    final: one attempt, no run directory of launch's choosing."""
    proc = mpirl("launch", "--max-restarts", "2", "--restart-delay", "0", "--",
                 MPIRL, *TRAIN, "--run", "runs/foo", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "unrecognized arguments: --run runs/foo" in proc.stderr
    assert "not restarting" in proc.stderr and "attempt 2" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_launch_refuses_an_abbreviation_of_its_own_options(tmp_path):
    proc = mpirl("launch", "--max", "3", "--", "touch", "ran", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "mpirl: error: unrecognized arguments: --max"
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--time", "10", "--nod", "2", "--", "doctor"], "mpirl: error: unrecognized arguments: --nod"),
    (["--time", "10", "--", *TRAIN, "--run", "runs/foo"],
     "mpirl slurm: error: the command after -- is not a valid mpirl train command: "
     "unrecognized arguments: --run runs/foo"),
    (["--time", "10", "--", "doctor", "--ping", "3"],
     "mpirl slurm: error: the command after -- is not a valid mpirl doctor command: "
     "unrecognized arguments: --ping 3"),
])
def test_slurm_refuses_abbreviations_before_rendering(tmp_path, args, message):
    proc = mpirl("slurm", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1] == message, proc.stderr


def test_subcommand_names_are_not_abbreviated_either(tmp_path):
    proc = mpirl("tra", "--help", cwd=tmp_path)
    assert proc.returncode == 2 and "invalid choice: 'tra'" in proc.stderr


def test_version_and_the_algorithms_train_help_names(tmp_path):
    """``mpirl --version`` prints the package's version; ``train --help`` names every built-in
    algorithm (a new one must be added to the help too)."""
    import mpirl
    from mpirl.execution.contract import ALGORITHMS

    proc = subprocess.run([MPIRL, "--version"], capture_output=True, text=True, timeout=60,
                          env=mpi_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"mpirl {mpirl.__version__}", proc.stdout
    help_text = " ".join(_parser()._subparsers._group_actions[0].choices["train"].format_help()
                         .split())
    missing = [name for name in ALGORITHMS if name not in help_text]
    assert not missing, f"train --help does not name {missing}"


def test_a_mistyped_command_or_choice_gets_a_did_you_mean(capsys):
    for argv, hint in ((["trian"], "Did you mean 'train'?"),
                       (["train", "--progress", "plian"], "Did you mean 'plain'?"),
                       (["xyzzy"], None)):
        with pytest.raises(SystemExit) as caught:
            _parser().parse_args(argv)
        assert caught.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert "invalid choice" in error, error
        assert (error.endswith(hint) if hint else "Did you mean" not in error), error
