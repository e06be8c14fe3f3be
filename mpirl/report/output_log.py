"""``output.log``: what rank 0 of a run prints, kept as plain text in its run directory.

``mpirl train`` copies its output there as it is shown (``OutputLog``); the progress display
writes its plain per-iteration line there whatever it shows on the terminal (a live bar, plain
lines, or nothing). A tune trial's segments write only there (``echo=False``): their output
would mix with the population's. A run inside an ``OutputLog`` of the same directory shares it,
so every line is written once. Nothing crosses ranks: only rank 0 of a run writes its log.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, ClassVar, TextIO

#: The file in a run directory that holds rank 0's output.
OUTPUT_LOG = "output.log"


class Tee:
    """A text stream that writes to ``primary`` and copies each write to ``copy``; everything
    else (``isatty``, ``fileno``, ``encoding``) is ``primary``'s."""

    def __init__(self, primary: TextIO, copy: TextIO) -> None:
        self.primary = primary
        self.copy = copy

    def write(self, text: str) -> int:
        written = self.primary.write(text)
        try:
            self.copy.write(text)
        except (OSError, ValueError):  # a full disk or a closed log must not end the run
            pass
        return written

    def flush(self) -> None:
        self.primary.flush()
        try:
            self.copy.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.primary, name)


class OutputLog:
    """Copies what this process prints (stdout and stderr) into ``run_dir/output.log``, appended
    to, line by line, while the ``with`` block runs; with ``echo=False`` it goes there only.

    ``terminal`` is the stdout of before (None without echo): where a live display draws, so
    that its escape codes stay out of the file. ``header`` starts this process's part of the
    file. Inside an ``OutputLog`` of the same file, another one shares it and writes no header.
    """

    _open: ClassVar[dict[Path, OutputLog]] = {}

    def __init__(self, run_dir: str | Path, echo: bool = True, header: str | None = None) -> None:
        self.path = Path(run_dir) / OUTPUT_LOG
        self.echo = echo
        self.header = header
        self.file: TextIO | None = None
        self.terminal: TextIO | None = None
        self._shared = False
        self._saved: tuple[Any, Any] | None = None
        self._key: Path | None = None

    def __enter__(self) -> OutputLog:
        key = self._key = self.path.resolve()
        outer = OutputLog._open.get(key)
        if outer is not None:
            self.file, self.terminal, self.echo, self._shared = (outer.file, outer.terminal,
                                                                 outer.echo, True)
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a", buffering=1, encoding="utf-8", errors="replace")
        if self.header is not None:
            self.file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {self.header}\n")
        self._saved = (sys.stdout, sys.stderr)
        if self.echo:
            self.terminal = sys.stdout
            sys.stdout, sys.stderr = Tee(sys.stdout, self.file), Tee(sys.stderr, self.file)
        else:
            sys.stdout = sys.stderr = self.file
        OutputLog._open[key] = self
        return self

    def write(self, text: str) -> None:
        """Write ``text`` to the file alone: what was shown before the file was opened, or will
        be after it is closed. Nothing when the file is shared: it was open then, and is after."""
        if self._shared:
            return
        try:
            self.file.write(text)
        except (OSError, ValueError):
            pass

    def __exit__(self, *exc_info: object) -> None:
        if self._shared:
            return
        for stream in self._saved:
            stream.flush()
        sys.stdout, sys.stderr = self._saved
        OutputLog._open.pop(self._key, None)
        try:
            self.file.close()
        except OSError:  # its last lines could not be flushed to a full disk
            pass
