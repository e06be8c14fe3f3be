"""Workers: the rollout worker, the learner, the replay shard and the env guard. Each runs on
its own rank and is called by the driver.
"""
