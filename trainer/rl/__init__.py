"""The closed RL loop, top to bottom in loop.py: episodes through the proxy and validation (rollout.py,
async_rollouts.py) -> which samples learn (experience.py) -> the update (update.py, correction.py) -> the new
weights into the engines, which sleep through the update (engines.py) -> metrics (tracking.py); lifecycle.py seeds a
run and ends it (the trained model written, everything stopped). Offline training shares engines, lifecycle,
tracking and validation. oom.py explains an out-of-memory, verl_backbone.py hands a run to verl (`backbone:
verl`)."""
