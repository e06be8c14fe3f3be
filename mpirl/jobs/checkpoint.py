"""Checkpoints: everything a run needs to continue identically, written so that a crash at any
moment leaves the previous checkpoint intact.

A run directory holds::

    checkpoints/
      checkpoint_000040/      one directory per checkpoint, named by iteration
        manifest.json         format version, mpirl version, algorithm, env, config, counters,
                              layout, and the SHA-256 and size of every file below
        driver.pkl            the driver's counters, episode windows, normalizer statistics, RNGs
        learner_0.pkl ...     each learner's weights, optimizer state and RNGs
        rollout_0.pkl ...     each rollout worker's environments, RNGs and episodes in progress
      latest                  the name of the newest checkpoint, moved last

What crosses ranks: the driver sends each worker the temporary directory; every worker writes its
own file there in parallel (on a cluster the run directory is on a shared file system) and
answers with the file's checksum. The driver then writes the manifest, fsyncs, renames the
directory into place and moves ``latest``. A checkpoint directory without a manifest, or whose
files do not match their checksums, is never used.

Files are pickled straight into the file and hashed as they are written, and checked by hashing
from disk in 1 MiB pieces: neither a worker writing nor the driver verifying holds a second copy.
An iteration written again (a resumed run) moves the old directory aside before the new one
takes its name, so a kill at any point leaves one whole copy (``CheckpointStore.recover``).

Trust: a checkpoint is code. Its files are pickles and its manifest names a module that is
imported, so loading one (``--resume``, ``mpirl evaluate``) runs whatever its author put there.
Load only your own; share a policy as an exported file (``mpirl.commands.export``) instead.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpirl.errors import CheckpointError
from mpirl.jobs.run_dir import fsync_directory, json_default
from mpirl.runtime.state_files import check_file

__all__ = ["capture_rng", "restore_rng"]

#: Bumped when the layout of checkpoint files changes incompatibly. 2: rollout workers keep
#: their envs in a sampling core (``mpirl.workers.env_runner``), plans their own state.
FORMAT_VERSION = 2
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
#: Prefix of a checkpoint moved aside while its iteration is written again.
TRASH = ".trash-"
_NAME = re.compile(r"^checkpoint_(\d{6,})$")


@dataclass(frozen=True)
class CheckpointSettings:
    """When checkpoints are written and how many are kept. Every field is a config key."""

    checkpoint_every: int = 20
    """Write a checkpoint every this many iterations; 0 writes none periodically."""
    checkpoint_at_end: bool = True
    """Write a checkpoint when a stop criterion is met."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep (at least 1)."""
    checkpoint_replay: bool = True
    """Include replay buffer contents, for algorithms that have replay."""

    def __post_init__(self) -> None:
        from mpirl.errors import ConfigError

        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be >= 0 (0 turns periodic checkpoints off), "
                              f"got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")


def capture_rng() -> dict[str, Any]:
    """This process's global random states: Python's, NumPy's and, where torch is loaded,
    torch's (CPU and CUDA). A process that never imported torch (a rollout rank acting in
    NumPy) has no torch state to keep, and is not made to import it."""
    state = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is None or "torch" not in state:
        return  # nothing here draws from torch (or nothing did when the state was saved)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def checkpoint_name(iteration: int) -> str:
    return f"checkpoint_{iteration:06d}"


class CheckpointStore:
    """The ``checkpoints/`` directory of one run: writes, verifies, lists and prunes."""

    def __init__(self, run_dir: str | Path, keep: int = 3) -> None:
        self.root = Path(run_dir) / CHECKPOINTS
        self.keep = keep

    def begin(self, iteration: int) -> Path:
        """A fresh temporary directory for the checkpoint of ``iteration``."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{checkpoint_name(iteration)}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, manifest: dict[str, Any]) -> Path:
        """Write the manifest into ``tmp``, move it into place, point ``latest`` at it, prune."""
        manifest = {"format_version": FORMAT_VERSION, **manifest}
        text = json.dumps(manifest, indent=2, sort_keys=True, default=json_default) + "\n"
        _write_synced(tmp / MANIFEST, text.encode("utf-8"))
        fsync_directory(tmp)
        final = self.root / checkpoint_name(manifest["iteration"])
        trash = self.root / f"{TRASH}{final.name}"
        if final.exists():  # a resumed run redoing an iteration it had checkpointed before
            # Moved aside, not deleted: a kill at any point leaves one whole copy (see recover).
            if trash.exists():
                shutil.rmtree(trash)
            os.rename(final, trash)
        os.rename(tmp, final)
        fsync_directory(self.root)
        pointer = self.root / f".{LATEST}.tmp"
        _write_synced(pointer, f"{final.name}\n".encode())
        os.replace(pointer, self.root / LATEST)
        fsync_directory(self.root)
        if trash.exists():
            shutil.rmtree(trash)
        self.prune(keep_name=final.name)
        return final

    def recover(self) -> list[str]:
        """Put back what a job killed inside ``commit`` left: a checkpoint moved aside whose
        replacement never arrived goes back in place, and half-written directories go.

        Call it only while holding the run directory's lock (another live job's temporary
        directories look the same). Returns one note per checkpoint put back."""
        if not self.root.is_dir():
            return []
        notes = []
        for trash in sorted(self.root.glob(f"{TRASH}checkpoint_*")):
            final = self.root / trash.name[len(TRASH):]
            if final.exists():  # the swap finished; only the old copy's deletion was cut short
                shutil.rmtree(trash)
            else:
                os.rename(trash, final)
                notes.append(f"put back {final.name}, which a killed job had moved aside")
        for stale in self.root.glob(".tmp-checkpoint_*"):
            shutil.rmtree(stale, ignore_errors=True)
        fsync_directory(self.root)
        return notes

    def prune(self, keep_name: str | None = None) -> None:
        """Delete all but the newest ``keep`` checkpoints, and stale temporary directories."""
        for stale in self.root.glob(".tmp-checkpoint_*"):
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)
        for old in self.list()[self.keep:]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    def list(self) -> list[Path]:
        """Checkpoint directories, newest first (by iteration, the ``latest`` pointer first)."""
        if not self.root.is_dir():
            return []
        found = sorted((p for p in self.root.iterdir() if _NAME.match(p.name) and p.is_dir()),
                       key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)
        latest = self.root / LATEST
        if latest.is_file():
            name = latest.read_text(encoding="utf-8").strip()
            found.sort(key=lambda p: p.name != name)  # stable: the pointed-to one goes first
        return found

    def newest_valid(self, warn=None) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that verifies, or None if there are none at all.

        Each corrupt one is reported through ``warn(message)`` and skipped. If checkpoints
        exist but none verifies, raises ``CheckpointError`` listing what was wrong with each.
        """
        problems = []
        for path in self.list():
            try:
                return path, verify(path)
            except CheckpointError as error:
                problems.append(str(error))
                if warn is not None:
                    warn(f"skipping checkpoint {path.name}: {error}")
        if problems:
            raise CheckpointError(
                f"no valid checkpoint in {self.root}; every one failed verification:\n  "
                + "\n  ".join(problems)
            )
        return None


def verify(path: str | Path) -> dict[str, Any]:
    """Read and check a checkpoint directory; return its manifest or raise CheckpointError."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST} (not a checkpoint, or its write was "
                              f"interrupted)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({error})") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        import mpirl

        writer = manifest.get("mpirl_version", "an unknown version")
        raise CheckpointError(
            f"{path} was written by mpirl {writer} in checkpoint format {version!r}; this mpirl "
            f"({mpirl.__version__}) reads format {FORMAT_VERSION}. Resume it with mpirl "
            f"{writer} (pip install mpirl=={writer}), or start a new run")
    for name, entry in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        check_file(file, entry)
    return manifest


def manifest_header(algo: str, env: Any, config: Any, iteration: int,
                    timesteps_total: int, layout: dict[str, int]) -> dict[str, Any]:
    """The descriptive part of a manifest (files are added by the writer)."""
    import dataclasses

    import mpirl

    return {
        "mpirl_version": mpirl.__version__, "algo": algo,
        "env": {"env_id": env.env_id, "env_module": env.env_module,
                "env_config": dict(env.env_config)},
        "config": dataclasses.asdict(config), "iteration": iteration,
        "timesteps_total": timesteps_total, "layout": layout,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
        "python": sys.version.split()[0],
    }
