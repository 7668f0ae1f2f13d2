"""FSDP2 on 2 CPU processes (gloo) computes what one unsharded process computes.

The worker below runs both ways, from the same source: under torchrun on 2 ranks, each with half of a fixed
batch and the model sharded by `trainer.model.fsdp.shard`; and in this process (`launch(1, ...)`), unsharded, on the
whole batch. It computes a masked token-mean loss through the two paths the trainer uses (the model's own
forward, and the decoder then the output layer on checkpointed chunks, as trainer/model/policy.py does), takes one
AdamW step, and saves the loss, the gradients and the updated weights. A LoRA variant trains adapters over the
frozen base (trainer/model/lora.py) the same way, and writes the adapter a push writes from the gathered state.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainer.model.fsdp import Dist, all_reduce_mean, init_distributed, launch, shutdown, under_torchrun

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    '''
    import sys
    from pathlib import Path

    import torch
    from torch.utils.checkpoint import checkpoint
    from transformers import AutoModelForCausalLM

    from trainer.model.fsdp import Dist, all_reduce_mean, full_state_dict, init_distributed, shard, shutdown
    from trainer.model.lora import LoraSpec, save_adapter, with_adapter

    model_dir, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    sharded = mode == "sharded"
    gen = torch.Generator().manual_seed(0)
    IDS = torch.randint(0, 2000, (4, 24), generator=gen)
    MASK = (torch.rand(4, 23, generator=gen) < 0.6).float()  # loss on targets 1..23: uneven counts per rank
    MASK[:, :3] = 0  # a "prompt"


    def nll_sum(model, ids, mask, path):
        """Sum of -log p(target) over masked targets, through the model's forward or decoder + chunked head."""
        if path == "forward":
            logits = model(input_ids=ids).logits[:, :-1].float()
        else:
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
            head = model.get_output_embeddings()
            chunks = [checkpoint(head, hidden[:, s : s + 8], use_reentrant=False) for s in range(0, 23, 8)]
            logits = torch.cat(chunks, dim=1).float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return -(logp * mask).sum()


    if sharded:
        dist = init_distributed(device="cpu")
    else:
        dist = Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu"), is_main=True)
    ids, mask = IDS[dist.rank :: dist.world], MASK[dist.rank :: dist.world]
    # A token mean over the global batch: FSDP averages gradients over ranks, so scale by world / global count.
    tokens = all_reduce_mean(mask.sum().item(), dist) * dist.world
    results = {}
    variants = {"forward": {}, "decoder_head": {}, "options": dict(gradient_checkpointing=True, param_offload=True,
                                                                   mixed_precision=True), "lora": {}}
    for name, options in variants.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if name == "lora":  # adapters over the frozen base, B made non-zero so every adapter weight has a gradient
            model = with_adapter(model, LoraSpec(rank=4, target_modules=("q_proj", "down_proj")))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        model.train()
        if sharded:
            model = shard(model, dist, **options)
        elif options.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)
        local = nll_sum(model, ids, mask, "decoder_head" if name == "decoder_head" else "forward") / tokens * dist.world
        local.backward()
        loss = all_reduce_mean(local.item(), dist)
        grads = {n: (p.grad.full_tensor() if sharded else p.grad).clone() for n, p in model.named_parameters()
                 if p.requires_grad}
        optimizer.step()
        state = full_state_dict(model, dist) if sharded else {k: v.clone() for k, v in model.state_dict().items()}
        results[name] = {"loss": loss, "grads": grads, "params": state}
        if name == "lora" and dist.is_main:  # the adapter as a push writes it, from the gathered state
            save_adapter(model, Path(f"{out}.adapter"), state)
        if dist.rank == 1:
            results[name]["rank1_full_state_dict"] = state
    torch.save(results, f"{out}.rank{dist.rank}.pt")
    if sharded:
        shutdown()
    '''
)


def _run_worker(tmp_path: Path, model_dir: Path, monkeypatch) -> tuple[dict, dict, dict]:
    import torch

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # torchrun's workers run the script from tmp_path: they find this checkout through PYTHONPATH.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    assert launch(2, [str(script), str(model_dir), str(tmp_path / "sharded"), "sharded"]) == 0
    assert launch(1, [str(script), str(model_dir), str(tmp_path / "single"), "single"]) == 0
    load = lambda name: torch.load(tmp_path / name, weights_only=True)  # noqa: E731
    return load("sharded.rank0.pt"), load("sharded.rank1.pt"), load("single.rank0.pt")


def _max_rel(a: dict, b: dict) -> float:
    """Largest |a - b| over all tensors, relative to the largest |b|."""
    diff = max((a[k] - b[k]).abs().max().item() for k in b)
    scale = max(b[k].abs().max().item() for k in b)
    return diff / scale


def test_two_process_fsdp_matches_one_unsharded_process(tmp_path, tiny_model_dir, monkeypatch):
    sharded, rank1, single = _run_worker(tmp_path, tiny_model_dir, monkeypatch)
    reference = single["forward"]
    assert set(sharded["lora"]["grads"]) == {k for k in single["lora"]["grads"] if "lora_" in k}  # only adapters
    assert set(sharded) == {"forward", "decoder_head", "options", "lora"}
    report = []
    for name, result in sharded.items():
        reference = single["lora"] if name == "lora" else single["forward"]
        loss_rel = abs(result["loss"] - reference["loss"]) / abs(reference["loss"])
        grad_rel = _max_rel(result["grads"], reference["grads"])
        param_abs = max((result["params"][k] - reference["params"][k]).abs().max().item() for k in reference["params"])
        report.append(f"{name}: loss rel {loss_rel:.1e}, grad rel {grad_rel:.1e}, params abs {param_abs:.1e}")
        assert loss_rel <= 1e-5, report[-1]
        assert grad_rel <= 1e-5, report[-1]
        # One AdamW step moves each weight by ~lr = 1e-3 (the first step is lr * sign(grad) where |grad| >> eps).
        assert param_abs <= 1e-5, report[-1]
        assert rank1[name]["rank1_full_state_dict"] is None
    print("\n".join(report))
    # The adapter a two-rank push writes is the adapter one process trains.
    from safetensors.torch import load_file

    two, one = load_file(tmp_path / "sharded.adapter/adapter_model.safetensors"), \
        load_file(tmp_path / "single.adapter/adapter_model.safetensors")
    assert two.keys() == one.keys() and len(two) == 8  # A and B of q_proj and down_proj, 2 layers
    assert max((two[k] - one[k]).abs().max().item() for k in one) <= 1e-5
    # The unsharded reference itself: both loss paths agree.
    reference = single["forward"]
    assert abs(single["decoder_head"]["loss"] - reference["loss"]) <= 1e-6 * abs(reference["loss"])


def test_tied_embeddings_stay_one_parameter_on_two_ranks(tmp_path, tied_model, monkeypatch):
    """With tied embeddings, FSDP2 shards the input and output embeddings as one unit: the shared weight stays one
    parameter, trained once, as in one unsharded process (two units would make it two parameters, untied)."""
    sharded, _, single = _run_worker(tmp_path, tied_model, monkeypatch)
    for name in ("forward", "decoder_head", "options"):
        result, reference = sharded[name], single["forward"]
        assert set(result["grads"]) == set(reference["grads"]) and "lm_head.weight" not in reference["grads"]
        assert _max_rel(result["grads"], reference["grads"]) <= 1e-5, name
        params = result["params"]
        assert torch.equal(params["lm_head.weight"], params["model.embed_tokens.weight"]), name
        # A tenth of one AdamW step (lr 1e-3): the tied weight's gradient sums its two uses in another order on two
        # ranks, and Adam's first step divides by |grad|, so its rows of near-zero gradient move a little apart.
        assert max((params[k] - reference["params"][k]).abs().max().item() for k in reference["params"]) <= 1e-4


def test_one_process_without_torchrun_gets_a_one_rank_group(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert not under_torchrun()
    try:
        dist = init_distributed(device="cpu")
        import torch.distributed

        assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
        assert (dist.rank, dist.world, dist.is_main, dist.device.type) == (0, 1, True, "cpu")
        assert all_reduce_mean(2.5, dist) == 2.5
    finally:
        shutdown()


def test_partial_torchrun_environment_is_refused(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="RANK"):
        init_distributed(device="cpu")


def test_launch_with_one_process_runs_in_this_process(tmp_path, monkeypatch):
    script = tmp_path / "entry.py"
    script.write_text(
        "import os, sys\n"
        "open(sys.argv[1], 'w').write(f'{os.getpid()} {sys.argv[2:]}')\n"
        "if len(sys.argv) > 2:\n"
        "    sys.exit(int(sys.argv[2]))\n"
    )
    argv = sys.argv[:]
    assert launch(1, [str(script), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out").read_text() == f"{os.getpid()} []"
    assert launch(1, [str(script), str(tmp_path / "out"), "3"]) == 3
    monkeypatch.syspath_prepend(str(tmp_path))
    assert launch(1, ["-m", "entry", str(tmp_path / "out"), "4"]) == 4
    assert (tmp_path / "out").read_text() == f"{os.getpid()} ['4']"
    assert sys.argv == argv


def test_launch_inside_a_worker_is_refused(monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="x", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    assert under_torchrun()
    with pytest.raises(RuntimeError, match="under_torchrun"):
        launch(2, ["train.py"])


def test_dist_is_a_frozen_record():
    import dataclasses

    import torch

    dist = Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu"), is_main=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dist.rank = 1


CRITIC_WORKER = textwrap.dedent(
    '''
    import random
    import sys

    import torch

    from harness.core.records import Sample
    from trainer.config import load_config
    from trainer.model.critic import Critic
    from trainer.model.fsdp import full_state_dict, init_distributed, shutdown

    model_dir, out, config = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = load_config(config, [f"model.path={model_dir}", "trainer.adv_estimator=gae", "trainer.critic.lr=1e-2",
                               "trainer.ppo_epochs=2", "rollout.batch_size=2", "trainer.micro_batch_tokens=24"])
    dist = init_distributed(device="cpu")
    torch.manual_seed(0)
    critic = Critic(cfg, dist, total_steps=10)
    rng = random.Random(0)
    rows = []
    for i in range(5):  # 5 rows: rank 0 gets 3, rank 1 gets 2, in micro-batches of 24 tokens
        n = 8 + 3 * i
        mask = [0] * 3 + [rng.choice((0, 1)) for _ in range(n - 4)] + [1]
        rows.append(Sample(f"e{i}", "r", [], [], [rng.randrange(2000) for _ in range(n)], mask, [0.0] * n))
    returns = [torch.tensor(r.loss_mask, dtype=torch.float32) * (1.0 if i % 2 else -0.5) for i, r in enumerate(rows)]
    values = critic.values(rows, 0)
    stats = critic.update(rows, [f"task{i % 2}" for i in range(5)], returns, values, 0)
    after = critic.values(rows, 0)
    state = full_state_dict(critic.model, dist)
    if dist.is_main:
        torch.save({"stats": stats, "state": state, "after": after}, out)
    shutdown()
    '''
)


def test_the_critic_on_two_fsdp_ranks_makes_the_update_of_one_process(tmp_path, tiny_model_dir, monkeypatch):
    import torch

    script = tmp_path / "critic_worker.py"
    script.write_text(CRITIC_WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    config = str(ROOT / "examples/train/terse.yaml")
    assert launch(2, [str(script), str(tiny_model_dir), str(tmp_path / "two.pt"), config]) == 0
    assert launch(1, [str(script), str(tiny_model_dir), str(tmp_path / "one.pt"), config]) == 0
    two, one = (torch.load(tmp_path / name, weights_only=True) for name in ("two.pt", "one.pt"))
    assert two["stats"]["critic/vf_loss"] == pytest.approx(one["stats"]["critic/vf_loss"], rel=1e-5)
    assert one["stats"]["critic/vf_loss"] > 0
    # two AdamW steps at lr 1e-2: Adam's first steps are ~lr x sign(grad), so a gradient that is ~0 on one side
    # may round the other way; everything else agrees far closer
    assert _max_rel(two["state"], one["state"]) <= 1e-4
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(two["after"], one["after"], strict=True))
    assert any(v.abs().max() > 0 for v in one["after"])  # the zero head learned something


SHUTDOWN_WORKER = textwrap.dedent(
    '''
    import sys
    import time
    from pathlib import Path

    import torch.distributed

    from trainer.model.fsdp import init_distributed, shutdown

    mode, folder = sys.argv[1], Path(sys.argv[2])
    dist = init_distributed(device="cpu")
    if mode == "clean":  # rank 0 is still busy (writing the model) when rank 1 reaches the end
        if dist.is_main:
            time.sleep(1.0)
            (folder / "rank0-wrote").write_text("done")
        shutdown()
        if not dist.is_main:
            (folder / "rank1-saw").write_text(str((folder / "rank0-wrote").exists()))
    else:  # rank 1 fails while rank 0 waits for something rank 1 would have sent: rank 1 must leave at once
        # both ranks joined first: gloo's init can return on rank 1 while rank 0 still connects to it (seen under load)
        torch.distributed.barrier()
        if dist.is_main:
            deadline = time.monotonic() + 60
            while not (folder / "rank1-left").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            (folder / "rank0-saw").write_text(str((folder / "rank1-left").exists()))
            torch.distributed.destroy_process_group()  # rank 1 is gone: no barrier to meet it at
        else:
            try:
                try:
                    raise RuntimeError("rank 1 fails")
                finally:
                    shutdown()
            except RuntimeError:
                (folder / "rank1-left").write_text("left")
    '''
)


@pytest.mark.parametrize("mode", ["clean", "failing"])
def test_shutdown_waits_for_every_rank_on_a_clean_exit_only(tmp_path, monkeypatch, mode):
    """A clean exit leaves the group together (a rank tearing it down under another died of SIGABRT in gloo); a rank
    leaving with an exception does not wait for ranks that may be stuck in a collective."""
    script = tmp_path / "shutdown_worker.py"
    script.write_text(SHUTDOWN_WORKER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    assert launch(2, [str(script), mode, str(tmp_path)]) == 0
    if mode == "clean":
        assert (tmp_path / "rank1-saw").read_text() == "True"  # rank 1 left only after rank 0 had finished
    else:
        assert (tmp_path / "rank0-saw").read_text() == "True"  # rank 1 left while rank 0 was still working
