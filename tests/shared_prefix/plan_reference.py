"""The plan's index arrays built naively from their definitions: Python lists, a loop per segment,
sequence and row. The reference that the vectorised builders (`layout.py`, `gdn.py`, `conv.py`,
`attention.py`, `lm_rows.py`, the positions in `plan.py`) are compared with, array by array.

Definitions (docs/shared_prefix.md, shared/shared_prefix.md): a segment is a shared node, a member's
leaf (its rows after its deepest node) or a whole singleton; the compact row holds each root or
singleton in packed order followed depth first by its subtree, children ordered by first member
(level by level for chunk-aligned plans).
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK = 64


@dataclass
class Seg:
    offset: int  # offset inside its sequences of its first row
    length: int
    source: int  # the packed sequence whose rows it holds (a node's first member)
    parent: Seg | None
    node: int | None  # index into the plan's nodes, None for a leaf or singleton
    children: list
    start: int = 0  # compact row of its first row (set once laid out)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def path(self) -> list[Seg]:
        return ([] if self.parent is None else self.parent.path()) + [self]

    @property
    def level(self) -> int:
        return len(self.path()) - 1


def segments(nodes, cu, by_level=False) -> tuple[list[Seg], list[Seg]]:
    """(segments in compact order, each sequence's own segment)."""
    n_seq = len(cu) - 1
    node_segs = []
    for i, n in enumerate(nodes):
        parent = None if n.parent is None else node_segs[n.parent]
        seg = Seg(n.start, n.end - n.start, n.members[0], parent, i, [])
        node_segs.append(seg)
        if parent is not None:
            parent.children.append(seg)
    own, tops = [], []
    for s in range(n_seq):
        deepest = None
        for i, n in enumerate(nodes):
            if s in n.members and (deepest is None or n.end > nodes[deepest].end):
                deepest = i
        if deepest is None:
            seg = Seg(0, cu[s + 1] - cu[s], s, None, None, [])
            tops.append(seg)
        else:
            parent = node_segs[deepest]
            seg = Seg(parent.end, cu[s + 1] - cu[s] - parent.end, s, parent, None, [])
            parent.children.append(seg)
        own.append(seg)
    tops += [seg for seg in node_segs if seg.parent is None]

    def first_member(seg):
        return min(nodes[seg.node].members) if seg.node is not None else seg.source

    order = []

    def visit(seg):
        order.append(seg)
        for child in sorted(seg.children, key=first_member):
            visit(child)

    for top in sorted(tops, key=first_member):
        visit(top)
    if by_level:
        order = [seg for lvl in range(max(s.level for s in order) + 1) for seg in order if seg.level == lvl]
    row = 0
    for seg in order:
        seg.start = row
        row += seg.length
    return order, own


def rows(seg) -> list[int]:
    return list(range(seg.start, seg.start + seg.length))


def boundaries(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def chunk_table(lengths) -> list[tuple[int, int]]:
    return [(i, c) for i, n in enumerate(lengths) for c in range(-(-n // CHUNK))]


def reference_arrays(nodes, cu, pos_rows, conv_kernel_size=4, chunk_aligned=False) -> dict:
    """Every index array of the plan of these nodes, as lists. `pos_rows`: `[R][T]` lists or None."""
    order, own = segments(nodes, cu, by_level=chunk_aligned)
    index = {id(seg): i for i, seg in enumerate(order)}
    c = sum(seg.length for seg in order)
    out = {}
    out["compact_src"] = [cu[seg.source] + seg.offset + i for seg in order for i in range(seg.length)]
    out["expand_index"] = [r for s in range(len(cu) - 1) for seg in own[s].path() for r in rows(seg)]
    if pos_rows is None:
        out["positions"] = [[seg.offset + i for seg in order for i in range(seg.length)]]
    else:
        out["positions"] = [[row[t] for t in out["compact_src"]] for row in pos_rows]
    blocks = [seg.start for seg in order if chunk_aligned or seg.parent is None]
    out["cu_seqlens"] = blocks + [c]
    out |= _gdn(order, index, c)
    out |= _conv(order, conv_kernel_size)
    out |= _attention(order)
    out |= _lm(order, own, index, cu, c, out)
    return out


def _gdn(order, index, c) -> dict:
    """Round 0: roots up to their last chunk boundary B, singletons whole; round l: per node of level
    l-1 its tail [B, E) alone, then per child tail + child (a nested child up to its own B)."""
    shared = [seg for seg in order if seg.node is not None]
    depth = 1 + max((seg.level for seg in shared), default=-1)

    def aligned_end(seg):
        return seg.end // CHUNK * CHUNK

    def own_rows(seg):  # the rows a segment runs itself: a shared node up to its B
        n = aligned_end(seg) - seg.offset if seg.node is not None else seg.length
        return list(range(seg.start, seg.start + n))

    def tail_rows(seg):
        b = aligned_end(seg) - seg.offset
        return list(range(seg.start + b, seg.start + seg.length))

    rounds, run_of, where = [], {}, {}  # where: compact row -> row of cat(every round's inputs)
    total = 0
    entries = [seg for seg in order if seg.parent is None and own_rows(seg)]
    rnd = {"seqs": [], "state": None}
    for i, seg in enumerate(entries):
        run_of[id(seg)] = i
        for r in own_rows(seg):
            where[r] = total
            total += 1
        rnd["seqs"].append(own_rows(seg))
    rounds.append(rnd)
    for lvl in range(1, depth + 1):
        rnd = {"seqs": [], "state": []}
        for seg in order:
            if seg.node is not None and seg.level == lvl - 1 and tail_rows(seg):
                rnd_entries = [(seg, None)]
            else:
                rnd_entries = []
            if seg.parent is not None and seg.level == lvl:
                rnd_entries = [(seg.parent, seg)]
            for parent, child in rnd_entries:
                tail = tail_rows(parent)
                mine = [] if child is None else own_rows(child)
                rnd["state"].append(run_of.get(id(parent), -1))
                for r in tail:
                    if child is None:
                        where[r] = total
                    total += 1
                for r in mine:
                    where[r] = total
                    total += 1
                if child is not None and child.node is not None:
                    run_of[id(child)] = len(rnd["seqs"])
                rnd["seqs"].append(tail + mine)
        rounds.append(rnd)
    # alone entries sit before their children: rebuild each level's order by segment
    out = {"rounds": len(rounds), "out_index": [where[r] for r in range(c)]}
    joint = []
    for r, rnd in enumerate(rounds):
        lengths = [len(s) for s in rnd["seqs"]]
        joint += rnd["seqs"]
        if not lengths:
            continue
        out[f"src{r}"] = [x for s in rnd["seqs"] for x in s]
        out[f"cu{r}"] = boundaries(lengths)
        out[f"chunks{r}"] = chunk_table(lengths)
        out[f"offsets{r}"] = boundaries([-(-n // CHUNK) for n in lengths])
        out[f"export{r}"] = r + 1 < len(rounds)
        if rnd["state"] is not None:
            zero = any(s < 0 for s in rnd["state"])
            out[f"zero{r}"] = zero
            out[f"state{r}"] = [0 if s < 0 else s + zero for s in rnd["state"]]
    lengths = [len(s) for s in joint]
    out["src"] = [x for s in joint for x in s]
    out["cu_joint"] = boundaries(lengths)
    out["chunks_joint"] = chunk_table(lengths)
    out["offsets_joint"] = boundaries([-(-n // CHUNK) for n in lengths])
    out["src_identity"] = out["src"] == list(range(c))
    out["out_identity"] = out["out_index"] == list(range(c))
    return {f"gdn.{k}": v for k, v in out.items()}


def _conv(order, w) -> dict:
    """Per non-empty segment: the last `min(W-1, offset)` rows of its parent, then its rows."""
    src, lengths, out_index, seg_lengths, state = [], [], [], [], []
    for seg in order:
        if not seg.length:
            continue
        back = 0 if seg.parent is None else min(w - 1, seg.offset)
        parent_end = 0 if seg.parent is None else seg.parent.start + seg.parent.length
        look = list(range(parent_end - back, parent_end))
        out_index += [len(src) + back + i for i in range(seg.length)]
        src += look + rows(seg)
        lengths.append(back + seg.length)
        seg_lengths.append(seg.length)
        state.append([parent_end - (w - s) if s > 0 and s >= w - back else -1 for s in range(w)])
    return {
        "conv.src": src,
        "conv.cu": boundaries(lengths),
        "conv.out_index": out_index,
        "conv.segment_cu": boundaries(seg_lengths),
        "conv.segment_chunks": chunk_table(seg_lengths),
        "conv.state_rows": state,
    }


def _attention(order) -> dict:
    """Per non-empty segment: its queries against every ancestor's keys, root first, then its own."""
    segs = [seg for seg in order if seg.length]
    return {
        "attention.kv_src": [r for seg in segs for a in seg.path() for r in rows(a)],
        "attention.cu_q": boundaries([seg.length for seg in segs]),
        "attention.cu_k": boundaries([seg.offset + seg.length for seg in segs]),
        "attention.max_q": max(seg.length for seg in segs),
        "attention.max_k": max(seg.offset + seg.length for seg in segs),
    }


def _lm(order, own, index, cu, c, arrays) -> dict:
    """Every compact row scored once, a node's last row once more per child after its first."""
    extra = []  # (node segment, child segment), by node then child in compact order
    for seg in order:
        kids = sorted((ch for ch in order if ch.parent is seg), key=lambda ch: index[id(ch)])
        extra += [(seg, ch) for ch in kids[1:]]
    entry_of = {id(ch): c + i for i, (_, ch) in enumerate(extra)}
    rows_ = list(range(c)) + [node.start + node.length - 1 for node, _ in extra]
    label_src = arrays["compact_src"] + [cu[ch.source] + node.end - 1 for node, ch in extra]
    inverse = list(arrays["expand_index"])
    for s in range(len(cu) - 1):
        for seg in own[s].path():
            if id(seg) in entry_of:
                inverse[cu[s] + seg.parent.end - 1] = entry_of[id(seg)]
    return {"lm.rows": rows_, "lm.label_src": label_src, "lm.inverse": inverse, "lm.length": len(rows_)}


def plan_arrays(plan) -> dict:
    """The same arrays read off a built plan (host copies of the device tensors)."""
    gdn = plan.gdn
    out = {
        "compact_src": plan.compact_src.tolist(),
        "expand_index": plan.expand_index.tolist(),
        "positions": plan.position_ids.reshape(-1, plan.compact_length).tolist(),
        "cu_seqlens": plan.cu_seqlens.tolist(),
        "gdn.rounds": len(gdn.rounds),
        "gdn.out_index": gdn.out_index.tolist(),
        "gdn.src": gdn.src.tolist(),
        "gdn.cu_joint": gdn.joint.cu_seqlens.tolist(),
        "gdn.chunks_joint": [tuple(x) for x in gdn.joint.chunk_indices.tolist()],
        "gdn.offsets_joint": gdn.joint.chunk_offsets.tolist(),
        "gdn.src_identity": gdn.src_identity,
        "gdn.out_identity": gdn.out_identity,
    }
    for r, rnd in enumerate(gdn.rounds):
        if rnd is None:
            continue
        out |= {
            f"gdn.src{r}": rnd.src.tolist(),
            f"gdn.cu{r}": rnd.cu_seqlens.tolist(),
            f"gdn.chunks{r}": [tuple(x) for x in rnd.chunk_indices.tolist()],
            f"gdn.offsets{r}": rnd.chunk_offsets.tolist(),
            f"gdn.export{r}": rnd.export_state,
        }
        if rnd.state_index is not None:
            out[f"gdn.zero{r}"] = rnd.zero_state
            out[f"gdn.state{r}"] = rnd.state_index.tolist()
    conv, attn, lm = plan.conv, plan.attention, plan.lm
    out |= {
        "conv.src": conv.src.tolist(),
        "conv.cu": conv.cu_seqlens.tolist(),
        "conv.out_index": conv.out_index.tolist(),
        "conv.segment_cu": conv.segment_cu.tolist(),
        "conv.segment_chunks": [tuple(x) for x in conv.segment_chunks.tolist()],
        "conv.state_rows": conv.state_rows.tolist(),
        "attention.kv_src": attn.kv_src.tolist(),
        "attention.cu_q": attn.cu_seqlens_q.tolist(),
        "attention.cu_k": attn.cu_seqlens_k.tolist(),
        "attention.max_q": attn.max_seqlen_q,
        "attention.max_k": attn.max_seqlen_k,
        "lm.rows": lm.rows.tolist(),
        "lm.label_src": lm.label_src.tolist(),
        "lm.inverse": lm.inverse.tolist(),
        "lm.length": lm.length,
    }
    return out
