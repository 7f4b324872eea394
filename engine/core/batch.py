"""Several conversations' target KV caches in one ``InferRequest``: one pass advances them all.

On a memory-bound CPU a pass over several rows costs little more than a pass over one (the
weights are read once): on this machine a one-token step of the default target takes 53 ms for
one row and 76 ms for eight. Batching must not change a single logit, though, and on this CPU a
row computes bit for bit what it computes alone only while its cache entries are contiguous:
masked slots before them change nothing, a masked gap between them changes the rounding unless
its length is a multiple of 16 (docs/design.md, "Batching"). So every row keeps its entries
contiguous and ending at the last slot (each pass appends one real token to every row), rows are
left-padded with masked slots, a joining row is written in by rebuilding the states (its own
cache's entries, copied: O(rows x slots); its own copy is then freed), and a leaving row is
dropped by the next pass's ``beam_idx`` (free) after its entries are copied back to its own
cache.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov

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


class Batch:
    """The target's rows, one :meth:`step` at a time. ``template`` gives the compiled model (the
    weights stay loaded once) and the context limit."""

    def __init__(self, template: Runtime):
        self.compiled = template.compiled
        self.empty_state = template.empty_state
        self.request = self.compiled.create_infer_request()
        self.max_context = template.max_context
        self.kv_bytes_per_token = template.kv_bytes_per_token
        self.rows: list[Row] = []
        self.slots = 0
        self._physical: list[int] = []  # each row's index in the states as they are now
        self.passes = 0
        self.last_seconds = 0.0

    def __contains__(self, key: Hashable) -> bool:
        return any(row.key == key for row in self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def kv_cache_bytes(self) -> int:
        """What the rows' entries take, each row padded to the longest."""
        return len(self.rows) * self.slots * self.kv_bytes_per_token

    def join(self, members: Sequence[tuple[Hashable, Runtime]]) -> None:
        """Add a row per ``(key, home)``, holding what ``home``'s cache holds (one rebuild for
        all of them)."""
        homes = [home for _, home in members]
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
        for home in homes:  # the batch holds the entries now: the conversation's own copy is freed
            home.release()
        trim_heap()

    def leave(self, key: Hashable, write_back: bool = True) -> None:
        """Drop ``key``'s row (at the next pass); with ``write_back`` its entries go back to its
        own cache first, so the conversation's next turn prefills only its new suffix."""
        i = next(i for i, row in enumerate(self.rows) if row.key == key)
        row = self.rows.pop(i)
        physical = self._physical.pop(i)
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
        has left since the last pass, a copy otherwise (75 ms of a 7-row batch's rebuild)."""
        return states if self._physical == list(range(len(states))) else states[self._physical]

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens[i]`` to row i; return each row's logits for the next token."""
        if len(tokens) != len(self.rows):
            raise ValueError(f"{len(tokens)} tokens for {len(self.rows)} rows")
        lengths = np.array([len(row.tokens) for row in self.rows])
        if lengths.max() + 1 > self.max_context:
            raise ValueError("a row would exceed the model's context")  # the decoder stops before this
        width = self.slots + 1
        mask = (np.arange(width)[None] >= (width - 1 - lengths)[:, None]).astype(np.int64)
        start = time.perf_counter()
        self.request.infer(
            {
                "input_ids": np.asarray(tokens, dtype=np.int64)[:, None],
                "attention_mask": mask,
                "position_ids": lengths[:, None].astype(np.int64),
                "beam_idx": np.asarray(self._physical, dtype=np.int32),
                "logits_to_keep": np.array([1], dtype=np.int64),
            }
        )
        self.last_seconds = time.perf_counter() - start
        for row, token in zip(self.rows, tokens):
            row.tokens.append(token)
        self.slots = width
        self._physical = list(range(len(self.rows)))
        self.passes += 1
        return self.request.get_tensor("logits").data[:, -1].astype(np.float32, copy=True)

    def reset(self) -> None:
        """Drop every row without writing anything back (after a failed pass): a new request, so
        the old one's states, whatever a failure left them as, are freed with it."""
        self.request = self.compiled.create_infer_request()
        self.rows, self._physical, self.slots = [], [], 0


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
