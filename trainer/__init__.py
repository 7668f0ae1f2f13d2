"""The trainer layer: scored episodes in, a policy update out, new weights pushed into the running engine.

Its rooms, lowest first; a module imports only its own room and lower ones (tests/test_layers.py holds the line):

    trainer.maths     the RL arithmetic: advantages, losses, estimators, schedules (algorithms, estimators, schedule)
    trainer.model     the model being trained: loading and batches (policy), FSDP, LoRA, tied embeddings, the
                      critic, checkpoints, model files, pushes into vLLM (weight_sync); build.py is its front door
    trainer.config    `harness train config.yaml`: the keys, loading, the reference, the checks, the roles section
    trainer.rl        the closed RL loop, top to bottom in loop.py: rollouts and validation (async ahead),
                      experience, the update, the engines' weights and sleep, tracking, a run's start and end
                      (lifecycle), OOM advice, and verl_backbone.py (`backbone: verl`)
    trainer.offline   training without rollouts (`--from-run`, `harness sft`): loop.py, data.py, chat_data.py
"""
