"""Chunk-aligned sharing: every shared node ends at a multiple of the GDN chunk (a plan option).

A node of the prefix tree ending at `E` is cut back to `B = floor(E / 64) * 64`; the rows `[B, E)`
become the first rows of every child (each member computes them itself, as packed execution
does). With the compact row laid out level by level (`build_layout(..., by_level=True)`), the GDN
rounds then read the compact row in order and no round replays a tail: `GDNIndex.src_identity`,
so the layer's five gathers and five scatter-adds disappear. The price is at most 63 rows per
member and node of token-wise work that the unaligned plan shares.
"""

from __future__ import annotations

from .gdn import CHUNK
from .tree import Node


def align_to_chunks(nodes: list[Node], min_prefix: int, nested_min: int) -> list[Node]:
    """The nodes cut back to chunk boundaries, parents before children as given.

    A root is kept if its cut length is at least `min_prefix` and one chunk; a nested node if its
    parent is kept and its cut length (from the parent's cut end) is at least `nested_min`.
    Members of a dropped nested node become leaves of its parent; a dropped node's descendants go too.
    """
    kept: list[Node] = []
    new_index: dict[int, int] = {}
    for i, node in enumerate(nodes):
        end = (node.end // CHUNK) * CHUNK
        if node.parent is None:
            start, parent = 0, None
            ok = end >= max(min_prefix, CHUNK)
        else:
            parent = new_index.get(node.parent)
            start = kept[parent].end if parent is not None else 0
            ok = parent is not None and end - start >= max(nested_min, CHUNK)
        if ok:
            new_index[i] = len(kept)
            kept.append(Node(node.members, start, end, parent))
    return kept
