"""The wire protocol between a rollout rank and the env groups it drives (version 1).

An env group is one environment instance spread over k ranks: a Python ``mpirl.Simulation`` on
env ranks of the run's own world, or the processes of a solver program (C, C++, Fortran) started
beside the run in an MPMD launch. Both speak this protocol on a *link* communicator: a duplicate
of the run's communicator for env ranks in the run's world, or the intercommunicator between the
mpirl program and the solver program (its remote group: the solver's ranks). On either, rank 0
of the run (the driver) is rank 0 of the mpirl side. ``mpirl/envs/solver/mpirl_solver.h`` is the
same protocol in C; the numbers below must match it.

Messages, each a preallocated typed buffer (no pickle):

* SETUP, rollout rank -> each member of its groups, once: ``int64[SETUP_LEN]`` (fields ``SETUP_*``),
  then the env_config as JSON bytes (``TAG_SETUP_JSON``, ``SETUP_JSON_BYTES`` long).
* COMMAND, rollout rank -> a group's root (member 0): ``float64[2 + A]`` = ``[code, arg,
  action...]``. ``RESET``: arg is the seed (-1: none); ``STEP``: arg is the step's sequence
  number; ``PING``: arg echoed; ``END``: the group leaves its loop. A Discrete action is one
  float (its index). The root broadcasts it to its group, so every member sees every command.
* REPLY, group root -> rollout rank: ``float64[4 + O]`` = ``[seq, reward, terminated,
  truncated, obs...]`` after a RESET (reward 0), a STEP or a PING (obs zeros). ``seq`` is the
  command's arg; ``ERROR_SEQ`` means the group failed, and a one-line message follows as bytes
  with ``TAG_ERROR``.
* END from the run's driver (link rank 0 on the mpirl side) -> any member, at any time:
  ``int64[2]`` = ``[END, exit code]``. A member waiting for SETUP or a command takes it and
  leaves: how a run that ends early (a bad config, a failure elsewhere) ends its solvers.
* MPMD start-up, on ``MPI.COMM_WORLD`` before anything else: every process but world rank 0
  sends world rank 0 a HELLO (``char[HELLO_BYTES]``, ``"mpirl|pid|host|argv0"`` or
  ``"solver|pid|host|argv0"``, NUL padded); world rank 0 answers every one with GO, ``int64[2]``
  = ``[number of solver processes, world rank of the first]``.
"""

from __future__ import annotations

MAGIC = 0x6D70726C  # "mprl"
VERSION = 1

# Tags on the link communicator (and on COMM_WORLD for HELLO and GO).
TAG_SETUP = 7101
TAG_SETUP_JSON = 7102
TAG_COMMAND = 7103
TAG_REPLY = 7104
TAG_ERROR = 7105
TAG_END = 7106
TAG_HELLO = 7107
TAG_GO = 7108
#: MPI_Intercomm_create's tag on COMM_WORLD, between the two parts' leaders (after GO).
TAG_INTERCOMM = 7109

# COMMAND codes (column 0 of a COMMAND).
RESET = 1
STEP = 2
END = 3
PING = 4

#: REPLY's seq when the group failed; TAG_ERROR's message follows.
ERROR_SEQ = -1.0
#: The seed a RESET carries when it has none. A RESET's REPLY echoes its seed as seq, so a
#: RESET with NO_SEED would be answered with ERROR_SEQ's -1: mpirl's rollout side
#: (``mpirl.workers.sim_envs``) therefore always sends a seed >= 0, drawn from the run's seed.
NO_SEED = -1

# SETUP fields (indices into the int64 array).
SETUP_LEN = 16
SETUP_MAGIC = 0
SETUP_VERSION = 1
SETUP_GROUP = 2          # this member's env group, 0-based over the whole run
SETUP_MEMBER = 3         # this member's rank in its group (0: the root, which replies)
SETUP_GROUP_SIZE = 4     # k
SETUP_OBS_SIZE = 5       # O: observation floats
SETUP_ACTION_SIZE = 6    # A: action floats (1 for Discrete)
SETUP_ACTION_KIND = 7    # ACTION_BOX or ACTION_DISCRETE
SETUP_SEED = 8           # the run's seed for this group (a solver may use it for its own noise)
SETUP_ROLLOUT_RANK = 9   # the rollout rank (on the mpirl side of the link) that drives the group
SETUP_JSON_BYTES = 10    # length of the env_config JSON that follows
SETUP_NUM_GROUPS = 11    # env groups in the run

ACTION_BOX = 0
ACTION_DISCRETE = 1

#: REPLY columns before the observation.
REPLY_HEADER = 4
#: COMMAND columns before the action.
COMMAND_HEADER = 2

HELLO_BYTES = 256
GO_LEN = 2
