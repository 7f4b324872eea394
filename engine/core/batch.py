"""Several conversations' target KV caches in one ``InferRequest``: one pass advances them all.

On a memory-bound CPU a pass over several rows costs little more than a pass over one (the
weights are read once), and a row may verify a draft in it: a few more tokens per row cost
little more either. Batching must not change a single logit, though, and on this CPU a row
computes bit for bit what it computes alone only while its cache entries are contiguous: masked
slots before them change nothing, a masked gap between them changes the rounding unless its
length is a multiple of 16 (docs/design.md, "Batching"). So every row keeps its entries
contiguous and ending at the last slot before each pass: rows are left-padded with masked slots;
a row fed fewer tokens than the widest is padded after them (no token of its own attends to
those), and after the pass each row is cut back to what it keeps (:meth:`Batch.keep`); a joining
row is written in by rebuilding the states (its own cache's entries, copied: O(rows x slots); its
own copy is then freed), and a leaving row is dropped by the next pass's ``beam_idx`` after its
entries are copied back to its own cache (free, unless the rows left are so much shorter that
their leading slots are cut away: :meth:`Batch._cut`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov

from engine import ggml
from engine.core.memory import trim_heap
from engine.core.runtime import Runtime, release_states, state_tensor

# Leading slots no row uses that a leave cuts away (a copy of the states): attention runs over
# every slot, masked or not.
MAX_SLACK = 256


@dataclass
class Row:
    key: Hashable  # whose row (the scheduler's request)
    home: Runtime  # the row's own cache: where its entries come from and go back to
    tokens: list[int]  # what the row's slots hold, in order
    origins: list  # what wrote the entries the row came with (Runtime.origins); the batch writes the rest


class Rows:
    """What every batch holds: the target's rows, one pass at a time, on their own request.
    ``template`` gives the compiled model (the weights stay loaded once) and the context limit."""

    def __init__(self, template: Runtime):
        self.compiled = template.compiled
        self.request = self.compiled.create_infer_request()
        self.max_context = template.max_context
        self.pass_inputs = template.pass_inputs()
        self.rows: list[Row] = []
        self.passes = 0
        self.last_seconds = 0.0

    def __contains__(self, key: Hashable) -> bool:
        return any(row.key == key for row in self.rows)

    def __len__(self) -> int:
        return len(self.rows)


class Batch(Rows):
    """The target's rows in the plugin's states, one :meth:`step` at a time."""

    def __init__(self, template: Runtime):
        super().__init__(template)
        self.empty_state = template.empty_state
        self.kv_bytes_per_token = template.kv_bytes_per_token
        self.slots = 0
        self._physical: list[int] = []  # each row's index in the states as they are now
        self._tails: list[int] = []  # each row's slots after its entries, fed padding or a rejected draft (keep)

    @property
    def kv_cache_bytes(self) -> int:
        """What the rows' entries take, each row padded to the longest."""
        return len(self.rows) * self.slots * self.kv_bytes_per_token

    def join(self, members: Sequence[tuple[Hashable, Runtime]]) -> None:
        """Add a row per ``(key, home)``, holding what ``home``'s cache holds (one rebuild for
        all of them)."""
        homes = [home for _, home in members]
        if any(self._tails):
            raise ValueError("a row joins before the last pass's slots are cut (Batch.keep)")
        for home in homes:
            if home.slots != len(home.tokens):
                raise ValueError("a batch row needs a cache without masked entries")
        width = max(len(tokens) for tokens in [*(row.tokens for row in self.rows), *(h.tokens for h in homes)])
        joining = [_states_by_name(home) for home in homes]
        for state in self.request.query_state():  # one state at a time: a copy of one layer in memory
            parts = [_fit(self._in_order(state.state.data), width)] if self.rows else []
            parts += [_fit(_entries(states, state.name, home), width) for states, home in zip(joining, homes)]
            state.state = state_tensor(np.concatenate(parts))
        self.rows += [Row(key, home, list(home.tokens), list(home.origins)) for key, home in members]
        self.slots = width
        self._physical = list(range(len(self.rows)))
        self._tails = [0] * len(self.rows)
        for home in homes:  # the batch holds the entries now: the conversation's own copy is freed
            home.release()
        trim_heap()

    def leave(self, key: Hashable, write_back: bool = True) -> None:
        """Drop ``key``'s row (at the next pass); with ``write_back`` its entries go back to its
        own cache first, so the conversation's next turn prefills only its new suffix."""
        i = next(i for i, row in enumerate(self.rows) if row.key == key)
        row = self.rows.pop(i)
        physical = self._physical.pop(i)
        if self._tails.pop(i) and write_back:
            raise ValueError("a row leaves before its last pass's slots are cut (Batch.keep)")
        if write_back:
            start = self.slots - len(row.tokens)
            home = _states_by_name(row.home)
            for state in self.request.query_state():  # one state at a time
                kept = state.state.data[physical : physical + 1, :, start:]
                home[state.name].state = state_tensor(kept)
            row.home.hold_loaded(row.tokens, row.origins)
        if not self.rows:
            self.slots = 0
            release_states(self.request, self.empty_state)
        elif self.slots - (longest := max(len(r.tokens) for r in self.rows)) > MAX_SLACK:  # the longest row left
            self._cut(longest)
        trim_heap()

    def _cut(self, width: int) -> None:
        """Drop the leading slots no row uses any more (and the rows that left)."""
        for state in self.request.query_state():
            state.state = state_tensor(_fit(self._in_order(state.state.data), width))
        self.slots = width
        self._physical = list(range(len(self.rows)))

    def _in_order(self, states: np.ndarray) -> np.ndarray:
        """The rows' entries in ``states`` (a state as read), in row order: as read where no row
        has left since the last pass, a copy otherwise (a share of a rebuild: docs/design.md, "Batching")."""
        return states if self._physical == list(range(len(states))) else states[self._physical]

    def step(self, feeds: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Append ``feeds[i]`` to row i (a plain step's one token, or a speculative round's last
        token and draft); return each row's logits for the positions after each token fed. Rows
        fed fewer tokens than the widest are padded after theirs (masked slots no token of theirs
        attends to); where any row was, or a row's draft is rejected, :meth:`keep` cuts the rows
        back before the next pass."""
        if len(feeds) != len(self.rows):
            raise ValueError(f"{len(feeds)} feeds for {len(self.rows)} rows")
        if any(self._tails) or not all(feeds):
            raise ValueError("a row is fed nothing, or holds slots to cut (Batch.keep) from the last pass")
        lengths = np.array([len(row.tokens) for row in self.rows])
        widths = np.array([len(feed) for feed in feeds])
        fed = int(widths.max())
        if (lengths + widths).max() > self.max_context:
            raise ValueError("a row would exceed the model's context")  # the decoder stops before this
        slots = self.slots + fed
        new = np.arange(fed)[None]
        old = np.arange(self.slots)[None] >= (self.slots - lengths)[:, None]
        mask = np.concatenate([old, new < widths[:, None]], axis=1).astype(np.int64)
        ids = np.zeros((len(feeds), fed), dtype=np.int64)
        for i, feed in enumerate(feeds):
            ids[i, : len(feed)] = feed
        start = time.perf_counter()
        self.request.infer(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "position_ids": (lengths[:, None] + new).astype(np.int64),
                "beam_idx": np.asarray(self._physical, dtype=np.int32),
                "logits_to_keep": np.array([fed], dtype=np.int64),
                **self.pass_inputs,
            }
        )
        self.last_seconds = time.perf_counter() - start
        for row, feed in zip(self.rows, feeds):
            row.tokens += feed
            row.origins += [None] * len(feed)
        self.slots = slots
        self._tails = [fed - len(feed) for feed in feeds]
        self._physical = list(range(len(self.rows)))
        self.passes += 1
        logits = self.request.get_tensor("logits").data
        return [logits[i, : len(feed)].astype(np.float32, copy=True) for i, feed in enumerate(feeds)]

    def keep(self, lengths: Sequence[int]) -> None:
        """Cut row i back to its first ``lengths[i]`` tokens (a speculative round's rejected draft
        and the last pass's padding): each row's entries end at the last slot again, contiguous.
        Free where nothing is cut; a cut of the same slots from every row keeps a prefix of each
        state; otherwise the rows are laid out again (one copy of the states, as a join's)."""
        ends = [self.slots - tail - (len(row.tokens) - n) for row, tail, n in zip(self.rows, self._tails, lengths)]
        for row, n in zip(self.rows, lengths):
            del row.tokens[n:], row.origins[n:]
        self._tails = [0] * len(self.rows)
        if all(end == self.slots for end in ends):
            return
        width = max(lengths)
        for state in self.request.query_state():  # one state at a time
            data = self._in_order(state.state.data)
            if len(set(ends)) == 1:  # (every row cut alike: the states' first slots)
                state.state = state_tensor(data[:, :, : ends[0]][:, :, -width:])
                continue
            rows = [_fit(data[i : i + 1, :, :end], width) for i, end in enumerate(ends)]
            state.state = state_tensor(np.concatenate(rows))
        self.slots = width
        self._physical = list(range(len(self.rows)))

    def reset(self) -> None:
        """Drop every row without writing anything back (after a failed pass): a new request, so
        the old one's states, whatever a failure left them as, are freed with it."""
        self.request = self.compiled.create_infer_request()
        self.rows, self._physical, self._tails, self.slots = [], [], [], 0


class OwnBatch(Rows):
    """:class:`Batch`'s rows where the op keeps each conversation's cache (engine.core.kv_cache):
    a pass names each row's own cache and the entries it keeps, so nothing is copied in or out,
    rows of any lengths share a pass, and each row computes what it computes alone, bit for bit
    (the op's attention reads a row's entries only). A row fed fewer tokens than the widest is
    padded after them; the padding's entries lie past what the row keeps, written over by its next
    pass."""

    def __init__(self, template: Runtime):
        super().__init__(template)
        self.fixed = template.fixed
        self._requests: dict[tuple[int, int], ov.InferRequest] = {}  # (on self.fixed's copies, by shape)

    @property
    def kv_cache_bytes(self) -> int:
        """Nothing beyond the rows' own caches, which their conversations count."""
        return 0

    def join(self, members: Sequence[tuple[Hashable, Runtime]]) -> None:
        """Add a row per ``(key, home)``, reading and writing ``home``'s cache."""
        if any(home.own is None for _, home in members):
            raise ValueError("a row of these batches needs a cache the op keeps")
        self.rows += [Row(key, home, list(home.tokens), list(home.origins)) for key, home in members]

    def leave(self, key: Hashable, write_back: bool = True) -> None:
        """Drop ``key``'s row; its cache holds what the row holds (without ``write_back``, after a
        failed pass, it is emptied)."""
        row = self.rows.pop(next(i for i, row in enumerate(self.rows) if row.key == key))
        if write_back:
            row.home.hold_loaded(row.tokens, row.origins)
        else:
            row.home.release()

    def step(self, feeds: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """:meth:`Batch.step`: append ``feeds[i]`` to row i; each row's logits for the positions
        after each token fed."""
        if len(feeds) != len(self.rows) or not all(feeds):
            raise ValueError(f"{len(feeds)} feeds for {len(self.rows)} rows, each fed a token or more")
        lengths = np.array([len(row.tokens) for row in self.rows])
        fed = max(len(feed) for feed in feeds)
        if (lengths + np.array([len(feed) for feed in feeds])).max() > self.max_context:
            raise ValueError("a row would exceed the model's context")  # the decoder stops before this
        ids = np.zeros((len(feeds), fed), dtype=np.int64)
        for i, feed in enumerate(feeds):
            ids[i, : len(feed)] = feed
        start = time.perf_counter()
        request = self._request(len(feeds), fed)
        request.infer(
            {
                "input_ids": ids,
                "attention_mask": np.ones((len(feeds), fed), dtype=np.int64),
                "position_ids": (lengths[:, None] + np.arange(fed)[None]).astype(np.int64),
                "beam_idx": np.arange(len(feeds), dtype=np.int32),
                "logits_to_keep": np.array([fed], dtype=np.int64),
                ggml.KV_CACHES: np.array([row.home.own.id for row in self.rows], dtype=np.int64),  # type: ignore[union-attr]
                ggml.KV_PASTS: lengths.astype(np.int64),
                **self.pass_inputs,
            }
        )
        self.last_seconds = time.perf_counter() - start
        for row, feed in zip(self.rows, feeds):
            row.tokens += feed
            row.origins += [None] * len(feed)
        self.passes += 1
        logits = request.get_tensor("logits").data
        return [logits[i, : len(feed)].astype(np.float32, copy=True) for i, feed in enumerate(feeds)]

    def _request(self, rows: int, width: int) -> ov.InferRequest:
        """The request a pass of ``rows`` rows ``width`` tokens wide runs on (FixedShapes.request)."""
        return self.request if self.fixed is None else self.fixed.request(self._requests, self.request, width, rows)

    def keep(self, lengths: Sequence[int]) -> None:
        """Cut row i back to its first ``lengths[i]`` tokens: free (its next pass writes after them)."""
        for row, n in zip(self.rows, lengths):
            del row.tokens[n:], row.origins[n:]

    def reset(self) -> None:
        """Drop every row without writing anything back (after a failed pass)."""
        for row in self.rows:
            row.home.release()
        self.request = self.compiled.create_infer_request()
        self._requests = {}
        self.rows = []


def batch_for(template: Runtime) -> Batch | OwnBatch:
    """The batch that fits ``template``'s graph: over the op's own caches, else over the plugin's states."""
    return OwnBatch(template) if template.own is not None else Batch(template)


def _entries(states: dict[str, ov.VariableState], name: str, home: Runtime) -> np.ndarray:
    """A home cache's state ``name``; an empty cache's without reading it (a request reset or
    never run has no states to read)."""
    return states[name].state.data if home.tokens else home.empty_state


def _states_by_name(runtime: Runtime) -> dict[str, ov.VariableState]:
    return {state.name: state for state in runtime.request.query_state()}


def _fit(states: np.ndarray, width: int) -> np.ndarray:
    """``states`` (rows, heads, slots, head size) cut or left-padded with zeros to ``width`` slots."""
    slots = states.shape[2]
    if slots >= width:
        return states[:, :, slots - width :]
    pad = np.zeros((*states.shape[:2], width - slots, *states.shape[3:]), dtype=states.dtype)
    return np.concatenate([pad, states], axis=2)


def padded_row_error(template: Runtime, pads: Sequence[int] = (1, 2, 3), prompt: int = 17) -> float:
    """The largest change in a row's logits when a batched pass left-pads it by each of ``pads``
    slots beside a longer row, against the same pass alone (0.0: bit for bit). The plugin's
    one-token attention sums a row's positions in groups counted from the cache's first slot, so
    on some CPUs and kernels a padded row rounds differently (docs/design.md, "Batching")."""
    tokens = list(range(1, prompt + 1))
    alone = template.fork()
    alone.forward(tokens)
    expected = alone.forward([1])
    alone.release()
    moved = 0.0
    for pad in pads:
        short, long = template.fork(), template.fork()
        short.forward(tokens)
        long.forward(list(range(2, prompt + pad + 2)))
        batch = batch_for(template)
        batch.join([(0, short), (1, long)])
        moved = max(moved, float(np.abs(batch.step([[1], [1]])[0] - expected).max()))
        batch.reset()
        for runtime in (short, long):
            runtime.release()
    return moved
