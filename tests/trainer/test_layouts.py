"""trainer.layout: packed rows and the prefix tree (trainer/model/layout.py) compute what padded rows compute.

The step here is shaped like a GRPO step of an agent: one system prompt for every task, each task's prompt for its
group, episodes of two calls whose second prompt extends the first reply (one sample), episodes split into two
samples where the second repeats the first's history, a sample that is a prefix of another (a node that is both
a leaf and a fork), one that shares nothing, and one of two tokens. Logprobs and entropies are held to 1e-5 of
padded's (relative, past 1), and every gradient to 1e-5 of the largest gradient entry (fp32, CPU), on the tiny
model and on the real SmolLM2, with LoRA and gradient checkpointing, with eager attention, through the RL update,
the scoring pass and the offline step, and on 2 FSDP ranks.
"""

from __future__ import annotations

import os
import random
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.core.records import Sample
from trainer.config import ConfigError, load_config
from trainer.maths import algorithms as algo
from trainer.model.fsdp import init_distributed, launch
from trainer.model.layout import lay_out
from trainer.model.lora import LoraSpec, with_adapter
from trainer.model.policy import collate, micro_batches, token_logprobs
from trainer.offline import loop as offline_loop
from trainer.rl import update as rl_update

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ("packed", "tree")
TOL = 1e-5


def grpo_step(seed: int = 0, tasks: int = 3, group: int = 3) -> list[Sample]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(n)]

    def sample(episode: str, ids: list[int], mask: list[int]) -> Sample:
        return Sample(episode, "role", ["c"], [0], ids, mask, [-rng.random() if m else 0.0 for m in mask])

    system = tokens(12)
    out = []
    for task in range(tasks):
        prompt = system + tokens(4)
        for e in range(group):
            reply, tool, second = tokens(rng.randrange(2, 6)), tokens(3), tokens(rng.randrange(2, 6))
            first = [0] * len(prompt) + [1] * len(reply)
            if e == group - 1:  # split: the second sample repeats the history, trained on its own reply only
                out.append(sample(f"t{task}e{e}", prompt + reply, first))
                out.append(sample(f"t{task}e{e}", prompt + reply + tool + second,
                                  [0] * (len(first) + len(tool)) + [1] * len(second)))
            else:
                out.append(sample(f"t{task}e{e}", prompt + reply + tool + second, first + [0] * 3 + [1] * len(second)))
    out.append(sample("prefix", out[0].token_ids[:len(system) + 6], out[0].loss_mask[:len(system) + 6]))
    out.append(sample("alone", [1, *tokens(8)], [0, 0, 0, 1, 1, 1, 0, 1, 1]))
    out.append(sample("short", [2, 5], [0, 1]))
    return out


STEP = grpo_step()


def _model(model_dir, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    model.config.use_cache = False
    model.eval()  # no dropout: every layout sees the same function
    return model


def _forward(model, samples, layout, loss_only, **kwargs):
    model.zero_grad(set_to_none=True)
    batch = collate(samples, 0, layout=layout)
    logprobs, entropy = token_logprobs(model, batch, 0.7, with_entropy=True, loss_only=loss_only, **kwargs)
    weights = torch.linspace(0.5, 1.5, logprobs.numel()).view_as(logprobs)  # every position its own weight
    ((logprobs * weights).sum() + 0.1 * (entropy * weights).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads, batch


def _assert_close_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1e-5 of each value, or of 1 for values under 1 (a real model's logprobs of random tokens reach -20)."""
    assert bool(((got - want).abs() <= TOL * want.abs().clamp_min(1.0)).all()), float((got - want).abs().max())


def _assert_close_grads(got: dict, want: dict) -> None:
    """Every entry of every gradient within 1e-5 of the largest gradient entry."""
    assert got.keys() == want.keys() and want
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0
    for name, g in want.items():
        assert float((got[name] - g).abs().max()) <= TOL * scale, name


def _assert_same_forward(model, samples, layout, loss_only=True, **kwargs):
    want = _forward(model, samples, "padded", loss_only, **kwargs)
    got = _forward(model, samples, layout, loss_only, **kwargs)
    _assert_close_values(got[0], want[0])
    _assert_close_values(got[1], want[1])
    _assert_close_grads(got[2], want[2])
    return got[3], want[3]


# ------------------------------------------------------------------------------------------------ the forward


@pytest.mark.parametrize("loss_only", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_scores_and_differentiates_as_padded_rows_do(tiny_model_dir, layout, loss_only):
    laid, padded = _assert_same_forward(_model(tiny_model_dir), STEP, layout, loss_only, chunk_tokens=16)
    assert padded.n_computed == len(STEP) * max(len(s.token_ids) for s in STEP)
    assert laid.n_computed < padded.n_computed


def test_the_tree_computes_each_shared_token_once(tiny_model_dir):
    """Nodes = distinct prefixes: the system prompt once, each task's prompt once, each episode's history once."""
    laid = lay_out(STEP, "tree", 0)
    prefixes = {tuple(s.token_ids[:k + 1]) for s in STEP for k in range(len(s.token_ids))}
    assert laid.n_computed == len(prefixes) < sum(len(s.token_ids) for s in STEP) / 2
    # a token's position is its depth, and it attends to exactly its ancestors and itself
    depth = laid.position_ids[0]
    assert torch.equal(laid.attend[0, 0].sum(-1), depth + 1)
    packed = lay_out(STEP, "packed", 0)
    assert packed.n_computed <= len(STEP) * max(len(s.token_ids) for s in STEP)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_with_lora_and_gradient_checkpointing(tiny_model_dir, layout):
    torch.manual_seed(0)
    model = with_adapter(_model(tiny_model_dir), LoraSpec(rank=4, alpha=8.0))
    with torch.no_grad():  # B starts at zero: give the adapter something to say, so A's gradients are not zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing runs in train mode; the tiny model and the adapter have no dropout
    _assert_same_forward(model, STEP, layout)


def test_eager_attention_takes_the_tree_mask_as_scores_to_add(tiny_model_dir):
    model = _model(tiny_model_dir, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    _assert_same_forward(model, STEP, "tree", loss_only=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_real_smollm2(smollm2_dir, layout):
    """Tied embeddings, Llama attention, 49k vocabulary: the same equalities on a real model."""
    _assert_same_forward(_model(smollm2_dir), grpo_step(1, tasks=2, group=2), layout)


# ------------------------------------------------------------------------------------------- micro-batches


@pytest.mark.parametrize("budget", [9, 40, 64, 1000])
def test_micro_batches_hold_every_sample_once_within_the_budget(budget):
    for layout in ("padded", *LAYOUTS):
        groups = micro_batches(STEP, budget, layout)
        assert sorted(i for g in groups for i in g) == list(range(len(STEP))), layout
        for g in groups:
            computed = collate([STEP[i] for i in g], 0, layout=layout).n_computed
            assert computed <= budget or len(g) == 1, (layout, g, computed)
    nodes = collate(STEP, 0, layout="tree").n_computed
    assert micro_batches(STEP, nodes, "tree") == [sorted(range(len(STEP)), key=lambda i: STEP[i].token_ids)]
    assert len(micro_batches(STEP, nodes, "padded")) > 2  # the whole step in one tree: padded needs several


def test_a_bad_layout_is_refused_naming_it():
    with pytest.raises(ValueError, match="layout must be one of padded, packed, tree, got 'ragged'"):
        micro_batches(STEP, 100, "ragged")
    with pytest.raises(ValueError, match="'ragged'"):
        collate(STEP, 0, layout="ragged")
    with pytest.raises(ConfigError, match="trainer.layout"):
        _cfg("trainer.layout=ragged")


def test_models_with_a_sliding_window_see_it_in_the_tree_too(tiny_model_dir, tmp_path):
    """A window of 8 tokens over samples of 20-35: Qwen2 with its second layer sliding (one mask per kind of layer)
    and a Mistral whose every layer slides (one windowed mask) score and differentiate as their padded rows do."""
    import json
    import shutil

    from transformers import MistralConfig

    mixed = tmp_path / "mixed"
    shutil.copytree(tiny_model_dir, mixed)
    config = json.loads((mixed / "config.json").read_text())
    config.update(sliding_window=8, use_sliding_window=True, max_window_layers=1)
    config.pop("layer_types", None)
    (mixed / "config.json").write_text(json.dumps(config))
    model = _model(mixed)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    _assert_same_forward(model, STEP, "tree", loss_only=False)

    torch.manual_seed(0)
    mistral = AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=256), dtype=torch.float32)
    mistral.config.use_cache = False
    mistral.eval()
    _assert_same_forward(mistral, STEP, "tree", loss_only=False)
    mistral.config.sliding_window = None  # the window mattered: without it the scores move
    batch = collate(STEP, 0, layout="tree")
    with torch.no_grad():
        unwindowed = token_logprobs(mistral, batch, 0.7)[0]
    mistral.config.sliding_window = 8
    with torch.no_grad():
        assert float((unwindowed - token_logprobs(mistral, collate(STEP, 0), 0.7)[0]).abs().max()) > 1e-3


# ---------------------------------------------------------------------------------------------- the loops


def _cfg(*overrides: str):
    return load_config(ROOT / "examples/train/terse.yaml",
                       ["model.path=/nowhere", "rollout.batch_size=3", "trainer.mini_batch_size=null",
                        "trainer.ppo_epochs=1", "rollout.temperature=0.7", *overrides])


TASKS = [s.episode_id[:2] for s in STEP]
ADVANTAGES = [((i * 7) % 5 - 1.5) / 2 for i in range(len(STEP))]  # not summing to 0


@pytest.fixture(scope="module")
def dist():
    return init_distributed(device="cpu")


def _old_and_ref(model):
    with torch.no_grad():
        lp, _ = token_logprobs(model, collate(STEP, 0), 0.7, loss_only=True)
    old = [lp[i, :len(s.token_ids)] - 0.05 for i, s in enumerate(STEP)]
    ref = [lp[i, :len(s.token_ids)] + 0.1 * torch.tensor(s.loss_mask) for i, s in enumerate(STEP)]
    return old, ref


@pytest.mark.parametrize("terms", [
    ("trainer.loss_agg_mode=seq-mean-token-sum",),
    ("trainer.kl_coef=0.1", "trainer.entropy_coef=0.01", "trainer.tis_cap=2.0", "trainer.dual_clip=3.0",
     "trainer.kl_type=k3", "trainer.loss_agg_mode=token-mean"),
    ("trainer.loss_agg_mode=seq-mean-token-mean",),
])
def test_the_rl_update_in_each_layout_is_the_padded_one(tiny_model_dir, dist, terms):
    results = {}
    for layout in ("padded", *LAYOUTS):
        cfg = _cfg("trainer.micro_batch_tokens=60", f"trainer.layout={layout}", *terms)
        model = _model(tiny_model_dir).double()  # the decoder in float64: what differs is the wiring, not rounding
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # the step is the gradient: compare it as one
        old, ref = _old_and_ref(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        stats = rl_update.update(model, optimizer, STEP, TASKS, ADVANTAGES, old, ref, 0, cfg, dist)
        results[layout] = stats, {n: (before[n] - p.detach()) / 0.5 for n, p in model.named_parameters()}
    want_stats, want_step = results["padded"]
    assert want_stats["actor/pg_loss"] != 0
    computed = {layout: results[layout][0].pop("update/tokens_computed") for layout in results}
    ratios = {layout: results[layout][0].pop("update/computed_ratio") for layout in results}
    assert computed["tree"] < computed["packed"] <= computed["padded"]  # what each layout is for
    assert ratios["tree"] == want_stats["update/tokens"] / computed["tree"] > 1 > ratios["padded"]
    for layout in LAYOUTS:
        stats, step = results[layout]
        assert stats.keys() == want_stats.keys()
        for key, value in want_stats.items():
            assert stats[key] == pytest.approx(value, rel=TOL, abs=1e-4), (layout, key)  # logprobs ~-7, see above
        _assert_close_grads(step, want_step)


def test_scoring_the_rows_in_each_layout_is_the_padded_one(tiny_model_dir):
    model, reference = _model(tiny_model_dir), _model(tiny_model_dir)
    with torch.no_grad():
        reference.model.embed_tokens.weight.mul_(1.5)
    scored = {layout: rl_update.score_rows(model, reference, STEP, 0,
                                          _cfg("trainer.micro_batch_tokens=50", f"trainer.layout={layout}"))
              for layout in ("padded", *LAYOUTS)}
    old, ref, metrics = scored["padded"]
    for layout in LAYOUTS:
        got_old, got_ref, got_metrics = scored[layout]
        for a, b in zip(got_old + got_ref, old + ref, strict=True):
            _assert_close_values(a, b)
        assert got_metrics == pytest.approx(metrics, rel=TOL)


@pytest.mark.parametrize("loss_kind", ["sft", "pg"])
def test_the_offline_step_in_each_layout_is_the_padded_one(tiny_model_dir, dist, loss_kind):
    results = {}
    for layout in ("padded", *LAYOUTS):
        cfg = _cfg("trainer.micro_batch_tokens=50", "trainer.loss_agg_mode=token-mean", f"trainer.layout={layout}")
        weights = algo.token_weights(STEP, cfg.trainer.loss_agg_mode)
        model = _model(tiny_model_dir)
        stats = offline_loop._step(model, STEP, ADVANTAGES, weights, STEP[0], 0, cfg, dist, loss_kind)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        stats["nll"] = offline_loop._data_nll(model, STEP, 0, cfg, dist)
        computed = stats.pop("update/tokens_computed")
        assert stats.pop("update/computed_ratio") == stats["update/tokens"] / computed
        results[layout] = stats, grads
    want_stats, want_grads = results["padded"]
    for layout in LAYOUTS:
        stats, grads = results[layout]
        assert stats == pytest.approx(want_stats, rel=TOL, abs=1e-4), layout
        _assert_close_grads(grads, want_grads)


WORKER = textwrap.dedent(
    '''
    import sys

    import torch

    from tests.trainer.test_layouts import ADVANTAGES, STEP, TASKS, _cfg
    from trainer.model.build import build_policy
    from trainer.model.fsdp import full_state_dict, init_distributed, shutdown
    from trainer.model.policy import collate, token_logprobs
    from trainer.rl import update as rl_update

    model_dir, out, layout = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = _cfg(f"model.path={model_dir}", "trainer.micro_batch_tokens=60", f"trainer.layout={layout}",
               "trainer.lr=1e-4", "trainer.kl_coef=0.05", "trainer.entropy_coef=0.01")
    dist = init_distributed(device="cpu")
    built = build_policy(cfg, dist, total_steps=4, mode="rl")
    with torch.no_grad():
        lp, _ = token_logprobs(built.model, collate(STEP, 0), 0.7, loss_only=True)
    old = [lp[i, :len(s.token_ids)] - 0.05 for i, s in enumerate(STEP)]
    stats = rl_update.update(built.model, built.optimizer, STEP, TASKS, ADVANTAGES, old, old, 0, cfg, dist)
    state = full_state_dict(built.model, dist)
    if dist.is_main:
        torch.save({"stats": stats, "state": state}, out)
    shutdown()
    '''
)


def two_ranks_and_one(worker: str, tmp_path: Path, monkeypatch, args: list[str], two: tuple[str, ...] = (),
                      one: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Run the `worker` script on 2 FSDP ranks and on 1 process (`args`, then its output file, then `two` or
    `one`); what each saved."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    assert launch(2, [str(script), *args, str(tmp_path / "two.pt"), *two]) == 0
    assert launch(1, [str(script), *args, str(tmp_path / "one.pt"), *one]) == 0
    return tuple(torch.load(tmp_path / name, weights_only=True) for name in ("two.pt", "one.pt"))


def test_the_tree_on_two_fsdp_ranks_makes_the_padded_update_of_one_process(tmp_path, tiny_model_dir, monkeypatch):
    two, one = two_ranks_and_one(WORKER, tmp_path, monkeypatch, [str(tiny_model_dir)], ("tree",), ("padded",))
    tree, padded = (d["stats"].pop("update/tokens_computed") for d in (two, one))
    assert tree < padded / 1.5  # even split over two ranks, each rank's tree shares what its rows share
    for d in (two, one):
        d["stats"].pop("update/computed_ratio")
    assert two["stats"] == pytest.approx(one["stats"], rel=1e-4, abs=1e-6)
    assert one["stats"]["actor/pg_loss"] != 0
    for name, value in one["state"].items():  # one AdamW step at 1e-4: ~lr x sign(grad), so 1e-4 of the largest
        assert float((two["state"][name] - value).abs().max()) <= 1e-4 * max(float(value.abs().max()), 1.0), name
