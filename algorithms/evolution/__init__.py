"""ES and ARS, evolution strategies: each rollout rank perturbs its own copy of the weights with
noise from a table shared per node, and every rank applies the same update.

``es`` and ``ars`` are the algorithm modules; both run on ``PerturbationWorker``
(``perturbation_worker``, the rollout ranks, torch-free for vector observations) and
``DriverWeights`` (``driver_weights``, the driver's copy of the weights), through the operators
of ``operators``. ``spec`` and ``network`` are the deterministic policy they perturb (NumPy and
torch), ``update_rules`` ES's and ARS's steps, ``generation_record`` what a rank answers for a
generation, and ``config`` the keys both share.
"""
