"""DumpIndex: rank 0 links every rank's episode file into main_data.hdf5 and metadata.json after
each iteration."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import h5py

from mpirl.data.dump_format import (
    MAIN_FILE,
    METADATA_FILE,
    MINARI_FORMAT_VERSION,
    QUARANTINE_KEY,
    QUARANTINE_SUFFIX,
    RANK_FILE_RE,
    open_hdf5,
    rank_files,
    serialize_space,
)
from mpirl.data.dump_writer import DumpSettings, DumpTarget
from mpirl.data.journaled_file import JournaledFile
from mpirl.errors import ConfigError
from mpirl.jobs.run_dir import write_atomically


class DumpIndex:
    """The driver's side of a dump: picks the session number, and keeps ``main_data.hdf5``
    (external links, numbered contiguously) and ``metadata.json`` up to date."""

    def __init__(self, settings: DumpSettings, env_id: str, observation_space: gym.Space,
                 action_space: gym.Space, algorithm_name: str) -> None:
        assert settings.dump_trajectories is not None
        self.directory = Path(settings.dump_trajectories)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"dump_trajectories {self.directory}: cannot create it "
                              f"({error})") from None
        existing = rank_files(self.directory)
        # Quarantined files keep their session number: a new session never reuses a name.
        sessions = [int(match[1]) for p in self.directory.iterdir()
                    if (match := RANK_FILE_RE.match(p.name.removesuffix(QUARANTINE_SUFFIX)))]
        self.session = max(sessions, default=-1) + 1
        self.target = DumpTarget(str(self.directory), self.session,
                                 settings.dump_compression_level,
                                 settings.dump_compression_min_bytes,
                                 settings.dump_writer_process)
        self.env_id = env_id
        self.observation_space = observation_space
        self.action_space = action_space
        self.algorithm_name = algorithm_name
        self.pending: list[tuple[str, int]] = []
        #: Files quarantined in this directory so far (metadata.json's QUARANTINE_KEY).
        self.quarantined: list[dict[str, Any]] = []
        self.total_episodes, self.total_steps = self._reconcile(existing)
        self._write_metadata()

    def _reconcile(self, existing: list[Path]) -> tuple[int, int]:
        """Keep the links main_data.hdf5 holds; link the episodes of earlier sessions that it
        lacks (written after the last index update of a run that was killed); quarantine the
        files that cannot be read; return totals."""
        from mpirl.data.reader import DatasetError, open_dataset

        if not existing:
            with open_hdf5(self.directory / MAIN_FILE, "w", warn=True):
                pass
            return 0, 0
        try:
            dataset = open_dataset(self.directory)
        except DatasetError as error:
            raise ConfigError(f"dump_trajectories {self.directory} holds no readable trajectory "
                              f"file: {error}. Choose a new directory.") from None
        with dataset:
            self.quarantined = list(dataset.metadata.get(QUARANTINE_KEY, []))
            for damaged in dataset.damaged:
                self.quarantined.append(self._quarantine(damaged))
            if (dataset.env_id not in (None, self.env_id)
                    or dataset.observation_space not in (None, self.observation_space)
                    or dataset.action_space not in (None, self.action_space)):
                raise ConfigError(
                    f"dump_trajectories {self.directory} holds a dump of {dataset.env_id} "
                    f"(observations {dataset.observation_space}, actions "
                    f"{dataset.action_space}), not of {self.env_id}; choose a new directory")
            links = [(file.name, f"episode_{k}") for file, k in dataset.episode_refs]
            steps = dataset.total_steps
        tmp = self.directory / (MAIN_FILE + ".tmp")
        with open_hdf5(tmp, "w", warn=True) as main:
            for g, (file_name, group) in enumerate(links):
                main[f"episode_{g}"] = h5py.ExternalLink(file_name, group)
        os.replace(tmp, self.directory / MAIN_FILE)
        return len(links), steps

    def _quarantine(self, damaged: Any) -> dict[str, Any]:
        """Rename a damaged file (an ``mpirl.data.reader.DamagedFile``) out of the dump, so that no
        later open trips on it; warn (the driver is the only rank that prints); return its
        metadata.json record."""
        path = damaged.path
        target = path.with_name(path.name + QUARANTINE_SUFFIX)
        n = 0
        while target.exists() or target.is_symlink():
            n += 1
            target = path.with_name(f"{path.name}{QUARANTINE_SUFFIX}.{n}")
        renamed: str | None = None
        if not (path.exists() or path.is_symlink()):
            where = "it is missing"
        else:
            try:
                os.replace(path, target)
                renamed, where = target.name, f"renamed to {target.name}"
            except OSError as error:
                where = f"left in place: cannot rename it ({error})"
        print(f"mpirl: warning: trajectory dump {self.directory}: {damaged.describe()}; "
              f"quarantined ({where}) and left out of {MAIN_FILE}", file=sys.stderr, flush=True)
        return {"file": path.name, "renamed_to": renamed, "reason": damaged.reason,
                "episodes_lost": damaged.episodes_lost}

    def add(self, file_name: str, episodes: list[tuple[int, int]]) -> None:
        """Episodes (local id, steps) that a rollout worker wrote to ``file_name``."""
        for k, steps in episodes:
            self.pending.append((file_name, k))
            self.total_steps += steps

    def commit(self) -> None:
        """Link the episodes added since the last commit; rewrite metadata.json atomically.
        main_data.hdf5 is written through a journal, as the episode files are: a driver killed
        here leaves the links of the last commit, or of this one."""
        if not self.pending:
            return
        path = self.directory / MAIN_FILE
        if not path.exists():  # removed under a running job
            with open_hdf5(path, "w", warn=True):
                pass
        handle = JournaledFile(path)
        try:
            with h5py.File(handle, "r+") as main:
                total = self.total_episodes
                for file_name, k in self.pending:
                    main[f"episode_{total}"] = h5py.ExternalLink(file_name, f"episode_{k}")
                    total += 1
        except BaseException:
            handle.close()
            raise
        handle.commit()
        self.total_episodes = total
        self.pending.clear()
        self._write_metadata()

    def _write_metadata(self) -> None:
        import mpirl

        metadata: dict[str, Any] = {
            "dataset_id": f"mpirl/{_slug(self.env_id)}-v0",
            "total_episodes": self.total_episodes,
            "total_steps": self.total_steps,
            "data_format": "hdf5",
            "observation_space": serialize_space(self.observation_space),
            "action_space": serialize_space(self.action_space),
            "minari_version": MINARI_FORMAT_VERSION,
            "algorithm_name": f"mpirl {self.algorithm_name}",
            "dataset_size": round(_size_mb(self.directory), 1),
            "mpirl_version": mpirl.__version__,
            "mpirl_env_id": self.env_id,
        }
        if self.quarantined:
            metadata[QUARANTINE_KEY] = self.quarantined
        env_spec = _env_spec_json(self.env_id)
        if env_spec is not None:
            metadata["env_spec"] = env_spec
        write_atomically(self.directory / METADATA_FILE, json.dumps(metadata))


def _slug(env_id: str) -> str:
    name = re.sub(r"-v\d+$", "", env_id.split(":")[-1])
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "env"


def _env_spec_json(env_id: str) -> str | None:
    if env_id not in gym.registry:
        return None
    try:
        return gym.spec(env_id).to_json()
    except Exception as error:  # noqa: BLE001 - an env's kwargs may not be JSON
        print(f"mpirl: warning: the env spec of {env_id} cannot be saved in the trajectory "
              f"dump's metadata ({error})", file=sys.stderr, flush=True)
        return None


def _size_mb(directory: Path) -> float:
    """The files' total size; a file that goes while it is counted counts 0: the rollout ranks'
    writers rename their journals' temporary files as they please (seen by chaos.py)."""
    total = 0
    for path in directory.iterdir():
        try:
            if path.is_file():
                total += path.stat().st_size
        except FileNotFoundError:
            continue
    return total / 1e6
