"""A plug-in algorithm for the multi-agent tests: PPO's pieces under another module name, as a
user's copy of it would be (``--algo ppo_copy`` or ``"algo": "ppo_copy"`` with this folder on
PYTHONPATH)."""

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
