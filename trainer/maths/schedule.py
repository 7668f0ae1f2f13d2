"""The order of a run's tasks and its learning-rate schedule: both pure functions of the step, so a resumed run
continues exactly where it stopped."""

from __future__ import annotations

import math
import random


def next_tasks(tasks: list, pos: int, size: int, shuffle: bool, seed: int) -> tuple[list, int]:
    """The next `size` tasks of an endless sequence of passes over the tasks (each pass shuffled by its number).

    A batch that spans two passes never holds a task twice while there are at least `size` tasks: the new pass's
    first tasks that the old pass's last ones already put in the batch are swapped with later ones of the new
    pass (`pass_order`). Batches start `pos % size` past a multiple of `size`, as the training loop takes them."""
    if not tasks:
        raise ValueError("no tasks to take a batch from")
    n, phase, out = len(tasks), pos % size, []
    while len(out) < size:
        epoch, offset = divmod(pos, n)
        out.append(tasks[pass_order(n, epoch, size, phase, shuffle, seed)[offset]])
        pos += 1
    return out, pos


_orders: dict[tuple, list[list[int]]] = {}  # (n, size, phase, shuffle, seed) -> each pass's order so far


def pass_order(n: int, epoch: int, size: int, phase: int, shuffle: bool, seed: int) -> list[int]:
    """The order of pass `epoch` over n tasks: shuffled by its number, then its head mended so that the batch that
    spans it and the pass before (batches of `size` starting at `phase` mod `size`) holds no task twice. A pure
    function of its arguments (a resumed run gets the same order); passes are computed in turn and kept."""
    key = (n, size, phase, shuffle, seed)
    orders = _orders.setdefault(key, [])
    while len(orders) <= epoch:
        e = len(orders)
        order = list(range(n))
        if shuffle:
            random.Random(seed * 100_003 + e).shuffle(order)
        start = e * n
        before = (start - phase) % size  # how many of the spanning batch's tasks come from the passes before
        if e > 0 and before and size <= n:
            taken = set(_positions(orders, n, start - before, start))
            head = size - before
            for i in range(head):
                if order[i] in taken:
                    j = next(j for j in range(i + 1, n) if order[j] not in taken)  # there are n - before >= head
                    order[i], order[j] = order[j], order[i]
        orders.append(order)
    return orders[epoch]


def _positions(orders: list[list[int]], n: int, first: int, last: int) -> list[int]:
    """The task indices at positions first..last-1 of the passes computed so far."""
    return [orders[p // n][p % n] for p in range(max(first, 0), last)]


def lr_factor(warmup: int, schedule: str, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if schedule == "linear":
            return max(0.0, 1 - progress)
        return 1.0
    return factor
