"""LM-head rows: each distinct (compact row, next-token label) pair scored once, and the exact loss.

Every row of a shared node but its last has one hidden state and one next-token label across the
members (the next token is inside the node), so it is scored once; the node's last row predicts
the first row of each child (nested node or leaf), so it is scored once per child. That gives
`L = C + sum_nodes (children - 1)` scored rows, `T - sum_g (n_g - 1) (P_g - 1)` with one level. The structure is fixed at plan time; `lm_rows`
only reduces the labels onto the entries, so it never syncs. Members may mask a shared row
differently (a rollout masked out whole, multi-turn labels): an entry scores the row's valid label
if any member has one, and each position keeps its own mask in the loss. What must hold is that
valid labels of one shared row agree (true for shifted input ids, whose next token lies inside the
prefix); the LM head checks it every labelled call (`first_disagreement` on the host copy of a host row,
`LMRows.disagree` on the device otherwise) and scores a call whose labels disagree packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .layout import Layout
from .rows import Arena, counting


@dataclass(frozen=True, eq=False)
class LMIndex:
    rows: torch.Tensor  # [L] compact row of each scored entry
    label_src: torch.Tensor  # [L] packed position whose label the entry scores
    inverse: torch.Tensor  # [T] scored entry of each packed position
    length: int  # L
    host_inverse: np.ndarray | None = None  # `inverse` on the host: the head counts its rows there for a host row


def lm_host_index(layout: Layout, arena: Arena | None = None) -> dict:
    """Host arrays of the LM-row dedup, written into `arena` when given; uploaded by the plan builder."""
    arena = arena or Arena()
    c = layout.compact_length
    cu = layout.cu_array
    parent, end = layout.parent, layout.end
    # a node's last row is scored once more for every child after its first (in compact order);
    # entries ordered by node, then child
    segment = np.arange(len(parent), dtype=np.int64)
    has_parent = parent >= 0
    first_child = np.full(len(parent), len(parent), dtype=np.int64)
    np.minimum.at(first_child, parent[has_parent], segment[has_parent])
    later = (has_parent & (segment != first_child[np.maximum(parent, 0)])).nonzero()[0]
    later = later[parent[later].argsort(kind="stable")]
    node_of = parent[later]
    entry_of = np.full(len(parent), -1, dtype=np.int64)
    entry_of[later] = c + np.arange(len(later), dtype=np.int64)
    rows = arena.take(c + len(later))  # every compact row once, then each such node's last row again
    rows[:c] = counting(c)
    rows[c:] = layout.start[node_of] + layout.length[node_of] - 1
    label_src = arena.take(c + len(later))
    label_src[:c] = layout.compact_src
    label_src[c:] = cu[layout.source[later]] + end[node_of] - 1
    # every sequence whose path enters such a child: its row at the node's last offset reads that entry
    inverse = arena.put(layout.expand_index)  # rows inside a node read the source member's entries
    path = layout.ancestry[layout.sequence_segment]  # [N, levels]
    seq, depth = np.nonzero(path >= 0)
    on_path = path[seq, depth]
    entry = entry_of[on_path]
    hit = entry >= 0
    inverse[cu[seq[hit]] + end[parent[on_path[hit]]] - 1] = entry[hit]
    return {"length": len(rows), "rows": rows, "label_src": label_src, "inverse": inverse}


def lm_index(host: dict, dev: dict) -> LMIndex:
    # a copy: the host arrays live in the plan's upload buffer
    return LMIndex(dev["rows"], dev["label_src"], dev["inverse"], int(host["length"]), np.array(host["inverse"], copy=True))


@dataclass(frozen=True, eq=False)
class LMRows:
    """The rows to score with the LM head, their labels, and the map back to packed positions."""

    rows: torch.Tensor  # [L] compact rows: `hidden.index_select(1, rows)`
    labels: torch.Tensor  # [L] the label each entry scores
    inverse: torch.Tensor  # [T] entry of each packed position
    length: int  # L = C + sum over nodes (children - 1)
    _shift_labels: torch.Tensor
    _label_src: torch.Tensor

    def select(self, hidden: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The hidden states to score, `[1, C, d] -> [1, L, d]` (or along `dim`)."""
        return hidden.index_select(dim, self.rows)

    def expand(self, values: torch.Tensor) -> torch.Tensor:
        """Per-entry values (log-probs, entropy, nll) `[..., L]` back to packed positions: `[1, T]` for `[L]`.

        Its backward scatter-adds, so a shared entry receives the gradient of every position it serves.
        """
        out = values.index_select(-1, self.inverse)
        return out.unsqueeze(0) if out.dim() == 1 else out

    def disagree(self, ignore_index: int = -100) -> torch.Tensor:
        """A device bool, no sync: whether some position's valid label is not the one its shared entry scores (two
        members label a shared row differently, so the entries cannot serve every position)."""
        flat = self._shift_labels.reshape(-1)
        agrees = (flat == self.labels.index_select(0, self.inverse)) | (flat == ignore_index)
        return ~agrees.all()

    def check_labels(self, ignore_index: int = -100) -> None:
        """Raise if two members give a shared row different valid labels (one device sync; for tests and debugging)."""
        if bool(self.disagree(ignore_index)):
            raise ValueError("shift_labels differ between the members of a group inside the shared prefix")


def first_disagreement(host_inverse: np.ndarray, length: int, shift_labels: np.ndarray, ignore_index: int = -100):
    """`LMRows.disagree`'s question on the host copy of the labels (no device work, no sync): the first packed
    position whose valid label is not the one its entry scores (the largest valid label over the positions it
    serves), or None when every position's is."""
    flat = np.asarray(shift_labels).reshape(-1)
    entry = np.full(length, np.iinfo(flat.dtype).min, dtype=flat.dtype)
    np.maximum.at(entry, host_inverse, flat)
    bad = np.flatnonzero((flat != entry[host_inverse]) & (flat != ignore_index))
    return int(bad[0]) if len(bad) else None


def lm_rows(plan, shift_labels: torch.Tensor) -> LMRows:
    """Deduplicated LM-head rows for `shift_labels: [1, T]` (labels already shifted to the next token)."""
    idx: LMIndex = plan.lm
    if shift_labels.shape[-1] != plan.packed_length:
        raise ValueError(
            f"shift_labels has {shift_labels.shape[-1]} positions, the plan {plan.packed_length}"
        )
    # An entry serves one row of every member of a group; members may mask that row differently (a
    # rollout masked out whole, multi-turn labels). Valid labels of one shared row are one token (the
    # next prefix token), so the largest label per entry is that token whenever any member scores it,
    # and the ignore index only where none does. No host sync.
    flat = shift_labels.reshape(-1)
    labels = torch.full((idx.length,), torch.iinfo(flat.dtype).min, dtype=flat.dtype, device=flat.device)
    labels = labels.scatter_reduce(0, idx.inverse, flat, reduce="amax")
    return LMRows(idx.rows, labels, idx.inverse, idx.length, shift_labels, idx.label_src)


def shared_prefix_loss(
    per_token_nll: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The packed path's loss recomputed from per-token values expanded to `[1, T]`.

    Mean over valid labels, or sum over `num_items_in_batch`, like transformers' causal-LM loss.
    Needed whenever prompt tokens carry valid labels: a mean over the deduplicated rows would
    count each shared prompt token once instead of `n` times.
    """
    valid = shift_labels != ignore_index
    total = torch.where(valid, per_token_nll, torch.zeros_like(per_token_nll)).sum()
    if num_items_in_batch is None:
        return total / valid.sum()
    return total / num_items_in_batch
