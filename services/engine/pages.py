"""``PagedLatentCache``: the MLA latent cache as a pool of fixed-size pages plus a page table per sequence.

An MLA layer's cache grows by one row of ``kv_lora_rank + qk_extra_dim`` values per token. Instead of one
growing tensor per sequence (which fragments memory and must be reallocated as it grows), rows live in pages of
``page_size`` tokens taken from one preallocated pool; a sequence's *page table* lists its pages in order, so
token ``t`` lives in page ``table[t // page_size]`` at row ``t % page_size``.

Design decisions:

- One page id addresses the same rows in every MLA layer (the pool is ``[num_pages, page_size, width]`` per
  layer), so a sequence has a single page table however many MLA layers the model has.
- Pages are taken when a request is admitted, for its whole budget (prompt + max tokens): a running sequence
  can never run out of pages mid-generation, so nothing ever has to be preempted or swapped. The price is
  memory reserved for tokens that may never be generated.
- A layer's pool is one ``[num_pages, page_size, R + e]`` tensor (``kv``), the latent and the extra key of a
  token side by side: the layout the paged MLA decode kernel and its reference read in place
  (``K3Model.decode_paged``), following the page table. ``c_kv`` and ``k_extra`` are views of its two parts.
- Decode never gathers: ``decode_paged`` writes each new row into its page and reads history where it lies.
  ``gather`` (contiguous ``[L, R]`` / ``[L, e]`` copies) serves the paths that take a ``SequenceState``:
  chunked prefill, pausing, and handing a finished sequence's state over.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.model.config import K3Config
from k3.model.mla import MLACache


class PagedLatentCache:
    """Page pool of every MLA layer of ``cfg`` and the free list."""

    def __init__(self, cfg: K3Config, num_pages: int, page_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.num_pages, self.page_size = num_pages, page_size
        self.layers = [i for i in range(cfg.num_layers) if cfg.layer_kind(i) == "mla"]
        width = cfg.kv_lora_rank + cfg.qk_extra_dim
        # layer -> page pool [num_pages, page_size, R + e], what K3Model.decode_paged reads and grows
        self.kv = {i: torch.zeros(num_pages, page_size, width, device=device, dtype=dtype) for i in self.layers}
        self.c_kv = {i: kv[..., :cfg.kv_lora_rank] for i, kv in self.kv.items()}
        self.k_extra = {i: kv[..., cfg.kv_lora_rank:] for i, kv in self.kv.items()}
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every MLA layer (latent and extra key rows)."""
        return sum(kv[0].numel() * kv.element_size() for kv in self.kv.values())

    def block_table(self, tables: list[list[int]], num_tokens: int) -> Tensor:
        """int32 ``[B, pages_for(num_tokens)]``: the first pages of each sequence's table (page 0 where a table is
        shorter; such entries lie past the sequence's length and are never read)."""
        width = self.pages_for(num_tokens)
        out = torch.zeros(len(tables), width, dtype=torch.int32)
        for b, table in enumerate(tables):
            used = table[:width]
            out[b, :len(used)] = torch.as_tensor(used, dtype=torch.int32)
        return out

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` pages, or None (and nothing taken) if fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def _rows(self, table: list[int], start: int, count: int) -> tuple[Tensor, Tensor]:
        """Page index and row index of tokens [start, start + count)."""
        if start + count > len(table) * self.page_size:
            raise ValueError(f"tokens up to {start + count} do not fit {len(table)} pages of {self.page_size}")
        positions = torch.arange(start, start + count)
        pages = torch.as_tensor(table, dtype=torch.long)[positions // self.page_size]
        return pages, positions % self.page_size

    def write(self, table: list[int], start: int, caches: dict[int, MLACache], rows_from: int = 0) -> None:
        """Store rows ``rows_from:`` of each layer's cache as tokens ``start, start + 1, ...``."""
        for i in self.layers:
            c, e = caches[i].c_kv[rows_from:], caches[i].k_extra[rows_from:]
            if c.shape[0] == 0:
                continue
            pages, rows = self._rows(table, start, c.shape[0])
            device = self.c_kv[i].device
            self.c_kv[i][pages.to(device), rows.to(device)] = c.to(self.c_kv[i].dtype)
            self.k_extra[i][pages.to(device), rows.to(device)] = e.to(self.k_extra[i].dtype)

    def gather(self, table: list[int], num_tokens: int) -> dict[int, MLACache]:
        """Contiguous copies of the first ``num_tokens`` rows of every layer (the reference decode's input)."""
        used = self.pages_for(num_tokens)
        index = torch.as_tensor(table[:used], dtype=torch.long)
        out = {}
        for i in self.layers:
            c = self.c_kv[i][index.to(self.c_kv[i].device)].flatten(0, 1)[:num_tokens]
            e = self.k_extra[i][index.to(self.k_extra[i].device)].flatten(0, 1)[:num_tokens]
            out[i] = MLACache(c, e)
        return out
