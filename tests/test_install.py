"""Installing mpirl: the wheel and sdist that `python -m build` makes, the Open MPI defaults the
Makefile writes into the venv, and a script run next to a clone named mpirl."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from conftest import MPIEXEC, mpi_env

import mpirl

REPO = Path(__file__).resolve().parent.parent
PRTE_PARAMS = Path(sys.prefix) / "etc" / "prte-mca-params.conf"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel, the wheel built from the sdist (as `python -m build` does), so
    that a file the sdist leaves out fails here too. --no-isolation builds with this venv's
    setuptools instead of downloading one."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("the build package is not installed (pip install 'mpirl[dev]')")
    # From a copy: building the sdist writes mpirl.egg-info into the source tree.
    source = tmp_path_factory.mktemp("source") / "mpirl"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "site", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                           str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_the_wheel_holds_every_package_and_the_job_template(dist):
    [wheel] = dist.glob("mpirl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"mpirl/{path.relative_to(REPO / 'mpirl')}" for path in
               (REPO / "mpirl").rglob("*.py")}
    sources |= {f"mpirl/algorithms/{path.relative_to(REPO / 'algorithms')}"
                for path in (REPO / "algorithms").rglob("*.py")}
    assert sources - names == set(), "modules missing from the wheel (setup.py's packages)"
    assert "mpirl/jobs/templates/job.sbatch" in names
    # Only mpirl: no tests, benchmarks or a top-level "algorithms" package.
    assert {name.split("/")[0] for name in names} == {"mpirl", wheel.name.split("-py")[0] +
                                                      ".dist-info"}


def test_the_sdist_carries_the_tests_docs_and_changelog(dist):
    [sdist] = dist.glob("mpirl-*.tar.gz")
    names = {name.partition("/")[2] for name in tarfile.open(sdist).getnames()}
    for needed in ("setup.py", "pyproject.toml", "README.md", "CHANGELOG.md", "Makefile",
                   "docs/install.md", "docs/hooks.py", "tests/test_install.py",
                   "mpirl/jobs/templates/job.sbatch", "algorithms/ppo.py"):
        assert needed in names, f"{needed} is not in the sdist (MANIFEST.in)"


def test_the_wheel_alone_installs_a_working_mpirl(dist, tmp_path):
    """A clean venv whose only mpirl is the wheel's: its dependencies (torch, mpi4py, ...) come
    from this venv's site-packages through a path line in a .pth, which adds the folder without
    running its .pth files, so the editable install's finder never loads. Then mpirl --version,
    and one PPO iteration under mpiexec from a folder outside the repository."""
    started = time.monotonic()
    [wheel] = dist.glob("mpirl-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_path('purelib'))"], capture_output=True,
                          text=True, check=True).stdout.strip()
    Path(site, "dependencies-from-the-test-venv.pth").write_text(
        sysconfig.get_path("purelib") + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "--quiet", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # Found, not imported: outside mpiexec, mpi4py looks for the Open MPI library under this
    # venv's prefix, and the library lives in the test venv's (mpiexec tells the ranks where).
    where = subprocess.run(
        [str(python), "-c", "import sys, importlib.util, mpirl; print(mpirl.__file__); "
         "print(importlib.util.find_spec('mpirl.algorithms.ppo').origin); "
         "print(any('editable' in repr(finder) for finder in sys.meta_path))"],
        capture_output=True, text=True, cwd=outside, timeout=120)
    assert where.returncode == 0, where.stderr
    init, ppo, editable = where.stdout.split()
    assert init.startswith(site) and ppo.startswith(site), where.stdout
    assert editable == "False"
    assert Path(site, "mpirl", "jobs", "templates", "job.sbatch").is_file()

    version = subprocess.run([str(venv / "bin" / "mpirl"), "--version"], capture_output=True,
                             text=True, cwd=outside, timeout=60)
    assert version.stdout.strip() == f"mpirl {mpirl.__version__}", version.stdout + version.stderr

    env = mpi_env({"CI": "true"})
    env.pop("PYTHONPATH", None)
    train = subprocess.run(
        [str(MPIEXEC), "-n", "2", "--oversubscribe", "--bind-to", "none",
         str(venv / "bin" / "mpirl"), "train", "--algo", "PPO", "--env", "CartPole-v1",
         "--stop", '{"training_iteration": 1}', "--run-dir", "run"],
        capture_output=True, text=True, cwd=outside, timeout=180, env=env)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    assert "stopped: training_iteration reached (1)" in train.stdout
    assert (outside / "run" / "progress.csv").is_file()
    print(f"wheel into a clean venv, --version and one iteration: "
          f"{time.monotonic() - started:.1f} s")


def test_make_writes_open_mpis_defaults_once(tmp_path):
    """make mpi-defaults appends oversubscription and no binding to the venv's PRRTE parameter
    file, and as root the two variables Open MPI needs to activate, once however often it runs
    (-o: the install stamp counts as done)."""
    venv = tmp_path / "venv"
    (venv / "etc").mkdir(parents=True)
    params = venv / "etc" / "prte-mca-params.conf"
    params.write_text("# the wheel's own file\n")
    activate = venv / "bin" / "activate"
    activate.parent.mkdir()
    activate.write_text("# venv's own activate\n")
    for _ in range(2):
        proc = subprocess.run(["make", "--no-print-directory", "-o", f"{venv}/.mpirl-run",
                               "mpi-defaults", f"VENV={venv}"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    lines = params.read_text().splitlines()
    assert lines[0] == "# the wheel's own file"
    assert lines.count("rmaps_default_mapping_policy = :oversubscribe") == 1
    assert lines.count("hwloc_default_binding_policy = none") == 1
    # As root, activate lets Open MPI run as root (once); otherwise it is left alone.
    exports = activate.read_text().count(
        "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
    assert exports == (1 if os.geteuid() == 0 else 0)


@pytest.mark.skipif(not PRTE_PARAMS.is_file() or "rmaps_default_mapping_policy"
                    not in PRTE_PARAMS.read_text(),
                    reason="this venv's Open MPI has no defaults from make (run make install)")
def test_the_venvs_mpiexec_runs_9_ranks_on_any_machine_without_flags(tmp_path):
    env = mpi_env()
    env = {key: value for key, value in env.items() if not key.startswith(("OMPI_MCA_rmaps",
                                                                           "PRTE_MCA_"))}
    proc = subprocess.run([str(MPIEXEC), "-n", "9", sys.executable, "-c",
                           "import os; print(len(os.sched_getaffinity(0)))"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    # 9 ranks, each free to run on every core this test may use (none bound to one core).
    assert proc.stdout.split() == [str(len(os.sched_getaffinity(0)))] * 9


def test_a_script_beside_a_clone_named_mpirl_imports_the_package(tmp_path):
    """python script.py in the folder that holds the clone: the clone's folder (no __init__.py)
    must not become an empty namespace package called mpirl. An editable install needs the .pth
    that make writes; a wheel's regular package wins anyway."""
    (tmp_path / "mpirl").symlink_to(REPO, target_is_directory=True)
    script = tmp_path / "script.py"
    script.write_text("import mpirl\nprint(mpirl.__file__, hasattr(mpirl, 'train'))\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [mpirl.__file__, "True"], (
        f"{proc.stdout}: the clone's folder was imported as mpirl; run make install, which "
        "writes mpirl-editable-first.pth into the venv")
