"""The slot cache of the hf step driver (engine.generation.hf.stepper): a transformers
StaticCache of [slots, length] whose rows are requests that joined at different times.

Layout. transformers' StaticLayer writes one cache column per forward for the whole batch (its
`cumulative_length`), so every running row writes the same column `col` at a decode step; each
row has its own attention-mask row (ones on its own columns only) and its own position ids
(its real tokens counted, as the eager loop's), so where a row's keys sit in the cache changes
no value: masked columns enter the attention as exact zeros (only the summation order, i.e.
rounding, can differ; the static path's tolerance, engine.generation.hf.static_decode). A
request that joins is prefilled (engine.generation.hf.prefill: one forward per distinct
prompt, prompts of one length batched without padding) and its keys/values copied into a free
slot so that its prompt ends just left of `col` (columns [col - n, col)). A slot whose row
finished or was aborted is free at once (its mask row zeroed; it is fed the pad id at position 0
and attends to its own current column, so no row of the batch is ever fully masked).

Positions. Only running rows' positions move; a free slot's stays 0 (reset by `release`, not
moved by `decode`, carried as 0 by `_repack`), so the batch's highest position is a running
row's own: a model with learned positions (gpt2's n_positions) never indexes past its table
however long the driver stays busy, and rope scalings that pick their frequencies from the
batch's highest position (longrope's short/long factors, dynamic NTK) pick what the running
rows' own positions ask for (tests/test_slot_cache.py).

Storage. The cache's key/value tensors are allocated once per shape (StaticLayer's
`lazy_initialization`, which marks them static for torch.compile: `mark_static_address`) and
never replaced: a decode over the whole cache (a compiled decoder) hands the step the layer's own
tensors; a narrower window (eager) hands it views for the step and puts the layer's own tensors
back after it. The StaticLayer fields this relies on are probed (`static_layer_problem`).

A lone row (one slot, an eager decoder): its step attends to exactly its own columns, all of
them, and its cache's layers are marked not compileable for that step (StaticLayer's
`is_compileable`, put back after it), so transformers drops the all-ones mask as it does on
the eager loop's growing cache (its mask creation keeps the mask of a compileable cache when
decoding): SDPA then runs unmasked with grouped KV heads in the kernel, no key/value repeat,
the eager loop's work (docs/benchmarks.md, "serve on hf": a lone request cost about 1.3x
the eager loop with the bucketed, masked window).

Room. Each running row knows how many more columns it will write (`left`: its tokens still to
feed), and every row ends at `col`, so once `col + max(left) <= length` holds it holds to the
end. `arrange` (before joiners are placed) keeps the layout when the joiners fit (enough free
slots, col >= their prompt lengths, their columns within the length); otherwise it repacks:
every row's columns shifted by one common offset so that the longest span starts at column 0
or the longest joining prompt fits left of `col`, into a cache of batch_bucket slots and
cache_bucket length (engine.generation.hf.length_buckets: few shapes, as the compiled step
needs), growing, never shrinking while rows run. `clear` (the driver idle) forgets the layout.

Caches come from a StaticDecoder's `cache(batch, length)` (the engine's own, whose compiled
step runs the decode here too, or an eager one the driver makes), so a shape's cache tensors
are the same every step.
"""
from __future__ import annotations

import torch

from engine.generation.hf.cache_probe import static_layer_problem
from engine.generation.hf.length_buckets import batch_bucket, cache_bucket

MIN_SLOTS = 1   # measured: at hidden 1024 on 2 CPU cores a 4-row step cost 2-5x a 1-row one


class SlotCache:
    """The module's layout over `decoder` (a StaticDecoder of the engine's model).

    Attributes:
        slots, length: the cache's shape (0, 0 before the first row).
        col: the column the next decode step writes (every running row's).
        left: slot -> columns the running row in it will still write.
    """

    def __init__(self, decoder, pad_id: int, device: torch.device) -> None:
        problem = static_layer_problem()
        if problem:
            raise RuntimeError(f"the hf slot cache does not run on this transformers: {problem}")
        self.decoder, self.pad_id, self.device = decoder, pad_id, device
        self.clear()

    def clear(self) -> None:
        """Forget the layout (no row running)."""
        self.cache, self.slots, self.length, self.col = None, 0, 0, 0
        self.left: dict[int, int] = {}
        self.start: dict[int, int] = {}    # slot -> its first (prompt) column
        self.mask = self.feed = self.pos = self.live = None   # live: 1 on running slots

    def free_slots(self) -> list[int]:
        return [s for s in range(self.slots) if s not in self.left]

    def arrange(self, joiners: list[tuple[int, int]]) -> None:
        """Make room for `joiners` ((prompt length, columns it will write) each): keep the
        layout if they fit, else repack (module docstring)."""
        need_col = max(n for n, _ in joiners)
        reach = max([w for _, w in joiners] + list(self.left.values()))
        rows = len(self.left) + len(joiners)
        if (self.cache is not None and rows <= self.slots and self.col >= need_col
                and self.col + reach <= self.length):
            return
        span = max([self.col - s for s in self.start.values()], default=0)
        new_col = max(span, need_col)
        slots = max(self.slots, batch_bucket(max(rows, MIN_SLOTS)))
        length = max(self.length, cache_bucket(new_col + reach))
        self._repack(slots, length, new_col, span)

    def _repack(self, slots: int, length: int, new_col: int, span: int) -> None:
        """Move every row's columns [col - span, col) to [new_col - span, new_col) of a cache
        of (slots, length) (the same cache when the shape is the same)."""
        a, b, shift = self.col - span, self.col, new_col - self.col
        old = []
        if self.cache is not None and span > 0:
            old = [(layer.keys[:, :, a:b].clone(), layer.values[:, :, a:b].clone())
                   for layer in self.cache.layers if layer.is_initialized]
        old_slots = self.slots
        mask = torch.zeros((slots, length), dtype=torch.long, device=self.device)
        feed = torch.full((slots,), self.pad_id, dtype=torch.long, device=self.device)
        pos = torch.zeros((slots,), dtype=torch.long, device=self.device)
        live = torch.zeros((slots,), dtype=torch.long, device=self.device)
        if self.mask is not None:   # a free slot's position is 0 (module docstring)
            mask[:old_slots, a + shift:b + shift] = self.mask[:, a:b]
            feed[:old_slots], live[:old_slots] = self.feed, self.live
            pos[:old_slots] = self.pos * self.live
        self.cache = self.decoder.cache(slots, length)   # reset
        for layer, (keys, values) in zip(self.cache.layers, old):
            self._initialize(layer, keys, values, slots)
            layer.keys[:old_slots, :, a + shift:b + shift] = keys
            layer.values[:old_slots, :, a + shift:b + shift] = values
        self.slots, self.length, self.col = slots, length, new_col
        self.mask, self.feed, self.pos, self.live = mask, feed, pos, live
        self.start = {s: c + shift for s, c in self.start.items()}

    @staticmethod
    def _initialize(layer, keys: torch.Tensor, values: torch.Tensor, slots: int) -> None:
        """Allocate a fresh StaticLayer's tensors for `slots` rows, shaped like `keys` /
        `values` ([rows, heads, columns, head_dim])."""
        if not layer.is_initialized:
            layer.lazy_initialization(keys[:1, :, :0].expand(slots, -1, -1, -1),
                                      values[:1, :, :0].expand(slots, -1, -1, -1))

    def place(self, slot: int, prefill, n: int, token: int, left: int, row: int = 0) -> None:
        """Row in `slot`: the keys/values of its n-token prompt (row `row` of a prefill's
        transformers cache, `prefill.layers[i].keys` [rows, heads, n, head_dim]) at columns
        [col - n, col); it feeds `token` next at position n and will write `left` columns.
        `prefill` is only read (copied from): one cache may be placed in several slots."""
        lo = self.col - n
        for layer, source in zip(self.cache.layers, prefill.layers):
            self._initialize(layer, source.keys, source.values, self.slots)
            layer.keys[slot, :, lo:self.col] = source.keys[row]
            layer.values[slot, :, lo:self.col] = source.values[row]
        self.mask[slot] = 0
        self.mask[slot, lo:self.col] = 1
        self.feed[slot], self.pos[slot], self.live[slot] = token, n, 1
        self.left[slot], self.start[slot] = left, lo

    def release(self, slot: int) -> None:
        """Free `slot` (its row finished or was aborted): pad fed at position 0."""
        self.left.pop(slot, None)
        self.start.pop(slot, None)
        self.mask[slot] = 0
        self.feed[slot], self.pos[slot], self.live[slot] = self.pad_id, 0, 0

    def window(self) -> tuple[int, int]:
        """The columns [lo, hi) a decode step attends to: the whole cache for a compiled
        decoder (one shape per cache); else a cache_bucket(span) wide window ending just right
        of `col` (span: from the first running row's first column to `col` included), so the
        step's attention and GQA key/value repeat cover the columns in use, not the cache's
        length. Columns outside hold no running row's keys (masked: exact zeros). A lone row
        (one slot): exactly its columns [start, col] (module docstring)."""
        if self.decoder.compile:
            return 0, self.length
        lo = min(self.start.values(), default=self.col)
        if self.slots == 1 and self.left:   # a lone row: exactly its columns (module docstring)
            return lo, self.col + 1
        width = min(self.length, cache_bucket(self.col + 1 - lo))
        hi = max(self.col + 1, width)
        return hi - width, hi

    def decode(self) -> torch.Tensor:
        """One decode step of every slot at column `col` (attending to `window()`'s columns):
        fp32 logits [slots, V] (rows of free slots are not meaningful); then col and the
        running rows' positions move on (a free slot's stays 0: module docstring). The layers
        keep their own key/value tensors (module docstring: Storage)."""
        lo, hi = self.window()
        self.mask[:, self.col] = 1
        lone = self.slots == 1 and bool(self.left) and not self.decoder.compile
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self.col - lo)   # StaticLayer writes here
            if lone:   # transformers may then drop the all-ones mask (module docstring)
                layer.is_compileable = False
        try:
            if (lo, hi) == (0, self.length):
                logits = self.decoder.step(self.feed[:, None], self.mask, self.pos[:, None],
                                           self.cache)
            else:
                logits = self._windowed(lo, hi)
        finally:
            if lone:
                for layer in self.cache.layers:
                    del layer.is_compileable   # StaticLayer's own (True) again
        self.col += 1
        self.pos += self.live
        for slot in self.left:
            self.left[slot] -= 1
        return logits

    def _windowed(self, lo: int, hi: int) -> torch.Tensor:
        """The decode step over views of columns [lo, hi) (it writes through them); the
        layers' own tensors put back after it, whatever it raised."""
        saved = [(layer.keys, layer.values, layer.max_cache_len) for layer in self.cache.layers]
        try:
            for layer, (keys, values, _) in zip(self.cache.layers, saved):
                layer.keys, layer.values = keys[:, :, lo:hi], values[:, :, lo:hi]
                layer.max_cache_len = hi - lo
            return self.decoder.step(self.feed[:, None], self.mask[:, lo:hi],
                                     self.pos[:, None], self.cache)
        finally:
            for layer, (keys, values, length) in zip(self.cache.layers, saved):
                layer.keys, layer.values, layer.max_cache_len = keys, values, length

    def set_token(self, slot: int, token: int) -> None:
        """The token `slot` feeds at the next decode step."""
        self.feed[slot] = token
