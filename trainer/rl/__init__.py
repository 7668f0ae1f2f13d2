"""The closed RL loop (loop.py, its parts shared with offline training in parts.py): episodes through the proxy
(rollout.py, async_rollouts.py) -> which samples learn (experience.py) -> the update -> metrics (tracking.py);
oom.py explains an out-of-memory, verl_backbone.py hands a run to verl (`backbone: verl`)."""
