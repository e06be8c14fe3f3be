"""PPO's pieces under a dotted module path, as a user's copy of algorithms/ppo.py in a package
of theirs would be (``--algo userpkg.myppo`` with tests/programs on PYTHONPATH): the name a run
records and loads it back by is that path. The pieces are ppo_copy's (tests/programs)."""

from ppo_copy import *  # noqa: F403 - every piece of the contract, re-exported
