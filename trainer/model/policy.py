"""The policy as the trainer sees it: merged samples in, padded batches, per-token logprobs out.

The trainer must score exactly the tokens the engine sampled with exactly the distribution the engine sampled
from. Three things make that hold:
- Samples carry the engine's own token ids (harness/core/merge.py), so nothing is retokenized here.
- The engine runs with `--logprobs-mode processed_logprobs` (running/vllm_server.py), so its logprobs are those of
  logits / temperature; `token_logprobs` divides the logits by the same temperature.
- Logits are turned into logprobs in float32, whatever the model's dtype.

Memory: the output layer is the largest activation of a small model with a big vocabulary ([tokens, vocab]
floats). `token_logprobs` runs the decoder once, then the output layer in chunks of positions; with gradients on,
each chunk is checkpointed, so only the hidden states stay alive and a chunk's logits are rebuilt in backward.

torch and transformers are imported here: `trainer` is the part of the project that needs them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from harness.core.records import Sample
from trainer.model.layout import Layout, lay_out, micro_batches, tree_masks

__all__ = ["Batch", "activations", "collate", "device_of", "load_policy", "micro_batches", "padded", "to_device",
           "token_logprobs"]

# Models whose logits are not just output_layer(hidden): they take the plain (unchunked) path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass
class Batch:
    """Samples as right-padded tensors, one row per sample, and the counts the host knows without reading them."""

    token_ids: torch.Tensor  # long [B, T]: the sample's token ids, pad_id after its end
    attention_mask: torch.Tensor  # long [B, T]: 1 on the sample's tokens, 0 on padding
    loss_mask: torch.Tensor  # float [B, T]: 1 where the engine sampled the token (the tokens trained on)
    engine_logprobs: torch.Tensor  # float [B, T]: the engine's logprob of each sampled token, 0 outside loss_mask
    episode_index: torch.Tensor  # long [B]: each row's episode, as an index into the collate's episode list
    sample_index: list[int]  # each row's position in the caller's list of samples (to put results back in order)
    n_tokens: int  # real (unpadded) tokens in the batch
    n_trained: int  # tokens with loss_mask > 0 (none is a row's first token: collate refuses that)
    layout: Layout | None = None  # where the forward runs (trainer/model/layout.py); None: on these padded rows

    @property
    def n_computed(self) -> int:
        """Positions the forward computes: the padded rows', or the layout's."""
        return self.layout.n_computed if self.layout is not None else self.token_ids.numel()

    @property
    def n_predicted(self) -> int:
        """Tokens with a token before them: what token_logprobs scores without loss_only."""
        return self.n_tokens - len(self.sample_index)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on `device`, in one copy (to_device)."""
        return to_device(device, self)[0]


def to_device(device: torch.device | str, batch: Batch, *tensors: torch.Tensor) -> tuple:
    """(batch, *tensors) on `device` in one host-to-device copy: every tensor packed into one byte buffer on the
    host (pinned on a GPU machine), moved with one non-blocking copy, then cut into views on the device. The
    copy is issued on a CPU-only machine too (where it returns the buffer itself), so there is one call per
    micro-batch either way."""
    names = [f.name for f in fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]
    laid = [f.name for f in fields(Layout) if isinstance(getattr(batch.layout, f.name, None), torch.Tensor)]
    host = [getattr(batch, name) for name in names] + [getattr(batch.layout, name) for name in laid] + list(tensors)
    # widest dtypes first: every piece then starts at a multiple of its element size, so its view is aligned
    order = sorted(range(len(host)), key=lambda i: -host[i].element_size())
    pieces = [host[i].detach().cpu().contiguous().reshape(-1).view(torch.uint8) for i in order]
    buffer = torch.empty(sum(p.numel() for p in pieces), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    torch.cat(pieces, out=buffer)
    moved = buffer.to(device, non_blocking=True)
    out: list[torch.Tensor | None] = [None] * len(host)
    start = 0
    for i, piece in zip(order, pieces, strict=True):
        out[i] = moved[start:start + piece.numel()].view(host[i].dtype).view(host[i].shape)
        start += piece.numel()
    moved_batch = replace(batch, **dict(zip(names, out[:len(names)], strict=True)))
    if laid:
        moved_batch.layout = replace(batch.layout, **dict(zip(laid, out[len(names):len(names) + len(laid)],
                                                              strict=True)))
    return (moved_batch, *out[len(names) + len(laid):])


def collate(samples: Sequence[Sample], pad_id: int, episode_ids: Sequence[str] | None = None, *,
            indices: Sequence[int] | None = None, layout: str = "padded") -> Batch:
    """Pad `samples` on the right into one Batch, rows in the order given.

    `episode_ids` numbers the episodes (a sample's episode_index is the position of its episode_id there); by
    default episodes are numbered in order of first appearance. `indices` are the samples' positions in the
    caller's list (default 0..B-1): pass a micro-batch's indices to find each row's sample again. `layout` is
    where the forward runs (trainer/model/layout.py: padded, packed or tree); the rows here stay padded, one a
    sample, for the losses.
    """
    if not samples:
        raise ValueError("collate needs at least one sample, got none")
    indices = list(range(len(samples))) if indices is None else list(indices)
    if len(indices) != len(samples):
        raise ValueError(f"collate got {len(samples)} samples but {len(indices)} indices")
    if episode_ids is None:
        episode_ids = list(dict.fromkeys(s.episode_id for s in samples))
    episode_of = {e: i for i, e in enumerate(episode_ids)}
    width = max(len(s.token_ids) for s in samples)
    shape = (len(samples), width)
    token_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    engine_logprobs = torch.zeros(shape, dtype=torch.float32)
    episode_index = torch.empty(len(samples), dtype=torch.long)
    for row, (sample, index) in enumerate(zip(samples, indices, strict=True)):
        _check_sample(sample, index)
        if sample.episode_id not in episode_of:
            raise ValueError(f"sample {index} belongs to episode {sample.episode_id!r}, which is not in the "
                             f"{len(episode_ids)} episode ids given to collate")
        n = len(sample.token_ids)
        mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
        token_ids[row, :n] = torch.tensor(sample.token_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = mask
        engine_logprobs[row, :n] = torch.tensor(sample.logprobs, dtype=torch.float32) * mask
        episode_index[row] = episode_of[sample.episode_id]
    return Batch(token_ids, attention_mask, loss_mask, engine_logprobs, episode_index, indices,
                 n_tokens=sum(len(s.token_ids) for s in samples),
                 n_trained=sum(1 for s in samples for m in s.loss_mask if m > 0),
                 layout=lay_out(samples, layout, pad_id))


def _check_sample(sample: Sample, index: int) -> None:
    n = len(sample.token_ids)
    if n == 0:
        raise ValueError(f"sample {index} (episode {sample.episode_id!r}) has no tokens")
    if len(sample.loss_mask) != n or len(sample.logprobs) != n:
        raise ValueError(f"sample {index} (episode {sample.episode_id!r}) has {n} token ids but "
                         f"{len(sample.loss_mask)} mask values and {len(sample.logprobs)} logprobs")
    if sample.loss_mask[0]:
        raise ValueError(f"sample {index} (episode {sample.episode_id!r}) marks its first token as sampled: "
                         "a first token has no context to be predicted from (a sample starts with a prompt)")


def padded(rows: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Per-row values (each as long as its sample) right-padded with zeros into a tensor shaped like `like` [B, T]."""
    out = torch.zeros_like(like)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def load_policy(model_dir: str | Path, dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = False,
                device: torch.device | str = "cpu", trust_remote_code: bool = False):
    """The model in `model_dir` as a trainable policy: train mode, no KV cache, on `device`.

    float32 keeps the trainer's logprobs within 1e-3 of a float32 engine's; bfloat16 halves memory on GPUs.
    """
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} has no config.json: not a transformers model directory "
                                "(build a test model with: harness tiny-model DIR)")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model.train()
    return model


def activations(offload: bool):
    """Where the activations a forward saves for its backward are kept: with `offload`, in CPU memory (pinned on a
    GPU machine) until the backward needs them (model.activation_offload); otherwise where they were computed."""
    if not offload:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def token_logprobs(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False, *,
                   loss_only: bool = False, chunk_tokens: int = 1024,
                   offload_activations: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs (and entropies) of `batch` under `model`, from logits / temperature, in float32.

    logprobs[b, t] = log p(token_ids[b, t] | token_ids[b, :t]); entropy[b, t] is the entropy of that same
    distribution. Both are 0 at position 0, on padding and, with `loss_only`, wherever loss_mask is 0 (which
    skips the output layer there: agent prompts are mostly context). A temperature of 0 means greedy sampling,
    whose logprobs vLLM reports from the unscaled logits: it counts as 1 here too.

    The output layer runs on at most `chunk_tokens` positions at a time (see the module docstring);
    `offload_activations` keeps what the backward needs in CPU memory meanwhile (`activations`). The model runs
    where its parameters are; a batch elsewhere is moved there first (one copy: to_device), and the results stay
    there (the loop moves its micro-batch once, masks and weights included, and computes the loss on the device).
    The positions scored are found with the count the host knows (Batch.n_trained / n_predicted), so nothing here
    waits for the device (transformers itself reads the attention mask once or twice per forward, to see whether
    it may skip it).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive number of positions, got {chunk_tokens!r}")
    scale = 1.0 / temperature if temperature > 0 else 1.0
    device = device_of(model)
    if batch.token_ids.device != device:
        batch = batch.to(device)
    # Position t is predicted from the output at t - 1: find the predicting positions once, for both paths, as
    # indices into the flattened [B * T] positions (the token predicted from position p is at p + 1).
    rows, width = batch.token_ids.shape
    keep = torch.zeros(rows, width, dtype=torch.bool, device=device)
    keep[:, :-1] = (batch.loss_mask[:, 1:] > 0) if loss_only else (batch.attention_mask[:, 1:] > 0)
    n = batch.n_trained if loss_only else batch.n_predicted
    at = torch.nonzero_static(keep.flatten(), size=n).squeeze(1)
    targets = batch.token_ids.flatten().index_select(0, at + 1)
    inputs, source = _inputs(model, batch, at, loss_only)
    with activations(offload_activations):
        head = _output_layer(model)
        if head is None:  # logits are more than output_layer(hidden): compute them all, then select
            logits = model(**inputs, use_cache=False).logits
            chosen = logits.flatten(0, 1).index_select(0, source)
            del logits
            pieces = [_score(chosen[s:s + chunk_tokens], targets[s:s + chunk_tokens], scale, with_entropy, None)
                      for s in range(0, n, chunk_tokens)]
        else:
            decoder = model.get_decoder()
            hidden = decoder(**inputs, use_cache=False)
            chosen = hidden.last_hidden_state.flatten(0, 1).index_select(0, source)
            pieces = []
            for s in range(0, n, chunk_tokens):
                args = (chosen[s:s + chunk_tokens], targets[s:s + chunk_tokens], scale, with_entropy, head)
                if torch.is_grad_enabled() and chosen.requires_grad:
                    pieces.append(checkpoint(_score, *args, use_reentrant=False))
                else:
                    pieces.append(_score(*args))
    logprobs = _place(batch, at + 1, [p[0] for p in pieces])
    entropy = _place(batch, at + 1, [p[1] for p in pieces]) if with_entropy else None
    return logprobs, entropy


def _inputs(model, batch: Batch, at: torch.Tensor, loss_only: bool) -> tuple[dict, torch.Tensor]:
    """The forward's inputs in the batch's layout, and the flat positions of its output that predict the tokens
    scored (`at`: the padded rows' own positions)."""
    laid = batch.layout
    if laid is None:
        return {"input_ids": batch.token_ids, "attention_mask": batch.attention_mask}, at
    inputs = {"input_ids": laid.input_ids, "position_ids": laid.position_ids, "attention_mask": None}
    if laid.attend is not None:  # the tree's own mask, in the form the model's attention takes
        inputs["attention_mask"] = tree_masks(model, laid)
    return inputs, laid.trained_from if loss_only else laid.predicted_from


def _score(x: torch.Tensor, targets: torch.Tensor, scale: float, with_entropy: bool,
           head: torch.nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target and entropy of each distribution, for N rows of hidden states (head given) or
    logits (head None); the [N, vocab] float32 logprobs live only inside this call."""
    logits = (head(x) if head is not None else x).float()
    logp = torch.log_softmax(logits * scale if scale != 1.0 else logits, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else chosen.new_zeros(())
    return chosen, entropy


def _place(batch: Batch, at: torch.Tensor, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces' values put at the flat positions `at` of a [B, T] tensor of zeros (keeping the graph)."""
    out = torch.zeros(batch.token_ids.numel(), dtype=torch.float32, device=batch.token_ids.device)
    if pieces:
        out = out.index_put((at,), torch.cat(pieces))
    return out.view(batch.token_ids.shape)


def _output_layer(model) -> torch.nn.Module | None:
    """The layer mapping hidden states to logits, when logits are exactly its output; else None."""
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    get_head, get_decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    if get_head is None or get_decoder is None:
        return None
    head, decoder = get_head(), get_decoder()
    if head is None or decoder is None or decoder is model:
        return None
    return head


def device_of(model) -> torch.device:
    """Where the model's parameters are (the CPU for a model without any)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")
