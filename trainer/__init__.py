"""The trainer layer: scored episodes in, a policy update out, new weights pushed into the running engine.

One training step, top to bottom in `loop.py` (its parts shared with offline training in `loop_parts.py`):
    rollout.py (episodes through the proxy, judged, merged; async_rollouts.py runs them ahead)
    -> experience.py (which samples learn, their rewards and advantages) -> algorithms.py, estimators.py (the
    arithmetic) -> policy.py (batches, logprobs), fsdp.py, critic.py, lora.py -> weight_sync.py (into vLLM)
    -> checkpoint.py, tracking.py.
The config: config.py (load), config_keys.py (every key), config_reference.py (the keys
as data), config_checks.py. Also offline.py with offline_data.py
and chat_data.py (`--from-run`, `harness sft`), schedule.py, and verl_backbone.py (`backbone: verl`).
"""
