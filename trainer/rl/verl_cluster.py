"""`backbone: verl`'s Ray cluster, seen from the driver: where verl's `ray.init` goes (a cluster of the run's own, or
the one it joins), and the watch that stops a run whose agent-loop worker died (docs/scale-out.md)."""

from __future__ import annotations

import _thread
import os
import threading

from trainer.config import ConfigError


def place_cluster(c, ray_address: str | None) -> None:
    """Where verl's `ray.init` goes. Joining a cluster (`verl.ray_address`, or RAY_ADDRESS in the environment), its
    resources are the cluster's own: num_cpus/num_gpus in ray_init are refused here, as Ray would refuse them from
    inside verl. Otherwise a local cluster of the run's own, also when another one (`ray start`) runs on this
    machine: left to itself Ray would join that one."""
    from omegaconf import OmegaConf

    init = c.ray_kwargs.ray_init
    joining = ray_address or os.environ.get("RAY_ADDRESS") or init.get("address")
    if joining:
        given = [k for k in ("num_cpus", "num_gpus") if init.get(k) is not None]
        if given:
            raise ConfigError(f"verl.overrides sets ray_kwargs.ray_init.{given[0]} while the run joins the Ray "
                              f"cluster at {joining!r}: a cluster's resources are its own (`ray start --num-cpus "
                              "--num-gpus`); drop it from verl.overrides, or set verl.ray_address: null (and unset "
                              "RAY_ADDRESS) to start a cluster of the run's own")
        return
    OmegaConf.update(c, "ray_kwargs.ray_init.address", "local", force_add=True)


class WorkerLost(RuntimeError):
    """An agent-loop worker died mid-run (its process killed, its machine gone)."""


class WorkerWatch(threading.Thread):
    """In the driver, while verl runs: notices an agent-loop worker that died and interrupts the run.

    verl 0.9.1's v1 trainer would wait for that worker's episodes forever (its replay buffer keeps them "running";
    measured: tests/adapters/test_verl_run_engine.py). verl names its workers agent_loop_worker_<i>_<id> in the
    job's namespace, and Ray drops a dead actor's name: a name seen and then gone is a worker lost."""

    PREFIX = "agent_loop_worker_"

    def __init__(self, every_s: float = 5.0):
        super().__init__(name="harness-verl-watch", daemon=True)
        self.every_s = every_s
        self.done = threading.Event()
        self.lost: list[str] = []
        self.seen: set[str] = set()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            if self.look() and not self.done.is_set():
                _thread.interrupt_main()
                return

    def look(self) -> list[str]:
        """The workers seen before and gone now (also `lost`); [] while Ray starts or stops."""
        import ray

        if not ray.is_initialized():
            return []
        try:
            names = set(ray.util.list_named_actors())  # this job's namespace: names only
        except Exception:  # noqa: BLE001 - Ray starting or stopping: look again later
            return []
        workers = {n for n in names if n.startswith(self.PREFIX)}
        self.lost = sorted(self.seen - workers)
        self.seen |= workers
        return self.lost
