"""The population controller on the population's rank 0: it hands trial segments to slots,
records what comes back, retries failed trials and, for PBT, makes and carries out the
exploit/explore decisions at every boundary.

What the tune directory holds: ``trial_000/`` ... (each an ordinary run directory, plus the
trial's ``output.log``), ``tune.csv`` (one row per finished segment), ``pbt.jsonl`` (one line
per PBT decision), ``tune_state.json`` (everything ``--resume`` needs, rewritten after every
event) and, at the end, ``result.json`` (the best trial and every trial's last numbers).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from mpirl.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_RESUME,
    EXIT_USAGE,
    ConfigError,
    DiskFull,
    no_room_cause,
)
from mpirl.execution.trainer import MAX_ITERATIONS_ENV, stop_reached
from mpirl.jobs.run_dir import json_default
from mpirl.runtime import signals as stop_signals
from mpirl.runtime.dispatch import RESULT, STOP_TRIAL, TASK
from mpirl.tune.pbt import PBTSettings, decide
from mpirl.tune.population_link import PopulationLink
from mpirl.tune.request import (
    STATE_FILE,
    TuneRequest,
    check_trials,
    config_problem,
    trial_config,
)
from mpirl.tune.slot import TRIAL_LOG

PENDING, RUNNING, PAUSED, TERMINATED, ERROR = "PENDING", "RUNNING", "PAUSED", "TERMINATED", "ERROR"
#: Numbers of a trial's last row kept in the state, tune.csv and result.json.
ROW_KEYS = ("iteration", "timesteps_total", "time_total_s", "episode_return_mean")


@dataclasses.dataclass
class Trial:
    """One member of the population: its own config values and run directory (its seed is the
    request's plus its index)."""

    index: int
    config: dict[str, Any]
    status: str = PENDING
    failures: int = 0
    last: dict[str, Any] | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return f"trial_{self.index:03d}"


class Controller:
    """Rank 0 of ``mpirl tune``'s population. Slot ``s`` is led by rank
    ``1 + s * ranks_per_trial``; ``link`` reaches them."""

    def __init__(self, link: PopulationLink, request: TuneRequest, trials: list[Trial],
                 num_slots: int, state: dict[str, Any] | None = None,
                 max_iterations: int | None = None) -> None:
        self.link = link
        self.request = request
        #: ``$MPIRL_MAX_ITERATIONS``: every trial ends by this iteration (not kept by the state).
        self.max_iterations = max_iterations
        self.trials = trials
        self.leaders = [1 + s * request.ranks_per_trial for s in range(num_slots)]
        self.dir = Path(request.tune_dir)
        self.domains = request.domains
        state = state or {}
        self.rng = np.random.default_rng(request.seed + 7919)
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]
        self.round = int(state.get("round", 0))
        #: PBT: the boundary of the last decision carried out (None: not kept by the state).
        self.decided_at: float | None = state.get("decided_at", 0.0 if not state else None)
        self.started = time.monotonic()
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self.busy: dict[int, Trial] = {}  # slot -> the trial it runs
        self.stopping: str | None = None
        #: The population's exit code once stopping: 130 after a SIGINT, else 75.
        self.stop_code = EXIT_RESUME
        self.stop_forwarded: set[int] = set()
        #: A mistake in the command line found only once trials report (exit code 2).
        self.fatal: str | None = None
        #: What said "no room" where a trial or an exploit's copy could not write.
        self.no_room: str | None = None
        self._last_stop: dict[int, dict[str, Any]] = {}  # trial -> its running segment's stop
        self._csv_fields = ["time_s", "trial", "status", *ROW_KEYS,
                            *([request.metric] if request.metric not in ROW_KEYS else []),
                            *request.space]

    # -- running -----------------------------------------------------------------------------

    def run(self) -> int:
        """Run the population to its end (or to a stop signal); the job's exit code."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._announce()
        try:
            self.save()
            if self.request.scheduler == "pbt":
                self._run_pbt()
            else:
                self._run_fifo()
            self.save()
        except BaseException as error:
            self._quit_slots(EXIT_FAILURE)
            if (no_room := no_room_cause(error)) is not None:
                raise DiskFull(self.dir, no_room) from None
            raise
        if self.no_room:
            # No trial failed: the population ends as a run on a full disk does (exit 1, which
            # launch and a requeue answer with --resume), each trial from its newest checkpoint.
            self._quit_slots(EXIT_FAILURE)
            raise DiskFull(self.dir, self.no_room)
        if self.fatal:
            self._quit_slots(EXIT_USAGE)
            raise ConfigError(self.fatal)
        if self.stopping:
            code = self.stop_code
            print(f"mpirl tune: {self.stopping}: every running trial checkpointed; stopped "
                  f"(exit code {code}). Continue with: mpirl tune --resume {self.dir}",
                  file=sys.stderr, flush=True)
            self._quit_slots(code)
            return code
        code = self._finish()
        self._quit_slots(code)
        return code

    def _run_fifo(self) -> None:
        queue = [t for t in self.trials if t.status not in (TERMINATED, ERROR)]
        free = list(range(len(self.leaders)))
        while queue or self.busy:
            while queue and free and not self.stopping:
                self._start(free.pop(0), queue.pop(0), dict(self.request.stop))
            if not self.busy:
                break
            slot, outcome = self._wait_result()
            trial = self.busy.pop(slot)
            free.append(slot)
            if self._settle(trial, outcome) == "retry":
                queue.insert(0, trial)
            self.save()

    def _run_pbt(self) -> None:
        settings = PBTSettings(self.request.perturbation_interval, self.request.time_attr,
                               self.request.quantile_fraction, self.request.resample_probability)
        attr = "iteration" if settings.time_attr == "training_iteration" else "timesteps_total"
        while not self.stopping:
            live = [t for t in self.trials if t.status not in (TERMINATED, ERROR)]
            if not live:
                return
            interval = settings.perturbation_interval
            done = {t.index: (t.last or {}).get(attr, 0) for t in live}
            if self.decided_at is None:  # a state saved before decided_at was kept
                self.decided_at = min(math.floor(d / interval) * interval for d in done.values())
            # One boundary for every member: the next after the last decision. A member may
            # have reached it already, if the job ended after its segment but before another's
            # or before the decision: it waits, and the decision is made at the boundary.
            boundary = self.decided_at + interval
            boundaries = dict.fromkeys(done, boundary)
            for trial in live:  # member i keeps slot i for the whole run
                if done[trial.index] >= boundary:
                    continue
                stop = dict(self.request.stop)
                stop[settings.time_attr] = min(boundary, stop.get(settings.time_attr, math.inf))
                self._start(trial.index, trial, stop)
            while self.busy:
                slot, outcome = self._wait_result()
                trial = self.busy.pop(slot)
                if self._settle(trial, outcome) == "retry" and not self.stopping:
                    self._start(slot, trial, self._last_stop[trial.index])
                self.save()
            if self.stopping:
                return
            ready = {t.index: self.request.score(t.last) for t in live if t.status == PAUSED}
            decisions = decide(ready, {t.index: t.config for t in self.trials}, self.domains,
                               settings, self.rng, valid=lambda config: config_problem(
                                   self.request, config, self.request.seed) is None)
            self._exploit(decisions, settings, boundaries)
            self.decided_at = boundary
            self.round += 1
            self.save()

    def _start(self, slot: int, trial: Trial, stop: dict[str, Any]) -> None:
        self._last_stop[trial.index] = stop
        trial.status = RUNNING
        self.busy[slot] = trial
        task = {"kind": "segment", "trial": trial.name, "run_dir": str(self.dir / trial.name),
                "algo": self.request.algo, "env": self.request.env,
                "env_module": self.request.env_module, "seed": self.request.seed + trial.index,
                "config": trial_config(self.request, trial.config), "stop": stop,
                "max_iterations": self.max_iterations, "varying": trial.config}
        self.link.isend(task, self.leaders[slot], TASK)

    def _wait_result(self) -> tuple[int, dict[str, Any]]:
        """The next segment outcome from any busy slot; stop requests are passed on meanwhile."""
        outcome, source = self.link.receive(MPI.ANY_SOURCE, RESULT, "segment outcome",
                                            waits_for_a_trial=True, idle=self._check_stop)
        return self.leaders.index(source), outcome

    def _check_stop(self) -> None:
        signum = stop_signals.received()
        if signum is not None and not self.stopping:
            self.stopping = f"{stop_signals.signal_name(signum)} on the controller"
            self.stop_code = stop_signals.exit_code(signum)
        if self.stopping:
            for slot in self.busy:
                if slot not in self.stop_forwarded:
                    self.stop_forwarded.add(slot)
                    self.link.isend(None, self.leaders[slot], STOP_TRIAL)

    def _settle(self, trial: Trial, outcome: dict[str, Any]) -> str:
        """Record a segment's outcome; "retry" if the trial is to run the segment again."""
        code, row = outcome["code"], outcome["row"]
        if outcome.get("no_room"):
            # Not the trial's failure: its newest checkpoint is intact, and every other trial
            # would meet the same disk. The population stops, the others checkpointing.
            trial.status = PAUSED
            self._no_room(outcome["no_room"], trial)
            return PAUSED
        if row is not None:
            trial.last = {k: row[k] for k in (*ROW_KEYS, self.request.metric) if k in row}
            if self.request.metric not in row:
                # Every trial reports the same keys: no trial can be ranked, so stop them all.
                trial.status, trial.error = ERROR, (
                    f"--metric {self.request.metric!r} is not in the trials' results; they have: "
                    f"{', '.join(sorted(row))}")
                self.fatal = self.fatal or trial.error
                self.stopping = self.stopping or "an unknown --metric"
                self._report(trial)
                return ERROR
        if code == 0:
            done = row is None or stop_reached(row, self.request.stop, self.max_iterations)
            trial.status = TERMINATED if done or self.request.scheduler == "fifo" else PAUSED
        elif code in (EXIT_RESUME, EXIT_INTERRUPTED):
            trial.status = PAUSED
            if not self.stopping:
                self.stopping, self.stop_code = f"a stop signal reached {trial.name}", code
        else:
            trial.failures += 1
            trial.error = outcome.get("error") or f"exit code {code}"
            retry = trial.failures <= self.request.max_failures
            trial.status = PENDING if retry else ERROR
            self._report(trial, failed=code)
            return "retry" if retry else ERROR
        self._report(trial)
        return trial.status

    def _no_room(self, detail: str, trial: Trial) -> None:
        self.no_room = self.no_room or detail
        self.stopping = self.stopping or f"{trial.name} found the file system full"

    def _exploit(self, decisions: list, settings: PBTSettings,
                 boundaries: dict[int, float]) -> None:
        """Carry out PBT's decisions: each winner's newest checkpoint goes point to point from
        its slot's leader to each loser's, then the loser takes the explored config."""
        if not decisions:
            return
        by_winner: dict[int, list[int]] = {}
        for decision in decisions:
            by_winner.setdefault(decision.winner, []).append(decision.loser)
        expected = 0
        for winner, losers in by_winner.items():
            self.link.isend({"kind": "send_state", "run_dir": str(self.dir / self.trials[
                winner].name), "to": [self.leaders[loser] for loser in losers]},
                self.leaders[winner], TASK)
            expected += 1
            for loser in losers:
                self.link.isend({"kind": "receive_state", "run_dir": str(
                    self.dir / self.trials[loser].name), "from": self.leaders[winner]},
                    self.leaders[loser], TASK)
                expected += 1
        received = {}
        for _ in range(expected):
            reply, source = self.link.receive(MPI.ANY_SOURCE, RESULT, "checkpoint copy's reply")
            received[self.leaders.index(source)] = reply
        for decision in decisions:
            loser, winner = self.trials[decision.loser], self.trials[decision.winner]
            copied = received.get(decision.loser, {}).get("ok", False)
            if received.get(decision.loser, {}).get("no_room"):
                self._no_room(received[decision.loser]["no_room"], loser)
            record = {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "round": self.round,
                "time_attr": settings.time_attr, "boundary": boundaries.get(loser.index),
                "iteration": (winner.last or {}).get("iteration"),
                "from": winner.name, "to": loser.name,
                "from_score": (winner.last or {}).get(self.request.metric),
                "to_score": (loser.last or {}).get(self.request.metric),
                "old_config": decision.old_config,
                "new_config": decision.new_config if copied else decision.old_config,
                "exploited": copied,
            }
            if copied:
                loser.config = dict(decision.new_config)
                loser.last = dict(winner.last or {})
            with open(self.dir / "pbt.jsonl", "a", encoding="utf-8") as file:
                file.write(json.dumps(record, default=json_default) + "\n")
            changes = ", ".join(f"{k} {_short(decision.old_config.get(k))} -> {_short(v)}"
                                for k, v in record["new_config"].items())
            self._print(f"pbt: {loser.name} ({_short(record['to_score'])}) <- {winner.name} "
                        f"({_short(record['from_score'])})"
                        + (f"; {changes}" if copied else "; nothing to copy, kept its state"))

    # -- records -----------------------------------------------------------------------------

    def save(self) -> None:
        """tune_state.json, atomically: what ``mpirl tune --resume`` continues from."""
        state = {"format_version": 1, "request": dataclasses.asdict(self.request),
                 "trials": [dataclasses.asdict(t) for t in self.trials], "round": self.round,
                 "decided_at": self.decided_at, "rng": self.rng.bit_generator.state,
                 "elapsed_s": self.elapsed}
        tmp = self.dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=1, default=json_default) + "\n",
                       encoding="utf-8")
        os.replace(tmp, self.dir / STATE_FILE)

    @property
    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    def _report(self, trial: Trial, failed: int | None = None) -> None:
        last = trial.last or {}
        path = self.dir / "tune.csv"
        new = not path.exists()
        with open(path, "a", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, self._csv_fields, extrasaction="ignore")
            if new:
                writer.writeheader()
            status = "FAILED" if failed is not None else trial.status
            writer.writerow({"time_s": round(self.elapsed, 2), "trial": trial.name,
                             "status": status, **last, **trial.config})
        best = self.best()
        steps = sum((t.last or {}).get("timesteps_total", 0) for t in self.trials)
        values = " ".join(f"{k}={_short(v)}" for k, v in trial.config.items())
        line = (f"{trial.name} {status.lower():<10} iter {last.get('iteration', 0):>4} "
                f"steps {last.get('timesteps_total', 0):>9,} {self.request.metric} "
                f"{_short(last.get(self.request.metric))}"
                + (f"  {values}" if values else "")
                + f"  | {self.elapsed:.0f} s, {steps / max(self.elapsed, 1e-9):,.0f} steps/s"
                + (f", best {best.name} {_short((best.last or {}).get(self.request.metric))}"
                   if best else ""))
        if failed is not None:
            retry = "retrying from its newest checkpoint" if trial.status == PENDING else (
                f"no retries left (--max-failures {self.request.max_failures})")
            line += (f"\n  {trial.name} failed (exit code {failed}, failure {trial.failures}); "
                     f"{retry}; see {self.dir / trial.name / TRIAL_LOG}")
        self._print(line)

    def best(self) -> Trial | None:
        scored = [t for t in self.trials if t.last and not math.isnan(self.request.score(t.last))]
        return max(scored, key=lambda t: self.request.score(t.last), default=None)

    def _finish(self) -> int:
        best = self.best()
        errors = [t for t in self.trials if t.status == ERROR]
        result = {
            "metric": self.request.metric, "mode": self.request.mode,
            "best_trial": best.name if best else None,
            "best_config": best.config if best else None,
            "best_result": best.last if best else None,
            "best_run_dir": str(self.dir / best.name) if best else None,
            "elapsed_s": self.elapsed,
            "trials": [{"trial": t.name, "status": t.status, "config": t.config,
                        "failures": t.failures, "last": t.last, "error": t.error}
                       for t in self.trials],
        }
        (self.dir / "result.json").write_text(json.dumps(result, indent=2, default=json_default)
                                              + "\n", encoding="utf-8")
        self._print(self._table())
        if best:
            self._print(f"best: {best.name} {self.request.metric} "
                        f"{_short(best.last.get(self.request.metric))} with "
                        f"{json.dumps(best.config)}; run directory {self.dir / best.name}")
        if errors:
            names = ", ".join(t.name for t in errors)
            last = ((errors[0].error or "").strip().splitlines() or ["(no output)"])[-1]
            print(f"mpirl tune: {len(errors)} trial(s) failed: {names}. Their output: "
                  f"{self.dir}/trial_NNN/{TRIAL_LOG}\n  {errors[0].name}: {last}",
                  file=sys.stderr, flush=True)
            return EXIT_FAILURE
        return 0

    def _table(self) -> str:
        keys = list(self.request.space)
        header = ["trial", "status", "iter", "steps", self.request.metric, *keys]
        rows = [[t.name, t.status.lower(), str((t.last or {}).get("iteration", 0)),
                 f"{(t.last or {}).get('timesteps_total', 0):,}",
                 _short((t.last or {}).get(self.request.metric)),
                 *(_short(t.config.get(k)) for k in keys)] for t in self.trials]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                         for r in [header, *rows])

    def _announce(self) -> None:
        request = self.request
        what = (f"PBT of {len(self.trials)} members" if request.scheduler == "pbt" else
                f"{request.search} search, {len(self.trials)} trials")
        self._print(f"mpirl tune: {what} of {request.algo} on {request.env}, "
                    f"{_counted(len(self.leaders), 'slot')} of "
                    f"{_counted(request.ranks_per_trial, 'rank')}; results in "
                    f"{self.dir}")
        if self.max_iterations is not None:
            print(f"mpirl tune: {MAX_ITERATIONS_ENV}={self.max_iterations}: every trial stops "
                  f"after at most {self.max_iterations} training iteration"
                  f"{'s' if self.max_iterations > 1 else ''}, whatever --stop says",
                  file=sys.stderr, flush=True)

    @staticmethod
    def _print(line: str) -> None:
        print(line, flush=True)

    def _quit_slots(self, code: int) -> None:
        self.link.isend_many({"kind": "quit", "code": code}, self.leaders, TASK)
        self.link.flush("the quit")


def _short(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def new_trials(request: TuneRequest, configs: list[dict[str, Any]]) -> list[Trial]:
    check_trials(request, configs)
    return [Trial(index, config) for index, config in enumerate(configs)]


def resumed_trials(state: dict[str, Any]) -> list[Trial]:
    trials = [Trial(**t) for t in state["trials"]]
    for trial in trials:
        if trial.status == RUNNING:
            trial.status = PAUSED
    return trials


def _counted(number: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
