"""Where a training run's metrics go: the DuckDB `metrics` table (always), a compact table on the console, a curve
PNG in the run directory, and optionally swanlab (local mode) and wandb (offline mode).

A tracker that fails (a logging backend missing or broken) is reported once and switched off; it never stops the
run. Metric names are `section/name` (docs/training.md lists them).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harness.store.database import Store
from trainer.config import TrainConfig, config_to_dict, run_dir

log = logging.getLogger("harness.train")

# The console shows these, in this order, when present.
CONSOLE = (("reward/mean", "reward"), ("val/pass@n", "val pass@n"), ("actor/kl", "kl"), ("actor/entropy", "entropy"),
           ("actor/pg_loss", "pg loss"), ("offline/nll", "nll"), ("offline/data_nll", "data nll"),
           ("actor/grad_norm", "grad norm"), ("response/length_mean", "len"),
           ("logprob/engine_max_abs_diff", "|lp diff|"), ("rollout_corr/kl", "mismatch kl"),
           ("rollout_corr/rollout_rs_masked_fraction", "rejected"), ("merge/ratio", "merge"),
           ("update/computed_ratio", "tok/computed"), ("time/train_s", "update s"), ("time/step_s", "step s"))
CURVES = (("reward", ("reward/mean", "val/pass@n", "val/reward_mean")), ("KL", ("actor/kl", "actor/approx_kl")),
          ("entropy", ("actor/entropy",)), ("sampled tokens per sample", ("response/length_mean",)),
          ("NLL of the trained tokens", ("offline/nll", "offline/data_nll")))


class Tracker:
    def __init__(self, store: Store, run_id: str, run_dir: Path, *, project: str, experiment: str, config: dict,
                 console: bool = True, curve_png: bool = True, swanlab: bool = False, wandb: bool = False):
        self.store, self.run_id, self.run_dir = store, run_id, run_dir
        self.console = Console(stderr=True) if console else None
        self.curve_path = run_dir / "curve.png" if curve_png else None
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.backends = []
        if swanlab:
            self._start("swanlab", lambda: _swanlab(project, experiment, config, run_dir))
        if wandb:
            self._start("wandb", lambda: _wandb(project, experiment, config, run_dir))

    def _start(self, name: str, start) -> None:
        try:
            self.backends.append((name, start()))
        except Exception as exc:  # noqa: BLE001 - an optional backend must not stop training
            log.warning("%s logging is off: %s (pip install %s)", name, exc, name)

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        clean = {k: (None if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v))
                 for k, v in metrics.items()}
        self.store.add_metrics(self.run_id, step, clean)
        for k, v in clean.items():
            if v is not None:
                self.history.setdefault(k, []).append((step, v))
        for name, backend in list(self.backends):
            try:
                backend.log({k: v for k, v in clean.items() if v is not None}, step=step)
            except Exception as exc:  # noqa: BLE001
                log.warning("%s logging failed and is now off: %s", name, exc)
                self.backends.remove((name, backend))
        if self.console is not None:
            self._print(step, clean)
        if self.curve_path is not None:
            self._plot()

    def _print(self, step: int, metrics: dict[str, float | None]) -> None:
        """One row of the CONSOLE columns; with several policies a row for each under it (`policy/<name>/...`)."""
        policies = policies_in(metrics)
        rows = [("all", "")] + [(name, f"policy/{name}/") for name in policies]
        shown = [(key, label) for key, label in CONSOLE if any(prefix + key in metrics for _, prefix in rows)]
        table = Table(title=f"step {step}", title_justify="left", box=None, pad_edge=False)
        if policies:
            table.add_column("policy", justify="left")
        for _, label in shown:
            table.add_column(label, justify="right")
        for name, prefix in rows if policies else rows[:1]:
            values = [metrics.get(prefix + key) for key, _ in shown]
            table.add_row(*([name] if policies else []), *("-" if v is None else f"{v:.4g}" for v in values))
        self.console.print(table)

    def _plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        policies = policies_in(self.history)
        curves = [(title, (*keys, *(f"policy/{name}/{key}" for key in keys for name in policies)))
                  for title, keys in CURVES]  # with several policies, each one's curve beside the whole run's
        panels = [(title, keys) for title, keys in curves if any(self.history.get(k) for k in keys)] or curves[:1]
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3), squeeze=False)
        for ax, (title, keys) in zip(axes[0], panels, strict=True):
            for key in keys:
                points = self.history.get(key)
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=key)
            ax.set_title(title)
            ax.set_xlabel("step")
            if any(self.history.get(k) for k in keys):
                ax.legend(fontsize=7)
        fig.tight_layout()
        tmp = self.curve_path.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=80)
        plt.close(fig)
        os.replace(tmp, self.curve_path)

    def close(self) -> None:
        for _, backend in self.backends:
            try:
                backend.finish()
            except Exception:  # noqa: BLE001, S110 - closing a logger must not fail the run
                pass


def policies_in(metrics) -> list[str]:
    """The policies whose metrics are among `metrics`' names (`policy/<name>/...`: roles.policies), in order."""
    return sorted({key.split("/")[1] for key in metrics if key.startswith("policy/") and key.count("/") >= 2})


def _swanlab(project: str, experiment: str, config: dict, run_dir: Path):
    import swanlab

    return swanlab.init(project=project, experiment_name=experiment, config=config, mode="local",
                        logdir=str(run_dir / "swanlab"))


def _wandb(project: str, experiment: str, config: dict, run_dir: Path):
    import wandb

    return wandb.init(project=project, name=experiment, config=config, mode="offline", dir=str(run_dir))


def tracker_for(store, run_id: str, cfg: TrainConfig) -> Tracker:
    """The run's metrics, into `store` under `run_id` and the logging section's backends."""
    lg = cfg.logging
    return Tracker(store, run_id, run_dir(cfg), project=cfg.project_name, experiment=cfg.experiment_name,
                   config=config_to_dict(cfg), console=lg.console, curve_png=lg.curve_png, swanlab=lg.swanlab,
                   wandb=lg.wandb)


def log_metrics(tracker: Tracker | None, step: int, metrics: dict) -> None:
    if tracker is not None:
        tracker.log(step, metrics)
