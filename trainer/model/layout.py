"""Where a micro-batch's tokens sit for the forward pass. Three layouts, one result:

- padded: one sample a row, right-padded to the longest (the padding is computed, then ignored);
- packed: several samples a row, each with positions restarting at 0 and attending only to itself (no padding
  computed but a row's tail); rows as wide as the longest sample, so a dense mask never costs more attention
  than padding did;
- tree: the samples' common token prefixes (by the engine's ids) laid out once: a token's position is its depth,
  it attends to its ancestors only, and the output at a fork predicts the first token of every branch. A GRPO
  group's episodes share their system prompt, tools and task; a split episode repeats its history in each sample.

Losses stay in the samples' own frame ([B, T], one row a sample, as padded): a layout only says where each
predicted token's hidden state comes from (`predicted_from`, `trained_from`), and token_logprobs gathers there.
A position shared by several samples is computed once and its gradient is the sum of theirs, which is exactly
the unshared computation's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from harness.core.records import Sample
from trainer.model.fsdp import metrics_over_ranks

__all__ = ["LAYOUTS", "Layout", "computed_metrics", "lay_out", "micro_batches", "tree_masks"]

LAYOUTS = ("padded", "packed", "tree")


@dataclass
class Layout:
    """A micro-batch laid out for the forward pass (packed or tree), with the map back to the samples' frame."""

    input_ids: torch.Tensor  # long [R, L]
    position_ids: torch.Tensor  # long [R, L]
    attend: torch.Tensor | None  # bool [R, 1, L, L] (tree): True where a query may attend a key; None: by positions
    predicted_from: torch.Tensor  # long [n_predicted]: flat position in [R * L] whose output predicts each token
    trained_from: torch.Tensor  # long [n_trained]: the same for the trained tokens
    n_computed: int  # positions the forward runs on (R * L)


def micro_batches(samples: Sequence[Sample], max_tokens: int, layout: str = "padded") -> list[list[int]]:
    """Sample indices split into micro-batches whose forward computes at most `max_tokens` positions in `layout`
    (padded: rows x longest row, longest samples first so rows of similar length share a micro-batch; packed:
    rows as wide as the longest; tree: its nodes). A sample longer than that goes alone; every index appears
    exactly once."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive number of tokens, got {max_tokens!r}")
    if layout == "tree":
        return _plan_tree(samples, max_tokens)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].token_ids))
    batches: list[list[int]] = []
    width = 0  # the longest row of the current micro-batch: its first, since samples come longest first
    free: list[int] = []  # packed: room left in each row of the current micro-batch
    for i in order:
        n = len(samples[i].token_ids)
        if batches and layout == "padded" and (len(batches[-1]) + 1) * width <= max_tokens:
            batches[-1].append(i)
            continue
        if batches and layout == "packed":
            row = next((r for r, room in enumerate(free) if room >= n), None)
            if row is not None or (len(free) + 1) * width <= max_tokens:
                batches[-1].append(i)
                if row is None:
                    free.append(width - n)
                else:
                    free[row] -= n
                continue
        batches.append([i])
        width, free = n, [0]
    return batches


def computed_metrics(samples: Sequence[Sample], computed: int, dist) -> dict[str, float]:
    """What one pass over `samples` (the same on every rank) cost in `layout`: their tokens, the positions the
    forwards computed (`computed`: this rank's, added up over ranks), and tokens per position computed."""
    done = metrics_over_ranks({"update/tokens_computed": float(computed)}, 1.0, dist,
                              summed=("update/tokens_computed",))["update/tokens_computed"]
    tokens = float(sum(len(s.token_ids) for s in samples))
    return {"update/tokens": tokens, "update/tokens_computed": done, "update/computed_ratio": tokens / max(done, 1.0)}


def _plan_tree(samples: Sequence[Sample], max_tokens: int) -> list[list[int]]:
    """In token order, so each sample shares the most it can with the one before it (in sorted order the longest
    prefix a sample shares with any earlier one is the one it shares with its neighbour): a micro-batch grows while
    its tree's nodes fit."""
    order = sorted(range(len(samples)), key=lambda i: samples[i].token_ids)
    batches: list[list[int]] = []
    nodes = 0
    before: list[int] = []
    for i in order:
        ids = samples[i].token_ids
        new = len(ids) - _common(before, ids)
        if batches and nodes + new <= max_tokens:
            batches[-1].append(i)
            nodes += new
        else:
            batches.append([i])
            nodes = len(ids)
        before = ids
    return batches


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def lay_out(samples: Sequence[Sample], layout: str, pad_id: int) -> Layout | None:
    """The layout of one micro-batch's samples (rows of the sample frame in the order given); None for padded."""
    if layout == "padded":
        return None
    if layout == "packed":
        return _packed(samples, pad_id)
    if layout == "tree":
        return _tree(samples)
    raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def _maps(samples: Sequence[Sample], where) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted_from, trained_from): where(b, t) for each predicting position t of each sample b, in the sample
    frame's row-major order; trained_from keeps those whose next token is trained."""
    predicted, trained = [], []
    for b, sample in enumerate(samples):
        mask = sample.loss_mask
        for t in range(len(sample.token_ids) - 1):
            at = where(b, t)
            predicted.append(at)
            if mask[t + 1] > 0:
                trained.append(at)
    return torch.tensor(predicted, dtype=torch.long), torch.tensor(trained, dtype=torch.long)


def _packed(samples: Sequence[Sample], pad_id: int) -> Layout:
    """First fit, longest first, into rows as wide as the longest sample; a row's tail is padding whose positions
    restart too, so it is a sequence of its own (no query is left with nothing to attend)."""
    width = max(len(s.token_ids) for s in samples)
    order = sorted(range(len(samples)), key=lambda b: -len(samples[b].token_ids))
    used: list[int] = []
    start = [0] * len(samples)  # flat position of each sample's first token
    for b in order:
        n = len(samples[b].token_ids)
        row = next((r for r, filled in enumerate(used) if filled + n <= width), None)
        if row is None:
            row = len(used)
            used.append(0)
        start[b] = row * width + used[row]
        used[row] += n
    ids = torch.full((len(used) * width,), pad_id, dtype=torch.long)
    positions = torch.empty(len(used) * width, dtype=torch.long)
    for b, sample in enumerate(samples):
        n = len(sample.token_ids)
        ids[start[b]:start[b] + n] = torch.tensor(sample.token_ids, dtype=torch.long)
        positions[start[b]:start[b] + n] = torch.arange(n)
    for row, filled in enumerate(used):
        positions[row * width + filled:(row + 1) * width] = torch.arange(width - filled)
    predicted, trained = _maps(samples, lambda b, t: start[b] + t)
    return Layout(ids.view(len(used), width), positions.view(len(used), width), None, predicted, trained,
                  n_computed=len(used) * width)


def _tree(samples: Sequence[Sample]) -> Layout:
    """The samples' prefix tree in one row, nodes in order of creation (a parent before its children)."""
    node_of: dict[tuple[int, int], int] = {}  # (parent node, token id) -> node
    parents: list[int] = []
    tokens: list[int] = []
    depth: list[int] = []
    paths: list[list[int]] = []
    for sample in samples:
        parent, path = -1, []
        for token in sample.token_ids:
            node = node_of.get((parent, token))
            if node is None:
                node = node_of[(parent, token)] = len(tokens)
                parents.append(parent)
                tokens.append(token)
                depth.append(len(path))
            path.append(node)
            parent = node
        paths.append(path)
    n = len(tokens)
    attend = torch.zeros(n, n, dtype=torch.bool)
    for node, parent in enumerate(parents):  # a node attends to what its parent does, and to itself
        if parent >= 0:
            attend[node] = attend[parent]
        attend[node, node] = True
    predicted, trained = _maps(samples, lambda b, t: paths[b][t])
    return Layout(torch.tensor(tokens, dtype=torch.long).view(1, n), torch.tensor(depth, dtype=torch.long).view(1, n),
                  attend.view(1, 1, n, n), predicted, trained, n_computed=n)


# ------------------------------------------------------------------------------------------- the tree's mask


def tree_masks(model, laid: Layout) -> torch.Tensor | dict[str, torch.Tensor]:
    """The tree's mask for the model: each token's ancestors, and within its sliding window where the model has
    one (a key is in the window when its depth is less than `sliding_window` above the query's, as transformers
    counts positions); a model that mixes full and sliding layers gets one mask per kind of layer."""
    config = model.config
    implementation, dtype = _attention(model), next(model.parameters()).dtype
    full = _tree_mask(laid.attend, implementation, dtype)
    window = _sliding_window(config)
    if window is None:
        return full
    depth = laid.position_ids
    near = laid.attend & ((depth[:, None, :, None] - depth[:, None, None, :]) < window)
    windowed = _tree_mask(near, implementation, dtype)
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return {"full_attention": full, "sliding_attention": windowed}
    return windowed


def _sliding_window(config) -> int | None:
    """The sliding window the model's layers attend through (all of them, or those whose layer type says so), or
    None."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if "sliding_attention" in types else None
    return window if getattr(config, "use_sliding_window", True) else None


def _tree_mask(attend: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """A [R, 1, L, L] mask of who attends to whom for an attention implementation that takes a dense one: as is
    (True: attend) for sdpa, added to the scores (0 or the dtype's lowest) for eager. flash attention takes no
    such mask."""
    if implementation == "sdpa":
        return attend
    if implementation == "eager":
        return torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill(
            ~attend, torch.finfo(dtype).min)
    raise ValueError(f"the tree layout needs a dense attention mask, which attention implementation "
                     f"{implementation!r} does not take: use trainer.layout packed (or padded), or load the model "
                     "with sdpa or eager attention")


def _attention(model) -> str:
    """The attention implementation the model runs (transformers' config._attn_implementation)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"
