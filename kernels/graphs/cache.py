"""The bounded cache of captured layer stacks (least recently used first out) and its counters.

Every entry owns its static buffers, its graphs and their private memory pool (about one eager step's
activations of the stack); evicting an entry drops all of them. Captures cost a few eager steps each:
when most calls capture (batch layouts that never repeat), the cache warns once with the counts.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class GraphsRecapturing(UserWarning):
    """Most calls of the graphed layer stack capture a new graph: batch layouts rarely repeat, so the graphs cost time."""


@dataclass
class GraphStats:
    """What the cache did: captures (misses), replays (hits), evictions; and the calls that ran eagerly with the graphs
    on (``"eager"``, or ``"auto"``'s choice in ``shared_prefix_cuda_graphs_training`` / ``_scoring``: neither a
    capture nor a replay)."""

    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager: int = 0

    @property
    def calls(self) -> int:
        return self.captures + self.replays


@dataclass
class Entry:
    static: object  # StaticCall
    replay: object  # CudaGraphReplay or EagerReplay
    params: list
    generation: int = 0  # forward replays so far (the backward checks it is still the latest)
    bucket: tuple | None = None  # the padded plan's bucket counts (None: keyed on the exact layout)
    mode: str = "train"  # "train" (forward and backward graphs), "score" / "infer" (a forward-only graph captured
    # under no_grad / inference mode)


@dataclass
class GraphCache:
    """At most `max_entries` captured stacks, by call key (`signature.call_signature`)."""

    max_entries: int = 2
    warn_after: int = 8  # calls before the recapture warning may fire
    stats: GraphStats = field(default_factory=GraphStats)
    _entries: OrderedDict = field(default_factory=OrderedDict)
    _warned: bool = False

    def __post_init__(self):
        if isinstance(self.max_entries, bool) or not isinstance(self.max_entries, int) or self.max_entries < 1:
            raise ValueError(f"a graph cache holds at least one entry, got max_entries={self.max_entries!r}")

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.stats.replays += 1
        return entry

    def put(self, key, entry: Entry) -> None:
        """Add a freshly captured entry, evicting the least recently used ones beyond `max_entries`."""
        self.stats.captures += 1
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.stats.evictions += 1
        logger.info("shared_prefix_cuda_graphs: captured a layer stack (%s)", self.describe())
        self._maybe_warn()

    def make_room(self) -> None:
        """Drop the oldest entries before a capture, so that at most `max_entries` pools are held during it."""
        while len(self._entries) >= self.max_entries:
            self._entries.popitem(last=False)
            self.stats.evictions += 1

    def held_buckets(self, mode: str = "train") -> tuple:
        """The buckets of the held entries of `mode`, most recently used first."""
        return tuple(e.bucket for e in reversed(self._entries.values()) if e.bucket is not None and e.mode == mode)

    def clear(self) -> None:
        self.stats.evictions += len(self._entries)
        self._entries.clear()

    def describe(self) -> str:
        s = self.stats
        return (f"{s.captures} captures, {s.replays} replays, {s.evictions} evictions, {len(self)}/{self.max_entries} held, "
                f"{s.eager} calls eager")

    def _maybe_warn(self) -> None:
        s = self.stats
        # eager calls ("auto"'s or an "eager" setting's) count: they are the calls the captures are weighed against
        if self._warned or s.calls + s.eager < self.warn_after or s.captures * 2 <= s.calls + s.eager:
            return
        self._warned = True
        warnings.warn(
            f"shared_prefix_cuda_graphs: {s.captures} of {s.calls + s.eager} layer-stack calls captured a new graph "
            f"({self.describe()}): the batches' layouts (sequence lengths, shared prefixes) rarely fall into the "
            "buckets of the graphs held, and every capture costs a few eager steps. Keep "
            "shared_prefix_cuda_graphs_buckets on (the default), raise shared_prefix_cuda_graphs_cache so that more "
            "buckets are held (each holds one step's activations), or turn the graphs off",
            GraphsRecapturing,
            stacklevel=4,
        )
