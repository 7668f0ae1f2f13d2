"""The model being trained: the policy loaded and batched (policy.py), sharded (fsdp.py), with LoRA (lora.py), its
embeddings tied or not (tied.py), the critic (critic.py), checkpoints (checkpoint.py), model directories
(files.py) and pushes into the engine (weight_sync.py). build.py builds it all for a run: build_policy."""
