"""docs/callbacks.md's example: a long-episode metric per rollout rank and a steps-per-episode
column on the driver. Run it with ``PYTHONPATH=examples`` and
``--config '{"callbacks": "my_callbacks:EpisodeStats"}'``."""

import mpirl


class EpisodeStats(mpirl.Callbacks):
    def on_episode_end(self, *, episode, worker):            # on each rollout rank
        episode.custom_metrics["long"] = float(episode.length >= 200)

    def on_train_result(self, *, algorithm, result):         # on the driver
        result["steps_per_episode"] = result["timesteps_total"] / max(result["episodes_total"], 1)
