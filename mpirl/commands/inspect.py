"""``mpirl inspect PATH``: what a trajectory dump holds. Runs without MPI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mpirl.data.dump_format import QUARANTINE_KEY
from mpirl.data.reader import open_dataset


def summarize(path: str | Path) -> dict[str, Any]:
    """Episodes, steps, return statistics, spaces, files and size of the dump at ``path``."""
    with open_dataset(path) as dataset:
        returns = dataset.episode_returns()
        lengths = dataset.episode_lengths
        files = [{"path": str(f), "bytes": f.stat().st_size} for f in dataset.files]
        return {
            "path": str(path),
            "env_id": dataset.env_id,
            "episodes": dataset.num_episodes,
            "steps": dataset.total_steps,
            "return_mean": float(returns.mean()) if len(returns) else None,
            "return_min": float(returns.min()) if len(returns) else None,
            "return_max": float(returns.max()) if len(returns) else None,
            "length_mean": float(lengths.mean()) if len(lengths) else None,
            "observation_space": repr(dataset.observation_space),
            "action_space": repr(dataset.action_space),
            "files": files,
            "size_bytes": dataset.size_on_disk(),
            "returns": returns.tolist(),
            # Unreadable files left out now, and those a dumping run quarantined earlier.
            "damaged": [{"path": str(d.path), "reason": d.reason,
                         "episodes_lost": d.episodes_lost} for d in dataset.damaged],
            "quarantined": dataset.metadata.get(QUARANTINE_KEY, []),
        }


def report(summary: dict[str, Any], as_json: bool = False) -> str:
    if as_json:
        return json.dumps({k: v for k, v in summary.items() if k != "returns"}, indent=2)

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        f"dataset      {summary['path']}",
        f"environment  {summary['env_id']}",
        f"episodes     {summary['episodes']}",
        f"steps        {summary['steps']} (mean length {num(summary['length_mean'])})",
        f"return       mean {num(summary['return_mean'])}, min {num(summary['return_min'])}, "
        f"max {num(summary['return_max'])}",
        f"observations {summary['observation_space']}",
        f"actions      {summary['action_space']}",
        f"size on disk {summary['size_bytes'] / 1e6:.2f} MB in {len(summary['files'])} data "
        f"file(s):",
    ]
    lines += [f"  {f['path']}  {f['bytes'] / 1e6:.2f} MB" for f in summary["files"]]
    for d in summary["damaged"]:
        lines.append(f"damaged, left out ({_lost(d)} indexed episodes lost): {d['reason']}")
    for q in summary["quarantined"]:
        lines.append(f"quarantined earlier ({_lost(q)} indexed episodes lost): "
                     f"{q.get('renamed_to') or q.get('file')}: {q.get('reason')}")
    return "\n".join(lines)


def _lost(record: dict[str, Any]) -> str:
    lost = record.get("episodes_lost")
    return "an unknown number of" if lost is None else str(lost)


def plot_returns(summary: dict[str, Any], output: str | Path) -> Path:
    """A histogram of the episode returns, written to the PNG ``output``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    returns = np.asarray(summary["returns"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(returns, bins=min(50, max(1, len(returns))))
    ax.set_xlabel("episode return")
    ax.set_ylabel("episodes")
    ax.set_title(f"{summary['env_id']}: {summary['episodes']} episodes, "
                 f"{summary['steps']} steps")
    fig.tight_layout()
    output = Path(output)
    fig.savefig(output)
    plt.close(fig)
    return output
