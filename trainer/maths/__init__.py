"""The RL arithmetic, small pure functions over tensors: advantages, policy losses and their aggregation
(algorithms.py), KL control, GAE and the value loss (estimators.py), the learning rate and task order (schedule.py).
Imports nothing else of the trainer's."""
