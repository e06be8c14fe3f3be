"""The docs run as written: every fenced shell block (```bash, ```sh, ```shell, ```console) in
README.md and docs/*.md is run, the blocks of a page in order, or is marked just before it with
``<!-- docs-test: skip: REASON -->`` (the reason is required; each mark is a skipped case here, so
pytest's summary lists the marks and their reasons).

Each page runs in a fresh copy of the repository (the files git tracks or would track, so a clean
clone works as well as a working tree), with ``.venv`` a link to this venv, under
``bash -euo pipefail`` after ``source .venv/bin/activate``, as a reader would type them. Every
training run stops after MPIRL_MAX_ITERATIONS iterations, whatever its --stop says, so a page of
long examples takes seconds, and every board-game evaluation plays at most MPIRL_MAX_GAMES games,
whatever its --games says; CI is unset, as it is in a reader's shell."""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirl.jobs.launch import remove_dead_launchers_session_dirs

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARK = re.compile(r"^\s*<!--\s*docs-test:(.*?)-->\s*$")
#: One block's limit. The slowest block (a 9-rank tune, or Atari's CNN) takes well under it here.
BLOCK_TIMEOUT_S = 180
#: Training iterations per run: enough for a checkpoint, a progress row and a curve to plot.
MAX_ITERATIONS = "2"
#: Games per ``mpirl evaluate`` of a board-game checkpoint: one with each side moving first.
MAX_GAMES = "2"


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    mark: str | None  # what the docs-test comment just before it says, if any

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.text.splitlines() if line.strip()), "")

    @property
    def skip_reason(self) -> str | None:
        """The reason of a ``skip: REASON`` mark; ValueError for a mark that is not one."""
        if self.mark is None:
            return None
        match = re.fullmatch(r"\s*skip:\s*(\S.*?)\s*", self.mark)
        if not match:
            raise ValueError(f"{self.where}: the mark <!-- docs-test:{self.mark}--> is not "
                             "'<!-- docs-test: skip: REASON -->' with a reason")
        return match.group(1)

    def script(self) -> str:
        """What bash runs: the block itself, or a console block's ``$ `` commands (with their
        continuation lines), its output lines left out."""
        if self.language != "console":
            return self.text
        commands: list[str] = []
        continued = False
        for line in self.text.splitlines():
            if continued or line.startswith("$ "):
                commands.append(line if continued else line[2:])
                continued = line.rstrip().endswith("\\")
        return "\n".join(commands)


def shell_blocks(page: Path) -> list[Block]:
    """The page's shell blocks, in order, each with the docs-test mark on the last non-blank
    line before its fence."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence.group(2)):
            end += 1
        if fence.group(3) in SHELL_LANGUAGES:
            before = next((line for line in reversed(lines[:index]) if line.strip()), "")
            mark = MARK.match(before)
            indent = len(fence.group(1))
            text = "\n".join(line[indent:] for line in lines[index + 1:end])
            blocks.append(Block(page, index + 1, fence.group(3), text,
                                mark.group(1) if mark else None))
        index = end + 1
    return blocks


#: README blocks that a page of their own runs (their text; every block runs after the
#: activation, the README's first run names it too).
PPO_CARTPOLE = ("mpiexec -n 3 mpirl train --algo PPO --env CartPole-v1 "
                r"""--stop '{"episode_return_mean": 450}' \
    --run-dir runs/ppo-cartpole     # about 10 s here""")
MULTIAGENT_PPO_DQN = r"""mpiexec -n 4 mpirl train --algo PPO \
    --env mpirl.envs.examples:FourAgentCartPole --stop '{"policy_return_mean_min": 150}' \
    --config '{"num_learners": 2, "multiagent": {"policies": {"ppo": {"num_learners": 1},
              "dqn": {"algo": "DQN", "num_learners": 1}},
              "policy_mapping": {"cart_[02]": "ppo", "cart_[13]": "dqn"}}}'   # about 30 s here"""
IMPALA_BREAKOUT_HOUR = r"""mpiexec -n 3 mpirl train --algo IMPALA --env ALE/Breakout-v5 \
    --config @examples/tuned/impala_breakout.json --stop '{"time_total_s": 3600}'   # an hour"""
PBT_CARTPOLE = r"""mpiexec -n 9 mpirl tune --scheduler pbt \
    --population 4 --ranks-per-trial 2 --perturbation-interval 10 \
    --mutations '{"lr": [1e-4, 3e-4, 1e-3], "ent_coef": {"uniform": [0, 0.01]}}' \
    -- --algo PPO --env CartPole-v1 --stop '{"timesteps_total": 300000}'""" \
    "   # about 2.5 minutes here"

#: Blocks another test, or another page's block, runs as written (the same commands on as many
#: ranks; a --run-dir added at most, which names the run's folder and nothing else), by page and
#: their text: not run here again while their text is the one recorded (a block edited since runs
#: here again, and test_a_block_run_elsewhere_is_still_on_its_page_and_run_there fails until the
#: entry is updated). Each names where it runs and the lines there that run it.
RUN_ELSEWHERE = {
    ("docs/python-api.md",
     "mpiexec -n 3 python examples/train_ppo.py     # a driver and two rollout ranks\n"
     "python examples/train_ppo.py                  # local mode: one process, no mpiexec"):
    # examples/train_ppo.py under mpiexec -n 3 and in local mode, with a run directory named.
    ("tests/test_api.py", "test_train_example", "def test_train_example(",
     '@pytest.mark.parametrize("ranks", [1, 3])', 'EXAMPLES / "train_ppo.py"'),
    ("docs/algorithms.md",
     "mpiexec -n 3 mpirl train --algo AlphaZero --env openspiel/tic_tac_toe \\\n"
     "  --stop '{\"training_iteration\": 60}'      # about 20 s here; then 0 losses to minimax"):
    ("docs/alphazero.md", "its first block, with --run-dir runs/alphazero-ttt",
     "mpiexec -n 3 mpirl train --algo AlphaZero --env openspiel/tic_tac_toe \\\n"
     "  --run-dir runs/alphazero-ttt --stop '{\"training_iteration\": 60}'\n"),
    # The first run of the README and of install.md, after the activation every block has.
    ("docs/install.md",
     "source .venv/bin/activate\n"
     "mpiexec -n 3 mpirl train --algo PPO --env CartPole-v1 "
     "--stop '{\"episode_return_mean\": 450}'"):
    ("docs/algorithms.md", "its first block, with --run-dir runs/ppo-cartpole", PPO_CARTPOLE),
    ("README.md", "source .venv/bin/activate\n" + PPO_CARTPOLE):
    ("docs/algorithms.md", "its first block", PPO_CARTPOLE),
    ("README.md", MULTIAGENT_PPO_DQN): ("docs/multiagent.md", "its PPO and DQN composition",
                                        MULTIAGENT_PPO_DQN),
    ("README.md", IMPALA_BREAKOUT_HOUR): ("docs/atari.md", "its first run", IMPALA_BREAKOUT_HOUR),
    ("README.md", PBT_CARTPOLE): ("docs/tune.md", "its first block", PBT_CARTPOLE),
}


def run_elsewhere(block: Block) -> str | None:
    """Where ``block`` runs as written, if elsewhere."""
    entry = RUN_ELSEWHERE.get((str(block.page.relative_to(REPO)), block.text))
    return None if entry is None else f"{entry[0]} ({entry[1]})"


ALL_BLOCKS = [block for page in PAGES for block in shell_blocks(page)]
PAGES_WITH_BLOCKS = [page for page in PAGES if shell_blocks(page)]


def copy_of_the_repository(destination: Path) -> None:
    """The files git tracks or would track (not the ignored ones: .venv, runs/, builds), as a
    clean clone has them, and .venv as a link to the venv running this test."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if not source.exists() and not source.is_symlink():
            continue  # tracked but deleted in this working tree
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    (destination / ".venv").symlink_to(Path(sys.prefix))


def block_environment(activate: Path, home: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    # HOME in the copy: what the blocks write there (MLflow's database, W&B's settings) goes away
    # with it.
    env.update(MPIRL_MAX_ITERATIONS=MAX_ITERATIONS, MPIRL_MAX_GAMES=MAX_GAMES,
               PYTHONUNBUFFERED="1", HOME=str(home))
    if "OMPI_ALLOW_RUN_AS_ROOT" in activate.read_text():
        # make ran as root and activate says what Open MPI needs: rely on it, as the docs do.
        env.pop("OMPI_ALLOW_RUN_AS_ROOT", None)
        env.pop("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", None)
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> None:
    remove_dead_launchers_session_dirs()  # what killed launchers left could fail a launch
    script = "source .venv/bin/activate\n" + block.script() + "\n"
    started = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # A session of its own, so that a timeout ends mpiexec and every rank it started.
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{block.where}: the block `{block.first_line}` ran past {BLOCK_TIMEOUT_S} s;"
                    f" its output ended:\n{output[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    print(f"{block.where}: `{block.first_line}` exit {proc.returncode}, "
          f"{time.monotonic() - started:.1f} s, {cpu_s:.1f} CPU-s")
    if proc.returncode != 0:
        pytest.fail(f"{block.where}: the block `{block.first_line}` exited with "
                    f"{proc.returncode}; its output ended:\n{output[-3000:]}")


@pytest.mark.parametrize("page", PAGES_WITH_BLOCKS, ids=lambda page: page.relative_to(REPO).name)
def test_the_page_s_shell_blocks_run_in_order(page: Path, tmp_path: Path):
    blocks = shell_blocks(page)
    for block in blocks:
        block.skip_reason  # noqa: B018  (a mark without a reason fails the page too)
    copy_of_the_repository(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    env = block_environment(tmp_path / ".venv" / "bin" / "activate", home)
    for block in blocks:
        if block.skip_reason is None and run_elsewhere(block) is None:
            run_block(block, tmp_path, env)
        elif block.skip_reason is None:
            print(f"{block.where}: `{block.first_line}` is run by {run_elsewhere(block)}")


@pytest.mark.parametrize("block", [block for block in ALL_BLOCKS if block.mark is not None],
                         ids=lambda block: block.where)
def test_a_block_left_out_says_why(block: Block):
    """One skipped case per mark, so that the summary (-ra) lists every block not run and why."""
    reason = block.skip_reason  # ValueError, failing this case, for a mark without a reason
    pytest.skip(f"{block.where} `{block.first_line}` not run: {reason}")


@pytest.mark.parametrize("where", RUN_ELSEWHERE, ids=lambda where: where[0])
def test_a_block_run_elsewhere_is_still_on_its_page_and_run_there(where):
    page, text = where
    assert text in [block.text for block in shell_blocks(REPO / page)], (
        f"{page}: the block recorded in RUN_ELSEWHERE changed (it runs here again): check that "
        f"{RUN_ELSEWHERE[where][0]} still runs it as written, and update the entry")
    covering, _, *lines = RUN_ELSEWHERE[where]
    source = (REPO / covering).read_text()
    assert all(line in source for line in lines), (covering, lines)
    if covering.endswith(".md"):  # a page's block that its page's case runs, not one left out
        running = [block.text for block in shell_blocks(REPO / covering)
                   if block.mark is None and run_elsewhere(block) is None]
        assert all(any(line in text for text in running) for line in lines), (covering, lines)


def test_the_marks_are_read():
    """A mark with a reason is read as one; one without, or a typo, is an error naming it."""
    page = REPO / "README.md"
    assert Block(page, 1, "bash", "x", " skip: needs a GPU ").skip_reason == "needs a GPU"
    for mark in (" skip ", " skip: ", " skipp: a GPU "):
        with pytest.raises(ValueError, match="README.md:1: the mark"):
            _ = Block(page, 1, "bash", "x", mark).skip_reason
    console = Block(page, 1, "console", "$ mpirl a \\\n    --b\noutput\n$ ls", None)
    assert console.script() == "mpirl a \\\n    --b\nls"
