"""The trainer's host side: one copy to the device per micro-batch, nothing read back inside the micro-batch loop,
metrics read once per mini-batch, and all of it bitwise what a plain padded, boolean-masked loop computes.

The plain loop is written here (`_plain_*`): padded CPU tensors, boolean-mask indexing, a `.item()` per
micro-batch, as trainer/ did before. The syncs are counted on the CPU with dispatch modes: the ops that make the
host wait for a GPU (reading a value, boolean-mask indexing, nonzero) are the same ops on the CPU.

Left: transformers reads the attention mask per forward (masking_utils._ignore_causal_mask_sdpa, to see whether it
may skip it: once without padding, twice with); without a mask it reads the position ids instead.
"""

from __future__ import annotations

import random
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from harness.core.records import Sample
from trainer.config import load_config
from trainer.config.checks import correction_of
from trainer.maths import algorithms as algo
from trainer.model.fsdp import init_distributed
from trainer.model.policy import collate, load_policy, micro_batches, padded, token_logprobs
from trainer.offline import loop as offline_loop
from trainer.rl import update as rl_update
from trainer.rl.correction import correct_rows

ROOT = Path(__file__).resolve().parents[2]
N_ROWS = 6


def _cfg(*overrides: str):
    return load_config(ROOT / "examples/train/terse.yaml",
                       ["model.path=/nowhere", "rollout.batch_size=3", "trainer.mini_batch_size=null",
                        "trainer.ppo_epochs=1", "rollout.temperature=0.7", "trainer.layout=padded", *overrides])


def _sample(episode: str, n: int, seed: int) -> Sample:
    rng = random.Random(seed)
    mask = [0] * 3 + [rng.choice((0, 1)) for _ in range(n - 4)] + [1]
    return Sample(episode, "role", ["c"], [0], [rng.randrange(2000) for _ in range(n)], mask,
                  [-rng.random() if m else 0.0 for m in mask])


ROWS = [_sample(f"e{i}", 6 + 3 * i, i) for i in range(N_ROWS)]
TASKS = [f"t{i % 3}" for i in range(N_ROWS)]  # three groups of two rows: one mini-batch (batch_size 3)
ADVANTAGES = [0.5, -1.0, 0.25, 1.0, -0.5, 0.75]


@pytest.fixture(scope="module")
def dist():
    return init_distributed(device="cpu")


def _model(model_dir):
    model = load_policy(model_dir)
    model.eval()  # no dropout: two runs see the same function
    return model


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------- the plain loop


def _plain_logprobs(model, batch, temperature, with_entropy=False, loss_only=False):
    """token_logprobs as it was: boolean-mask selection and masked_scatter, one chunk, on the CPU."""
    scale = 1.0 / temperature if temperature > 0 else 1.0
    keep = (batch.loss_mask[:, 1:] > 0) if loss_only else (batch.attention_mask[:, 1:] > 0)
    hidden = model.get_decoder()(input_ids=batch.token_ids, attention_mask=batch.attention_mask, use_cache=False)
    chosen = hidden.last_hidden_state[:, :-1][keep]
    logits = model.get_output_embeddings()(chosen).float()
    logp = torch.log_softmax(logits * scale if scale != 1.0 else logits, dim=-1)
    picked = logp.gather(-1, batch.token_ids[:, 1:][keep].unsqueeze(-1)).squeeze(-1)

    def place(values):
        out = torch.zeros(batch.token_ids.shape, dtype=torch.float32)
        shifted = torch.zeros_like(out[:, 1:]).masked_scatter(keep, values)
        return torch.cat([out[:, :1], shifted], dim=1)

    return place(picked), place(-(logp.exp() * logp).sum(-1)) if with_entropy else None


def _plain_update(model, optimizer, old, ref, cfg) -> tuple[dict, list]:
    """One mini-batch of the RL update over all ROWS: a .item() per micro-batch; the metrics and the gradients."""
    t = cfg.trainer
    weights = algo.token_weights(ROWS, t.loss_agg_mode)
    stats: dict[str, float] = {}
    all_tokens = max(sum(sum(r.loss_mask) for r in ROWS), 1)
    for idx in micro_batches(ROWS, t.micro_batch_tokens):
        batch = collate([ROWS[i] for i in idx], 0, indices=idx)
        mask = batch.loss_mask
        w, old_lp = padded([weights[i] for i in idx], mask), padded([old[i] for i in idx], mask)
        adv = torch.stack([ADVANTAGES[i] * mask[row] for row, i in enumerate(idx)])
        logprobs, entropy = _plain_logprobs(model, batch, cfg.rollout.temperature, True, loss_only=True)
        tis = algo.truncated_importance_weights(old_lp, batch.engine_logprobs, mask, t.tis_cap) if t.tis_cap else 1.0
        losses, log_ratio = algo.ppo_token_losses(logprobs, old_lp, adv, clip_low=t.clip_low, clip_high=t.clip_high,
                                                  dual_clip=t.dual_clip)
        pg_loss = (losses * tis * w).sum()
        loss = pg_loss
        if t.kl_coef > 0:
            kl = (algo.kl_penalty(logprobs, padded([ref[i] for i in idx], mask), t.kl_type) * w).sum()
            loss = loss + t.kl_coef * kl
            stats["actor/kl"] = stats.get("actor/kl", 0.0) + kl.item()
        ent = (entropy * w).sum()
        if t.entropy_coef > 0:
            loss = loss - t.entropy_coef * ent
        loss.backward()
        stats["actor/pg_loss"] = stats.get("actor/pg_loss", 0.0) + pg_loss.item()
        stats["actor/entropy"] = stats.get("actor/entropy", 0.0) + ent.item()
        share = float(mask.sum()) / all_tokens
        for key, value in algo.policy_metrics(log_ratio, adv, mask, t.clip_low, t.clip_high, t.dual_clip).items():
            before = stats.get(f"actor/{key}", 0.0)
            stats[f"actor/{key}"] = max(before, value) if key == "ratio_max" else before + value * share
    stats["actor/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf")))
    grads = _grads(model)  # clipped, as the optimizer steps with them
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats, grads


class _Recorded:
    """An optimizer that keeps the gradients it stepped with."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.grads = model, optimizer, None

    def step(self):
        self.grads = _grads(self.model)
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _old_and_ref(model):
    with torch.no_grad():
        lp, _ = _plain_logprobs(model, collate(ROWS, 0), 0.7, loss_only=True)
    old = [lp[i, :len(r.token_ids)] - 0.05 for i, r in enumerate(ROWS)]  # ratios away from 1
    ref = [lp[i, :len(r.token_ids)] + 0.1 * torch.tensor(r.loss_mask) for i, r in enumerate(ROWS)]
    return old, ref


# ---------------------------------------------------------------------------------------------- bitwise equal


@pytest.mark.parametrize("loss_only", [True, False])
def test_logprobs_entropy_and_their_gradients_equal_the_boolean_mask_ones(tiny_model_dir, loss_only):
    model = _model(tiny_model_dir)
    batch = collate(ROWS, 0)
    got = token_logprobs(model, batch, 0.7, with_entropy=True, loss_only=loss_only)  # one chunk, as the plain one
    (got[0].sum() + got[1].sum()).backward()
    got_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    want = _plain_logprobs(model, batch, 0.7, with_entropy=True, loss_only=loss_only)
    (want[0].sum() + want[1].sum()).backward()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _assert_same(got_grads, _grads(model))


@pytest.mark.parametrize("terms", [
    (),
    ("trainer.kl_coef=0.1", "trainer.entropy_coef=0.01", "trainer.tis_cap=2.0", "trainer.dual_clip=3.0",
     "trainer.kl_type=k3", "trainer.loss_agg_mode=token-mean"),
])
def test_the_rl_update_is_bitwise_the_plain_loop_s(tiny_model_dir, dist, terms):
    cfg = _cfg("trainer.micro_batch_tokens=40", *terms)
    assert len(micro_batches(ROWS, 40)) >= 3
    results = []
    for plain in (True, False):
        model = _model(tiny_model_dir)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        old, ref = _old_and_ref(model)
        if plain:
            stats, grads = _plain_update(model, optimizer, old, ref, cfg)
        else:
            recorded = _Recorded(model, optimizer)
            is_weights = correct_rows(ROWS, old, correction_of(cfg))[1]  # the step's (tis_cap: token TIS)
            stats = rl_update.update(model, recorded, ROWS, TASKS, ADVANTAGES, old, ref, 0, cfg, dist, is_weights)
            grads = recorded.grads
        results.append((stats, grads, [p.detach().clone() for p in model.parameters()]))
    (want, want_grads, want_params), (got, got_grads, got_params) = results
    counts = {key: got.pop(key) for key in ("update/tokens", "update/tokens_computed", "update/computed_ratio")}
    assert got == want  # every metric, exactly
    padded_positions = sum(collate([ROWS[i] for i in idx], 0).n_computed for idx in micro_batches(ROWS, 40))
    assert counts == {"update/tokens": sum(len(r.token_ids) for r in ROWS), "update/tokens_computed": padded_positions,
                      "update/computed_ratio": sum(len(r.token_ids) for r in ROWS) / padded_positions}
    _assert_same(got_grads, want_grads)
    _assert_same(got_params, want_params)


def test_scoring_the_rows_is_bitwise_the_plain_loop_s(tiny_model_dir):
    cfg = _cfg("trainer.micro_batch_tokens=40")
    model, reference = _model(tiny_model_dir), _model(tiny_model_dir)
    with torch.no_grad():
        reference.model.embed_tokens.weight.mul_(1.5)  # another model, so the reference's logprobs differ
    old, ref, metrics = rl_update.score_rows(model, reference, ROWS, 0, cfg)
    worst, total = 0.0, 0.0
    with torch.no_grad():
        for idx in micro_batches(ROWS, 40):
            batch = collate([ROWS[i] for i in idx], 0, indices=idx)
            lp, _ = _plain_logprobs(model, batch, 0.7, loss_only=True)
            ref_lp, _ = _plain_logprobs(reference, batch, 0.7, loss_only=True)
            diff = (lp - batch.engine_logprobs).abs() * batch.loss_mask
            worst, total = max(worst, float(diff.max())), total + float(diff.sum())
            for row, i in enumerate(idx):
                assert torch.equal(old[i], lp[row, :len(ROWS[i].token_ids)])
                assert torch.equal(ref[i], ref_lp[row, :len(ROWS[i].token_ids)])
    count = sum(sum(r.loss_mask) for r in ROWS)
    assert metrics == {"logprob/engine_max_abs_diff": worst, "logprob/engine_mean_abs_diff": total / count}


@pytest.mark.parametrize("loss_kind", ["sft", "pg"])
def test_the_offline_step_and_data_nll_are_bitwise_the_plain_loop_s(tiny_model_dir, dist, loss_kind):
    cfg = _cfg("trainer.micro_batch_tokens=40", "trainer.loss_agg_mode=token-mean")
    t = cfg.trainer
    weights = algo.token_weights(ROWS, t.loss_agg_mode)
    temperature = 0.7 if loss_kind == "pg" else 1.0
    model = _model(tiny_model_dir)
    got = offline_loop._step(model, ROWS, ADVANTAGES, weights, ROWS[0], 0, cfg, dist, loss_kind)
    got_grads = _grads(model)
    got_nll = offline_loop._data_nll(model, ROWS, 0, cfg, dist)
    model.zero_grad(set_to_none=True)

    want: dict[str, float] = {}
    tokens = sum(sum(r.loss_mask) for r in ROWS)
    nll_sum, nll_tokens = 0.0, 0.0
    for idx in micro_batches(ROWS, 40):
        batch = collate([ROWS[i] for i in idx], 0, indices=idx)
        mask, w = batch.loss_mask, padded([weights[i] for i in idx], batch.loss_mask)
        logprobs, _ = _plain_logprobs(model, batch, temperature, loss_only=True)
        nll = -(logprobs * w).sum()
        if loss_kind == "pg":
            adv = torch.tensor([ADVANTAGES[i] for i in idx]).unsqueeze(-1) * mask
            losses, log_ratio = algo.ppo_token_losses(logprobs, batch.engine_logprobs, adv, clip_low=t.clip_low,
                                                      clip_high=t.clip_high, dual_clip=t.dual_clip)
            loss = (losses * w).sum()
            for key, value in algo.policy_metrics(log_ratio, adv, mask, t.clip_low, t.clip_high, t.dual_clip).items():
                before = want.get(f"actor/{key}", 0.0)
                want[f"actor/{key}"] = max(before, value) if key == "ratio_max" else \
                    before + value * (float(mask.sum()) / tokens)
            want["actor/pg_loss"] = want.get("actor/pg_loss", 0.0) + loss.item()
            diff = float(((logprobs.detach() - batch.engine_logprobs).abs() * mask).sum()) / tokens
            want["logprob/behaviour_mean_abs_diff"] = want.get("logprob/behaviour_mean_abs_diff", 0.0) + diff
        else:
            loss = nll
            want["offline/nll"] = want.get("offline/nll", 0.0) + nll.item()
        loss.backward()
    want["offline/tokens"] = float(tokens)
    want_grads = _grads(model)
    with torch.no_grad():
        for idx in micro_batches(ROWS, 40):
            batch = collate([ROWS[i] for i in idx], 0, indices=idx)
            logprobs, _ = _plain_logprobs(model, batch, 1.0, loss_only=True)
            nll_sum, nll_tokens = nll_sum + float(-(logprobs * batch.loss_mask).sum()), \
                nll_tokens + float(batch.loss_mask.sum())
    padded_positions = sum(collate([ROWS[i] for i in idx], 0).n_computed for idx in micro_batches(ROWS, 40))
    assert got.pop("update/tokens_computed") == padded_positions
    assert got.pop("update/tokens") == sum(len(r.token_ids) for r in ROWS)
    assert got.pop("update/computed_ratio") == sum(len(r.token_ids) for r in ROWS) / padded_positions
    assert got == want
    _assert_same(got_grads, want_grads)
    assert got_nll == nll_sum / nll_tokens


# ---------------------------------------------------------------------------------------------- syncs, copies


class _Syncs(TorchDispatchMode):
    """Counts the ops that make the host wait for a GPU: reading a value (_local_scalar_dense: .item(), float(),
    int(), bool()), a result whose size depends on the values (nonzero, masked_select, boolean-mask indexing,
    masked_scatter), and copies between devices."""

    WAIT = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.nonzero.default",
            "aten.masked_select.default", "aten.masked_scatter.default", "aten.masked_scatter_.default"}

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        indices = args[1] if name.startswith(("aten.index.", "aten.index_put")) else ()
        if name in self.WAIT or any(i is not None and i.dtype == torch.bool for i in indices):
            if any(f.filename.endswith("transformers/masking_utils.py") for f in traceback.extract_stack()):
                name = "transformers reads the padding mask"  # outside trainer/: counted apart
            self.counts[name] = self.counts.get(name, 0) + 1
        if name.startswith("aten._to_copy") and "device" in kwargs and kwargs["device"] != args[0].device:
            self.counts["device copy"] = self.counts.get("device copy", 0) + 1
        return func(*args, **kwargs)


class _Reads(TorchFunctionMode):
    """Counts .tolist() (which reads without a dispatched op on the CPU) and calls of Tensor.to that name a
    device."""

    def __init__(self):
        super().__init__()
        self.tolist = self.to_device = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist:
            self.tolist += 1
        if func is torch.Tensor.to and (any(isinstance(a, (str, torch.device)) for a in args[1:]) or
                                        "device" in kwargs):
            self.to_device += 1
        return func(*args, **kwargs)


def _ours(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if k != "transformers reads the padding mask"}


def _counted(run, monkeypatch):
    """What `run()` syncs: the dispatch counts, the .tolist() calls, and the calls of the one transfer function."""
    copies = []
    from trainer.model import policy

    real = policy.to_device

    def counting(*args, **kwargs):
        copies.append(1)
        return real(*args, **kwargs)

    for module in (policy, rl_update, offline_loop):
        monkeypatch.setattr(module, "to_device", counting)
    syncs, reads = _Syncs(), _Reads()
    with syncs, reads:
        run()
    return syncs.counts, reads.tolist, len(copies)


def test_nothing_is_read_inside_the_micro_batch_loop_and_one_copy_moves_each_micro_batch(tiny_model_dir, dist,
                                                                                          monkeypatch):
    cfg = _cfg("trainer.micro_batch_tokens=40", "trainer.kl_coef=0.1", "trainer.entropy_coef=0.01",
               "trainer.tis_cap=2.0", "trainer.dual_clip=3.0")
    n_micro = len(micro_batches(ROWS, 40))
    assert n_micro >= 3
    model = _model(tiny_model_dir)
    old, ref = _old_and_ref(model)
    weights = algo.token_weights(ROWS, cfg.trainer.loss_agg_mode)
    is_weights = correct_rows(ROWS, old, correction_of(cfg))[1]
    assert all(w is not None for w in is_weights)

    def mini_batch():
        rl_update.mini_batch(model, ROWS, ADVANTAGES, old, ref, weights, ROWS[0], 0, cfg, dist, is_weights)

    syncs, tolist, copies = _counted(mini_batch, monkeypatch)
    assert _ours(syncs) == {} and tolist == 0  # the whole micro-batch loop, forward and backward: trainer/ never waits
    assert copies == n_micro  # one copy per micro-batch (token_logprobs finds the batch there already)

    # The mini-batch update: its metrics and gradient norm read once, however many micro-batches.
    per_mini = []
    for tokens in (10_000, 40):
        cfg_n = _cfg(f"trainer.micro_batch_tokens={tokens}", "trainer.kl_coef=0.1", "trainer.entropy_coef=0.01")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def update(cfg_n=cfg_n, optimizer=optimizer):
            rl_update.update(model, optimizer, ROWS, TASKS, ADVANTAGES, old, ref, 0, cfg_n, dist)

        per_mini.append(_counted(update, monkeypatch))
    (one_syncs, one_tolist, one_copies), (many_syncs, many_tolist, many_copies) = per_mini
    assert (one_copies, many_copies) == (1, n_micro)
    assert one_tolist == many_tolist == 1
    assert _ours(one_syncs) == _ours(many_syncs)  # what the optimizer step reads (AdamW's step count) neither


def test_scoring_and_the_offline_step_read_once(tiny_model_dir, dist, monkeypatch):
    cfg = _cfg("trainer.micro_batch_tokens=40", "trainer.loss_agg_mode=token-mean")
    n_micro = len(micro_batches(ROWS, 40))
    model, reference = _model(tiny_model_dir), _model(tiny_model_dir)
    weights = algo.token_weights(ROWS, cfg.trainer.loss_agg_mode)
    syncs, tolist, copies = _counted(lambda: rl_update.score_rows(model, reference, ROWS, 0, cfg), monkeypatch)
    assert (_ours(syncs), tolist, copies) == ({}, 1, n_micro)
    for kind in ("sft", "pg"):
        step = _counted(lambda kind=kind: offline_loop._step(model, ROWS, ADVANTAGES, weights, ROWS[0], 0, cfg,
                                                             dist, kind), monkeypatch)
        assert (_ours(step[0]), *step[1:]) == ({}, 1, n_micro)
    syncs, tolist, copies = _counted(lambda: offline_loop._data_nll(model, ROWS, 0, cfg, dist), monkeypatch)
    assert copies == n_micro and tolist == 0 and _ours(syncs) == {"aten._local_scalar_dense.default": 1}  # the mean


def test_what_is_left_is_transformers_look_at_the_attention_mask(tiny_model_dir, monkeypatch):
    model = _model(tiny_model_dir)
    same = [_sample("a", 12, 1), _sample("b", 12, 2)]
    for rows, reads in ((same, 1), ([same[0], _sample("c", 9, 3)], 2)):  # without padding, and with
        batch = collate(rows, 0)

        def run(batch=batch):
            logprobs, entropy = token_logprobs(model, batch, 0.7, with_entropy=True, loss_only=True)
            (logprobs.sum() + entropy.sum()).backward()

        assert _counted(run, monkeypatch) == ({"transformers reads the padding mask": reads}, 0, 0)
