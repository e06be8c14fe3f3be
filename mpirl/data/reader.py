"""Reading trajectory dumps (``dump_trajectories``): episodes one at a time, or shuffled batches.

Nothing here uses MPI; a data-parallel learner reads its own part with ``shard=(index, count)``.
Everything is lazy: an episode is read from disk when it is reached, so a dump may be larger than
memory. Bad input (a missing path, a truncated or foreign HDF5 file) raises ``DatasetError``,
which names the file.

    dataset = open_dataset("runs/dump")
    for episode in dataset.iterate_episodes():
        episode.observations  # (T+1, ...)
    batch = next(dataset.sample_batches(256, np.random.default_rng(0)))
    batch["obs"], batch["actions"], batch["action_logp"]

``Episode.id`` is the episode's number in the whole dump, unique across ranks (a group's ``id``
attribute is its number within its own file). The episodes are those ``main_data.hdf5`` links
to (numbered 0, 1, ... as Minari numbers them),
then those in the per-rank files that it does not link yet (a run killed between iterations
leaves some), in file order. Without ``main_data.hdf5`` the per-rank files alone make the dump.

A per-rank file that cannot be read is left out, with its episodes: ``Dataset.damaged`` names
it, why, and how many indexed episodes it held. Only a dump with no readable file is an error.
Reading changes the dump in one way only: a journal that a writer killed in its last commit left
(``mpirl.data.journaled_file``) is applied. A dumping run quarantines unreadable files when it
starts.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import h5py
import numpy as np

from mpirl.data.dump_format import (
    FORMAT_ATTR,
    MAIN_FILE,
    METADATA_FILE,
    deserialize_space,
    episode_number,
    open_hdf5,
    rank_files,
)
from mpirl.data.journaled_file import recover
from mpirl.errors import EXIT_USAGE, MpirlError

#: What every episode group holds (plus ``infos/``).
EPISODE_KEYS = ("observations", "actions", "rewards", "terminations", "truncations")
#: Keys of the batches ``sample_batches`` yields.
BATCH_KEYS = ("obs", "actions", "rewards", "next_obs", "terminations", "truncations",
              "action_logp")


class DatasetError(MpirlError):
    """A trajectory dump cannot be read: missing, truncated, corrupt, or not a dump at all."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class DamagedFile:
    """A data file of a dump that cannot be read, left out of the ``Dataset``."""

    path: Path
    reason: str
    """The reader's error, starting with the path."""
    episodes_lost: int | None
    """Episodes that ``main_data.hdf5`` links into it; None without a readable index."""

    def describe(self) -> str:
        lost = ("an unknown number of episodes (no readable main_data.hdf5 counts them)"
                if self.episodes_lost is None else f"{self.episodes_lost} indexed episodes")
        return f"{self.reason}; lost: {lost}"


@dataclass
class Episode:
    """One complete episode. ``observations`` has one row more than the other arrays."""

    id: int
    observations: Any
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    infos: dict[str, np.ndarray] = field(default_factory=dict)
    #: multi-agent dumps: the agent this episode is of, and the policy that drove it
    agent_id: str | None = None
    policy_id: str | None = None

    def __len__(self) -> int:
        return len(self.rewards)


class Dataset:
    """A trajectory dump opened for reading; use ``open_dataset``. Close it (or use ``with``)
    to close its files."""

    def __init__(self, root: Path, files: list[Path], refs: list[tuple[int, int]],
                 lengths: list[int], observation_space: gym.Space | None,
                 action_space: gym.Space | None, env_id: str | None,
                 metadata: dict[str, Any], damaged: list[DamagedFile] | None = None) -> None:
        self.root = root
        self.files = files
        #: (index into files, group number) of every episode, in id order
        self._refs = refs
        self._lengths = np.asarray(lengths, dtype=np.int64)
        self.observation_space = observation_space
        self.action_space = action_space
        self.env_id = env_id
        self.metadata = metadata
        #: Data files left out because they cannot be read (their episodes are not here).
        self.damaged = list(damaged or [])
        self._open: dict[int, h5py.File] = {}

    # Summary.

    @property
    def num_episodes(self) -> int:
        return len(self._refs)

    @property
    def total_steps(self) -> int:
        return int(self._lengths.sum())

    @property
    def episode_lengths(self) -> np.ndarray:
        return self._lengths.copy()

    @property
    def episode_refs(self) -> list[tuple[Path, int]]:
        """(file, group number) of every episode, in id order."""
        return [(self.files[f], k) for f, k in self._refs]

    def size_on_disk(self) -> int:
        """Bytes of the data files, main_data.hdf5 and metadata.json."""
        paths = set(self.files) | {self.root / MAIN_FILE, self.root / METADATA_FILE}
        return sum(p.stat().st_size for p in paths if p.is_file())

    def episode_returns(self) -> np.ndarray:
        """Sum of rewards of every episode, in id order (reads only the rewards)."""
        return np.array([float(np.sum(self._dataset(i, "rewards")[()]))
                         for i in range(self.num_episodes)])

    # Reading.

    def shard_ids(self, shard: tuple[int, int] = (0, 1)) -> list[int]:
        """Ids of the episodes of shard ``index`` of ``count``: by file when there are at least
        ``count`` files, otherwise by episode id modulo ``count``."""
        index, count = shard
        if not (isinstance(count, int) and count >= 1 and 0 <= index < count):
            raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard}")
        if len(self.files) >= count:
            return [i for i, (f, _) in enumerate(self._refs) if f % count == index]
        return list(range(index, self.num_episodes, count))

    def shard_steps(self, shard: tuple[int, int] = (0, 1)) -> int:
        """Transitions in ``shard`` (from the index: reads no episode)."""
        return int(self._lengths[self.shard_ids(shard)].sum())

    def iterate_episodes(self, shard: tuple[int, int] = (0, 1)) -> Iterator[Episode]:
        """Episodes of ``shard`` in id order, read one at a time."""
        for i in self.shard_ids(shard):
            yield self.episode(i)

    def episode(self, i: int) -> Episode:
        """Episode ``i``, read from disk."""
        group, path = self._group(i)
        try:
            data = {key: _read(group[key]) for key in EPISODE_KEYS}
            infos = ({key: _read(value) for key, value in group["infos"].items()}
                     if "infos" in group else {})
        except KeyError as error:
            raise DatasetError(f"{path}: {group.name} is not a trajectory episode (missing "
                               f"{error.args[0] if error.args else 'a dataset'}); expected "
                               f"{', '.join(EPISODE_KEYS)}") from None
        except (OSError, RuntimeError) as error:
            raise DatasetError(f"{path}: {group.name} cannot be read ({error}); the file is "
                               f"truncated or corrupt") from None
        steps = len(data["rewards"])
        for key in ("actions", "terminations", "truncations"):
            if len(data[key]) != steps:
                raise DatasetError(f"{path}: {group.name}/{key} has {len(data[key])} rows, "
                                   f"rewards {steps}")
        if _rows(data["observations"]) != steps + 1:
            raise DatasetError(f"{path}: {group.name}/observations has "
                               f"{_rows(data['observations'])} rows, expected {steps + 1}")
        agent = {key: _text(group.attrs[key]) for key in ("agent_id", "policy_id")
                 if key in group.attrs}
        return Episode(id=i, infos=infos, **data, **agent)

    def sample_batches(self, batch_size: int, rng: np.random.Generator,
                       shard: tuple[int, int] = (0, 1), num_batches: int | None = None,
                       buffer_size: int = 65536,
                       gamma: float | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Shuffled batches of ``batch_size`` transitions of ``shard``, endless unless
        ``num_batches``: episodes are read in a random order into a shuffle buffer of about
        ``buffer_size`` transitions (the memory bound), and batches drawn from it at random.
        ``action_logp`` is NaN for episodes that did not record it. With ``gamma``, batches
        also hold each transition's discounted ``returns_to_go`` within its episode."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        ids = self.shard_ids(shard)
        if not ids or self._lengths[ids].sum() == 0:
            raise DatasetError(f"{self.root}: shard {shard} holds no transitions")
        capacity = max(buffer_size, 2 * batch_size)
        yield from itertools.islice(
            self._shuffled_batches(ids, batch_size, capacity, rng, gamma), num_batches)

    def _shuffled_batches(self, ids: list[int], batch_size: int, capacity: int,
                          rng: np.random.Generator,
                          gamma: float | None) -> Iterator[dict[str, np.ndarray]]:
        """Endless shuffled batches of the episodes ``ids`` (see ``sample_batches``)."""
        buffer: list[dict[str, np.ndarray]] = []
        rows = 0
        while True:
            for i in rng.permutation(ids):
                buffer.append(_transitions(self.episode(int(i)), gamma))
                rows += len(buffer[-1]["rewards"])
                if rows < capacity:
                    continue
                # Emit about half of a full buffer, keep the rest to mix with what comes next.
                emit = (rows // 2) // batch_size * batch_size or batch_size
                yield from _draw(buffer, rows, emit, batch_size, rng)
                rows -= emit
            # End of a pass: emit whole batches, carry the rest into the next pass.
            if rows >= batch_size:
                emit = rows // batch_size * batch_size
                yield from _draw(buffer, rows, emit, batch_size, rng)
                rows -= emit

    # Files.

    def _file(self, f: int) -> h5py.File:
        handle = self._open.get(f)
        if handle is None:
            handle = _open_h5(self.files[f])
            self._open[f] = handle
        return handle

    def _group(self, i: int) -> tuple[h5py.Group, Path]:
        f, k = self._refs[i]
        path = self.files[f]
        group = self._file(f).get(f"episode_{k}")
        if not isinstance(group, h5py.Group):
            raise DatasetError(f"{path}: episode_{k} is missing")
        return group, path

    def _dataset(self, i: int, key: str) -> h5py.Dataset:
        group, path = self._group(i)
        if key not in group:
            raise DatasetError(f"{path}: {group.name} has no {key!r} dataset")
        return group[key]

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Dataset({str(self.root)!r}, {self.num_episodes} episodes, {self.total_steps} "
                f"steps, {len(self.files)} files)")


def open_dataset(path: str | Path) -> Dataset:
    """Open a dump: its directory, its ``main_data.hdf5``, or one per-rank file."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    if path.is_dir():
        root, data_files = path, rank_files(path)
        main = path / MAIN_FILE
    elif path.name == MAIN_FILE:
        root, main = path.parent, path
        data_files = rank_files(root)
    else:
        root, main, data_files = path.parent, None, [path]
    metadata = _read_metadata(root / METADATA_FILE) if path.is_dir() or main else {}
    files: list[Path] = []
    file_index: dict[Path, int] = {}

    def index_of(file: Path) -> int:
        file = file.resolve()
        if file not in file_index:
            file_index[file] = len(files)
            files.append(file)
        return file_index[file]

    for file in data_files:
        index_of(file)
    linked: dict[tuple[int, int], None] = {}  # ordered, without repeats
    main_links = _main_links(main) if main is not None and main.is_file() else None
    for file, k in main_links or []:
        linked[(index_of(file), k)] = None
    linked_in: dict[int, set[int]] = {}
    for f, k in linked:
        linked_in.setdefault(f, set()).add(k)
    if not files:
        per_policy = sorted(p.name for p in Path(path).iterdir()
                            if p.is_dir() and (p / MAIN_FILE).is_file()) if Path(path).is_dir() \
            else []
        if per_policy:  # a multi-agent run's dump: one dataset per policy
            raise DatasetError(f"{path} is a multi-agent dump with one dataset per policy: open "
                               f"{path}/<policy id>, one of {', '.join(per_policy)}")
        raise DatasetError(f"{path}: no trajectory files (expected {MAIN_FILE} or "
                           f"rollout-s*-w*.hdf5)")
    scans: dict[int, _FileScan] = {}
    damaged: list[DamagedFile] = []
    for f, file in enumerate(files):
        try:
            scans[f] = _scan(file, linked_in.get(f, set()), main)
        except DatasetError as error:
            lost = None if main_links is None else len(linked_in.get(f, ()))
            damaged.append(DamagedFile(file, str(error), lost))
    if not scans:
        if len(damaged) == 1:
            raise DatasetError(damaged[0].reason)
        raise DatasetError(f"{path}: none of its {len(damaged)} trajectory files is readable: "
                           + "; ".join(d.reason for d in damaged))
    # The readable files, renumbered; the episodes main_data.hdf5 does not link yet come after
    # the linked ones.
    kept = {f: i for i, f in enumerate(scans)}
    refs = [(kept[f], k) for f, k in linked if f in kept]
    seen = set(refs)
    for f, scan in scans.items():
        refs += [(kept[f], k) for k in scan.numbers if (kept[f], k) not in seen]
    readable = list(scans.values())
    lengths = [readable[i].lengths[k] for i, k in refs]
    spaces: dict[str, str] = {}
    for scan in scans.values():
        spaces = {**scan.attrs, **spaces}
    observation_space = _space(metadata.get("observation_space")
                               or spaces.get("observation_space"), root)
    action_space = _space(metadata.get("action_space") or spaces.get("action_space"), root)
    env_id = metadata.get("mpirl_env_id") or spaces.get("env_id") or _env_id_of(metadata)
    return Dataset(root, [files[f] for f in scans], refs, lengths, observation_space,
                   action_space, env_id, metadata, damaged)


@dataclass
class _FileScan:
    """What ``open_dataset`` learns of one data file: its episode numbers, their lengths, and
    the spaces and env id it records."""

    numbers: list[int]
    lengths: dict[int, int]
    attrs: dict[str, str]


def _scan(file: Path, linked: set[int], main: Path | None) -> _FileScan:
    """Read the episode index of ``file`` (and check the episodes ``main`` links into it);
    DatasetError, naming the file, if it cannot be read as a trajectory file."""
    with _open_h5(file) as handle:
        try:
            names = list(handle.keys())
            ours = FORMAT_ATTR in handle.attrs
            attrs = {key: _text(handle.attrs[key])
                     for key in ("observation_space", "action_space", "env_id")
                     if key in handle.attrs}
        except (OSError, RuntimeError) as error:
            raise DatasetError(f"{file}: its episode index cannot be read ({error}); the "
                               f"file is truncated or corrupt") from None
        numbers = sorted(n for n in map(episode_number, names) if n is not None)
        # A dump file of ours may hold no episode yet; any other file must.
        if not numbers and not ours:
            raise DatasetError(f"{file}: not a trajectory file (no episode_{{i}} groups)")
        lengths = {}
        for k in sorted(set(numbers) | linked):
            try:
                group = handle.get(f"episode_{k}")
                if not isinstance(group, h5py.Group):
                    if k in numbers:  # in the file's own index: the writer died between writes
                        raise DatasetError(f"{file}: episode_{k} is in the file's index but its "
                                           f"group cannot be read; the file is truncated or "
                                           f"corrupt")
                    raise DatasetError(f"{file}: episode_{k} is missing (linked from {main})")
                if "rewards" not in group:
                    raise DatasetError(f"{file}: episode_{k} is not a trajectory episode (no "
                                       f"rewards dataset)")
                steps = group.attrs.get("total_steps")
                lengths[k] = int(steps) if steps is not None else len(group["rewards"])
            except (OSError, RuntimeError) as error:
                raise DatasetError(f"{file}: episode_{k} cannot be read ({error}); the file "
                                   f"is truncated or corrupt") from None
    return _FileScan(numbers, lengths, attrs)


def _open_h5(path: Path) -> h5py.File:
    if path.is_dir():
        raise DatasetError(f"{path}: a directory, not an HDF5 file")
    recover(path)  # the last batch of a writer killed while it applied its journal
    try:
        return open_hdf5(path, "r")
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except OSError as error:
        detail = " ".join(str(error).split())  # HDF5's messages may span lines
        raise DatasetError(f"{path}: not a readable HDF5 file ({detail}); it is truncated, "
                           f"corrupt, or of another format") from None


def _main_links(main: Path) -> list[tuple[Path, int]] | None:
    """(file, group number) of each episode_{g} of main_data.hdf5, in g order; None if it cannot
    be read (killed while the driver wrote it): the per-rank files hold every episode anyway."""
    try:
        handle = _open_h5(main)
    except DatasetError:
        return None
    found = []
    with handle:
        for name in handle.keys():
            g = episode_number(name)
            if g is None:
                continue
            link = handle.get(name, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                target = Path(link.filename)
                k = episode_number(link.path.strip("/"))
                if k is None:
                    raise DatasetError(f"{main}: {name} links to {link.path}, not an episode")
                found.append((g, (target if target.is_absolute() else main.parent / target, k)))
            else:
                found.append((g, (main, g)))  # a dataset Minari itself wrote
    return [ref for _, ref in sorted(found)]


def _read_metadata(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(metadata, dict):
        raise DatasetError(f"{path}: not a JSON object")
    return metadata


def _space(text: str | None, root: Path) -> gym.Space | None:
    if text is None:
        return None
    try:
        return deserialize_space(text)
    except (ValueError, KeyError, TypeError) as error:
        raise DatasetError(f"{root}: cannot read a space from {text!r} ({error})") from None


def _env_id_of(metadata: dict[str, Any]) -> str | None:
    spec = metadata.get("env_spec")
    if isinstance(spec, str):
        try:
            return json.loads(spec).get("id")
        except json.JSONDecodeError:
            return None
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read(node: h5py.Dataset | h5py.Group) -> Any:
    if isinstance(node, h5py.Group):  # Dict and Tuple spaces
        keys = list(node.keys())
        if keys and all(key.startswith("_index_") for key in keys):
            return tuple(_read(node[f"_index_{j}"]) for j in range(len(keys)))
        return {key: _read(node[key]) for key in keys}
    return node[()]


def _rows(value: Any) -> int:
    if isinstance(value, dict):
        return _rows(next(iter(value.values())))
    if isinstance(value, tuple):
        return _rows(value[0])
    return len(value)


def returns_to_go(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """Discounted sum of each step's reward and those after it, within one episode. A truncated
    episode is not bootstrapped (a dump has no value estimates)."""
    returns = np.empty(len(rewards), np.float32)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        returns[t] = running
    return returns


def _transitions(episode: Episode, gamma: float | None = None) -> dict[str, np.ndarray]:
    obs = np.asarray(episode.observations)
    steps = len(episode)
    logp = episode.infos.get("action_logp")
    if logp is None:
        logp = np.full(steps, np.nan, dtype=np.float32)
    rows = {"obs": obs[:-1], "actions": np.asarray(episode.actions), "rewards": episode.rewards,
            "next_obs": obs[1:], "terminations": episode.terminations,
            "truncations": episode.truncations, "action_logp": np.asarray(logp)}
    if gamma is not None:
        rows["returns_to_go"] = returns_to_go(episode.rewards, gamma)
    return rows


def _draw(buffer: list[dict[str, np.ndarray]], rows: int, emit: int, batch_size: int,
          rng: np.random.Generator) -> Iterator[dict[str, np.ndarray]]:
    """Shuffle the ``rows`` transitions of ``buffer``, yield the first ``emit`` of them as
    batches, and leave the rest in ``buffer`` (replaced in place by one array per key)."""
    pool = _concat(buffer)
    order = rng.permutation(rows)
    buffer[:] = [{k: v[order[emit:]] for k, v in pool.items()}]
    for start in range(0, emit, batch_size):
        yield {k: v[order[start:start + batch_size]] for k, v in pool.items()}


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
