"""The roles section of a training config: which calls belong to which role (the proxy's role rules), which
roles learn, and as which policy (`roles.policies`: one LoRA adapter per policy when there are several), with the
checks that refuse a roles section a run can't use."""

from __future__ import annotations

from harness.running.gpus import GIB, count_parameters, trainer_memory
from trainer.config.errors import ConfigError
from trainer.config.keys import TrainConfig

__all__ = ["adapters_of", "check_roles", "learns", "policies_of", "policy_of", "role_rules", "trains"]


def role_rules(cfg: TrainConfig):
    """The proxy's role rules (proxy/roles.py) from the roles section."""
    from proxy.roles import parse_rules

    roles = cfg.roles
    return parse_rules(roles.match, roles.upstream, roles.upstream_model, roles.upstream_key_env,
                       policies=roles.policies)


def trains(cfg: TrainConfig, role: str | None) -> bool:
    """Whether samples of this role learn: never a role served by another upstream; with roles.train set, only
    the roles it names; else every role."""
    return learns(cfg.roles.train, cfg.roles.upstream, role)


def learns(train, upstream, role: str | None) -> bool:
    """`trains` on the roles section's `train` list and `upstream` mapping (what verl's agent loop is given)."""
    if role is not None and role in upstream:
        return False
    return not train or role in train


def policy_of(cfg: TrainConfig, role: str | None) -> str | None:
    """The policy that samples and learns from `role`'s calls (None: calls no rule matched): the one
    roles.policies names, else the default one; None for a role that does not learn."""
    from proxy.roles import DEFAULT_POLICY

    if not trains(cfg, role):
        return None
    return cfg.roles.policies.get(role, DEFAULT_POLICY) if role is not None else DEFAULT_POLICY


def policies_of(cfg: TrainConfig) -> tuple[str, ...]:
    """Every policy the run trains, the default one first when it has any role: a trained role roles.policies
    leaves out or, with roles.train empty, calls no rule matches. One policy (the default) unless roles.policies
    says otherwise."""
    from proxy.roles import DEFAULT_POLICY

    roles = cfg.roles
    learning = roles.train or [r for r in roles.match if r not in roles.upstream]
    default = not roles.train or any(r not in roles.policies for r in learning)
    named = [roles.policies[r] for r in roles.match if r in roles.policies]
    return tuple(dict.fromkeys([DEFAULT_POLICY] * default + named))


def adapters_of(cfg: TrainConfig) -> tuple[str, ...]:
    """The LoRA adapters the trainer holds, one per policy, when the run trains several policies; () with one
    (the single policy trains as trainer.lora says, adapter or whole model)."""
    policies = policies_of(cfg)
    return policies if len(policies) > 1 else ()


def check_roles(cfg: TrainConfig, mode: str = "rl") -> None:
    """The roles section: rules the proxy can use, trained roles it defines and serves, and policies that can
    train in `mode` (trainer/config/checks.py check calls it). ConfigError names the key."""
    roles = cfg.roles
    try:
        role_rules(cfg)
    except ValueError as exc:
        raise ConfigError(f"roles: {exc}") from None
    unknown = [name for name in roles.train if name not in roles.match]
    if unknown:
        raise ConfigError(f"roles.train names {unknown[0]!r}, which roles.match does not define: add "
                          f"roles.match.{unknown[0]}: model:NAME (or system:REGEX, key:FINGERPRINT)")
    frozen = [name for name in roles.train if name in roles.upstream]
    if frozen:
        raise ConfigError(f"role {frozen[0]!r} is in roles.train but served by roles.upstream "
                          f"{roles.upstream[frozen[0]]!r}: a role that learns must be served by the policy engine")
    if roles.train and not set(roles.train) - set(roles.upstream):
        raise ConfigError("roles.train names no role the policy serves")
    _check_policies(cfg, mode)


def _check_policies(cfg: TrainConfig, mode: str) -> None:
    """roles.policies: each names a role that learns; two or more policies train LoRA adapters over one base, in
    the harness backbone's RL loop, with an engine that holds every policy's adapters in use."""
    roles, t, e = cfg.roles, cfg.trainer, cfg.rollout.engine
    for role, policy in roles.policies.items():
        if not trains(cfg, role):
            why = (f"roles.upstream serves it from {roles.upstream[role]}" if role in roles.upstream
                   else f"roles.train {roles.train!r} leaves it out")
            raise ConfigError(f"roles.policies.{role}: {policy!r} is a policy no role learns as ({role!r} is frozen: "
                              f"{why}): remove roles.policies.{role}, or add {role!r} to roles.train")
    policies = policies_of(cfg)
    if len(policies) < 2:
        return
    named = ", ".join(policies)
    if mode == "sft" or (mode == "rl" and t.adv_estimator == "gae"):
        what = ("harness sft trains one policy on chat records, which carry no roles" if mode == "sft"
                else "trainer.adv_estimator gae would need a critic per policy, which is not built")
        raise ConfigError(f"roles.policies makes {len(policies)} policies ({named}), but {what}: leave "
                          "roles.policies out" + (", or use another trainer.adv_estimator (grpo, rloo...)"
                                                  if mode == "rl" else ""))
    if cfg.backbone != "harness":
        raise ConfigError(f"roles.policies makes {len(policies)} policies ({named}); backbone {cfg.backbone!r} trains "
                          "one: use backbone harness, or leave roles.policies out")
    if t.lora.rank == 0:
        raise ConfigError(f"roles.policies makes {len(policies)} policies ({named}), and trainer.lora.rank 0 would "
                          f"train each with its full weights: {_full_weights_memory(cfg, len(policies))}. Train one "
                          "LoRA adapter per policy over one frozen base instead: set trainer.lora.rank (e.g. 16)")
    from trainer.model.lora import adapters_in_use

    needed = len(policies) * adapters_in_use(cfg.rollout.async_.max_staleness)
    slots = _flag_int(e.extra_args, "--max-loras")
    if slots is not None and slots < needed:
        raise ConfigError(f"rollout.engine.extra_args --max-loras {slots} holds fewer adapters than the run uses at "
                          f"once: {len(policies)} policies ({named}) x {needed // len(policies)} versions each (the "
                          f"newest and the ones calls may still run on) = {needed}; leave --max-loras out (harness "
                          f"sets it) or give at least {needed}")


def _full_weights_memory(cfg: TrainConfig, policies: int) -> str:
    """What full-weight training of `policies` policies would hold, when the model's size can be read."""
    parameters = count_parameters(cfg.model.path) if cfg.model.path else None
    if not parameters:
        return f"{policies} copies of the weights, their gradients and AdamW's moments"
    width = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
    each = trainer_memory(parameters, width, world=cfg.trainer.fsdp.nprocs).peak  # weights, gradients, moments
    return (f"{policies} copies of {parameters / 1e9:.2f}B parameters with their gradients and AdamW's moments, "
            f"{policies * each / GIB:.1f} GiB ({each / GIB:.1f} GiB each, over {cfg.trainer.fsdp.nprocs} rank(s))")


def _flag_int(args: list[str], flag: str) -> int | None:
    """The integer value of `flag` in vLLM arguments (`--flag N` or `--flag=N`; the last wins), None without it."""
    value = None
    for i, arg in enumerate(args):
        name, eq, text = arg.partition("=")
        if name == flag and (eq or i + 1 < len(args)):
            text = text if eq else args[i + 1]
            value = int(text) if text.isdigit() else value
    return value
