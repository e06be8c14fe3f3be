"""Model-based RL: PETS and MBPO, two algorithms over one learned dynamics ensemble.

* ``pets``, ``mbpo``: the algorithm modules (``--algo PETS``, ``--algo MBPO``): config and plan.
* ``dynamics_spec`` (torch-free), ``dynamics``: the ensemble's spec, the ensemble, its trainer
  and the vector it crosses ranks in.
* ``planner``: PETS's planning model (CEM or MPPI over the ensemble); ``model_rollouts``:
  MBPO's (SAC's actor beside the ensemble, and its branched rollouts).
* ``transitions``: real steps as transitions, and the buffers both learners keep of them.
* ``rollout_workers``: the rollout ranks (PETS's ``RealStepWorker``, MBPO's
  ``ModelRolloutWorker`` on top of it); ``pets_learner``, ``mbpo_learner``: the learners.
* ``operators``: the plans' own operators (transitions to the learner, a call on every learner).
"""
