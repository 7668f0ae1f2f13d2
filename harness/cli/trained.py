"""What a finished `harness train` run trained, served again (`harness run --trained RUN_DIR`, `harness serve
--trained RUN_DIR`): the app evaluated as trained, each role on the weights it learned.

A run's directory (`<logging.run_dir>/<experiment_name>`) holds its config (config.resolved.yaml: model.path, the
roles section) and, once it has finished, what it trained:
- `hf/`: the whole model (full-weight training of one policy): the engine serves it;
- `adapter/` (adapter_config.json in it): one LoRA adapter over model.path, which serves every call the engine
  answers, as in training;
- `adapter/<policy>/`: one adapter per policy (roles.policies): the engine loads them all (`--lora-modules`), and
  the proxy sends each role's calls to its policy's adapter, under the role rules the run trained with.
Each adapter is served as `<policy>-lora-<run>` (the run's directory name), which every call records in
calls.served_model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Trained", "read_trained"]

RESOLVED = "config.resolved.yaml"


@dataclass(frozen=True)
class Trained:
    run_dir: Path
    model: str  # the model directory the engine starts on: the run's base (model.path), or its hf/ when it trained one
    roles: tuple = ()  # the run's role rules (proxy/roles.py RoleRule), each trained role with its policy
    adapters: dict[str, Path] = field(default_factory=dict)  # policy -> its trained adapter's directory
    rank: int = 0  # the largest adapter rank (adapter_config.json "r"); 0 without adapters

    def served_name(self, policy: str) -> str:
        """The engine's model name for `policy`'s adapter (calls.served_model)."""
        return f"{policy}-lora-{re.sub(r'[^A-Za-z0-9_.-]', '_', self.run_dir.name)}"

    @property
    def policy_models(self) -> dict[str, str]:
        """Each policy with an adapter -> the engine's model name its calls go to (ProxyConfig.policy_models)."""
        return {policy: self.served_name(policy) for policy in self.adapters}

    def engine_args(self) -> list[str]:
        """vLLM flags that load every adapter at start, each under its served name."""
        if not self.adapters:
            return []
        from trainer.model.lora import LoraSpec, engine_args

        modules = [json.dumps({"name": self.served_name(p), "path": str(d)}) for p, d in self.adapters.items()]
        return [*engine_args(LoraSpec(rank=self.rank), loaded=len(self.adapters)), "--lora-modules", *modules]


def read_trained(run_dir: str | Path) -> Trained:
    """The trained run at `run_dir`; a ValueError names what is missing and what to do."""
    from proxy.roles import DEFAULT_POLICY
    from trainer.config import ConfigError, read_config
    from trainer.config.roles import policies_of, role_rules

    run_dir = Path(run_dir).resolve()
    resolved = run_dir / RESOLVED
    if not resolved.is_file():
        raise ValueError(f"--trained {str(run_dir)!r} has no {RESOLVED}: give the directory harness train wrote "
                         "the run into, <logging.run_dir>/<experiment_name> (e.g. runs/planner_executor)")
    try:
        cfg = read_config(resolved)
        rules = role_rules(cfg)
    except (ConfigError, ValueError) as exc:
        raise ValueError(f"--trained {str(run_dir)!r}: {RESOLVED} can't be read: {exc}") from None
    if cfg.model.path is None:
        raise ValueError(f"--trained {str(run_dir)!r}: {RESOLVED} names no model.path to serve")
    policies = policies_of(cfg)
    unfinished = ("is written when the run finishes (trainer.total_steps): finish it with harness train "
                  f"{resolved} (it resumes from its last checkpoint)")
    if cfg.trainer.lora.rank == 0:
        if not (run_dir / "hf" / "config.json").is_file():
            raise ValueError(f"--trained {str(run_dir)!r}: the trained model {run_dir / 'hf'} {unfinished}")
        return Trained(run_dir, str(run_dir / "hf"), rules)
    # One policy trains one adapter, which served every call the engine answered (the default policy's name):
    # so it does here, whatever roles.policies calls that policy. Several: each policy's calls go to its own.
    folders = ({DEFAULT_POLICY: run_dir / "adapter"} if len(policies) == 1
               else {policy: run_dir / "adapter" / policy for policy in policies})
    missing = [d for d in folders.values() if not (d / "adapter_config.json").is_file()]
    if missing:
        raise ValueError(f"--trained {str(run_dir)!r}: the trained adapter {missing[0]} {unfinished}")
    ranks = [json.loads((d / "adapter_config.json").read_text()).get("r") for d in folders.values()]
    if not all(isinstance(r, int) and r > 0 for r in ranks):
        raise ValueError(f"--trained {str(run_dir)!r}: adapter_config.json of {list(folders.values())} give ranks "
                         f"{ranks}: each must have a positive integer \"r\" (peft's format)")
    return Trained(run_dir, cfg.model.path, rules, folders, max(ranks))
