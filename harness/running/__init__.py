"""Running agents, over the proxy: the engine (`vllm_server.py`), agents as episodes in subprocesses
(`runner.py`, under `limits.py`), task readers (`tasks.py`, `hf_tasks.py`), judges (`judges.py`, in worker
processes: `judge_pool.py`), a dataset run end to end (`dataset.py`) and its report (`report.py`); models built
offline for it (`tiny_model.py`, and the real SmolLM2 in `smollm2.py`)."""
