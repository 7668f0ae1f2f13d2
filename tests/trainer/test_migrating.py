"""docs/MIGRATING.md: its converted configs load, and hold the values its key-by-key tables promise.

Every ```yaml block whose first line is `# harness-config` is written to a file in a temporary directory and loaded
with `trainer.config.load_config`, as `harness train` loads it. The blocks are written for a config at the
repository root: `examples/` is linked into the temporary directory so their repository paths resolve, and an agent
file the reader is meant to write (e.g. countdown_agent.py) is created empty there, since loading checks that
`rollout.agent` is a file. `model.path` and the data sources need not exist to load. With verl installed, the
`backbone: verl` blocks are also translated to verl's config and checked by verl's own `validate_config`.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "MIGRATING.md"
MARKER = "# harness-config"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)


def _config_blocks() -> list[str]:
    return [block for block in _blocks("yaml") if block.splitlines()[0].strip() == MARKER]


def _name(block: str) -> str:
    return yaml.safe_load(block)["harness"]["experiment_name" if "experiment_name:" in block else "project_name"]


def _load(block: str, directory: Path, overrides: tuple[str, ...] = ()):
    directory.mkdir(parents=True, exist_ok=True)
    link = directory / "examples"
    if not link.exists():
        link.symlink_to(ROOT / "examples", target_is_directory=True)
    agent = (yaml.safe_load(block)["harness"].get("rollout") or {}).get("agent")
    if agent and not (directory / agent).exists():  # an agent the reader writes: loading only checks it is a file
        (directory / agent).parent.mkdir(parents=True, exist_ok=True)
        (directory / agent).write_text("")
    path = directory / f"{_name(block)}.yaml"
    path.write_text(block)
    return load_config(path, overrides)


# what the tables of docs/MIGRATING.md promise, by the block's experiment_name (or project_name)
EXPECTED = {
    "example_countdown": {  # AgentJet, tutorial/example_countdown/countdown.yaml
        "backbone": "verl",
        "rollout.num_repeat": 4, "rollout.batch_size": 32, "rollout.concurrency": 128, "rollout.temperature": 0.9,
        "rollout.top_p": 1.0, "rollout.max_tokens": 4096, "rollout.engine.max_model_len": 5120,
        "rollout.validation.n": 1, "rollout.validation.temperature": 0.0,
        "trainer.adv_estimator": "grpo", "trainer.lr": 1e-6, "trainer.kl_coef": 0.002, "trainer.kl_type": "k3",
        "trainer.use_kl_in_reward": False, "trainer.mini_batch_size": 32, "trainer.total_steps": None,
        "trainer.test_freq": 20, "trainer.save_freq": 50, "trainer.val_before_train": False,
        "trainer.fsdp.param_offload": True, "trainer.fsdp.optimizer_offload": True,
        "data.split": "train", "data.validation_split": "test", "logging.swanlab": True,
        "debug.n_tasks": 2, "debug.seed": 12345,
        "verl.nnodes": 1, "verl.n_gpus_per_node": 8, "verl.tensor_parallel_size": 1, "verl.prompt_length": 1024,
        "verl.response_length": 4096, "verl.ulysses_sequence_parallel_size": 1,
        "verl.overrides": ["actor_rollout_ref.rollout.max_num_seqs=10"],
    },
    "test_gsm8k": {  # AgentFly, examples/train_scripts/train_example.sh, our backbone
        "backbone": "harness", "project_name": "AgentRL",
        "rollout.num_repeat": 8, "rollout.batch_size": 64, "rollout.max_tokens": 512,
        "rollout.engine.max_model_len": 8192, "rollout.engine.extra_args": ["--gpu-memory-utilization", "0.5"],
        "task_judge.judge": "math", "data.validation_split": "train",
        "trainer.adv_estimator": "grpo", "trainer.lr": 5e-7, "trainer.kl_coef": 0.001, "trainer.kl_type": "k2",
        "trainer.use_kl_in_reward": False, "trainer.entropy_coef": 0.001, "trainer.mini_batch_size": 64,
        "trainer.total_steps": 100, "trainer.test_freq": 10, "trainer.save_freq": 50, "trainer.val_before_train": True,
        "trainer.critic.warmup_steps": 0, "trainer.fsdp.nprocs": 1, "trainer.fsdp.param_offload": True,
        "trainer.fsdp.optimizer_offload": True, "model.gradient_checkpointing": False,
        "logging.console": True, "logging.wandb": True,
    },
    "test_gsm8k_verl": {  # the same on backbone verl
        "backbone": "verl", "rollout.num_repeat": 8, "rollout.batch_size": 64, "trainer.lr": 5e-7,
        "trainer.kl_coef": 0.001, "trainer.kl_type": "k2", "trainer.entropy_coef": 0.001, "trainer.total_steps": 100,
        "verl.n_gpus_per_node": 1, "verl.gpu_memory_utilization": 0.5, "verl.micro_batch_size_per_gpu": 8,
        "verl.overrides": ["actor_rollout_ref.model.use_remove_padding=false",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"],
    },
}


def _value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_doc_has_a_converted_config_for_each_source():
    names = [_name(block) for block in _config_blocks()]
    assert len(names) >= 2, "docs/MIGRATING.md needs a converted config for AgentJet and one for AgentFly"
    assert sorted(names) == sorted(EXPECTED), "a converted config without expectations here, or the reverse"


@pytest.mark.parametrize("block", _config_blocks(), ids=_name)
def test_converted_config_loads_with_the_promised_values(block, tmp_path):
    cfg = _load(block, tmp_path)
    wrong = {key: (_value(cfg, key), want) for key, want in EXPECTED[_name(block)].items()
             if _value(cfg, key) != want}
    assert not wrong, f"key: (loaded, promised by the doc): {wrong}"
    assert Path(cfg.rollout.agent).is_file()


def test_the_agentjet_config_debugs_on_our_backbone(tmp_path):
    """The doc's debug recipe: `harness train countdown.yaml --debug --set backbone=harness`."""
    (block,) = [b for b in _config_blocks() if _name(b) == "example_countdown"]
    cfg = _load(block, tmp_path, ("backbone=harness", "debug.enabled=true"))
    assert (cfg.backbone, cfg.debug.enabled, cfg.debug.n_tasks, cfg.debug.seed) == ("harness", True, 2, 12345)


def test_the_python_snippets_compile():
    snippets = _blocks("python")
    assert len(snippets) >= 2  # the countdown agent and judge
    for k, source in enumerate(snippets):
        compile(source, f"MIGRATING.md python block {k}", "exec")


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed")
@pytest.mark.filterwarnings("ignore:Disabled critic")  # verl's note that grpo needs no critic
@pytest.mark.parametrize("block", [b for b in _config_blocks() if "backbone: verl" in b], ids=_name)
def test_verl_blocks_translate_to_a_config_verl_accepts(block, tmp_path):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from trainer.rl.verl_backbone import VerlFiles, verl_config

    files = VerlFiles(tmp_path / "t.parquet", tmp_path / "v.parquet", tmp_path / "loop.yaml", tmp_path / "ck")
    c = verl_config(_load(block, tmp_path / "cfg"), files)
    validate_config(config=c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    for item in EXPECTED[_name(block)]["verl.overrides"]:
        key, _, raw = item.partition("=")
        assert OmegaConf.select(c, key) == yaml.safe_load(raw), item
