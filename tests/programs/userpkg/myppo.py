"""PPO's pieces under a dotted module path, as a user's copy of algorithms/ppo.py in a package
of theirs would be (``--algo userpkg.myppo`` with tests/programs on PYTHONPATH): the name a run
records and loads it back by is that path."""

from mpirl.algorithms.ppo import (  # noqa: F401 - every piece of the contract, re-exported
    LEARNER,
    RECURRENT,
    ROLLOUT_WORKER,
    Config,
    check_config,
    loss,
    model_spec,
    setup,
    training_step,
)
