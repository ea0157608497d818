"""Fresh random green lists for the key-randomisation null of the KGW reading test.

The calibrated statistic compares the green mass a change moved under the owner's key with the
same quantity under ``n`` keys that never watermarked anything. Materialising ``n`` KGW keys'
green-list indices costs ``n * contexts * gamma * vocab`` integers (40-60 GB for 200 keys over
2,000-3,000 probe contexts on SmolLM2's 49,152-token vocabulary), so the null keys here are
drawn directly as green masks: every (key, context, token) is green independently with
probability ``gamma``.

Under the null (a change independent of the key) that statistic ``<D, G - gamma>`` has mean 0
and variance ``gamma (1 - gamma) sum D^2``; an owner's fixed-size KGW list gives variance
``m (V - m) / (V (V - 1)) sum D^2`` for rows of ``D`` that sum to zero: the same up to a factor
``V / (V - 1)`` (1.0005 at V = 2,048), far below the resolution of any p-value reported.

The masks come from a seeded generator on the change's device, one generator per chunk of
keys, so the same ``(n, seed)`` gives the same keys whenever they are drawn, whether or not they
are cached. CPU and CUDA generators draw different streams: the keys depend on the device (and
on a CUDA device, on the GPU and the draw's shape).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

_CHUNK = 16  # keys per generator and per matrix product
_CACHE_BYTES = 512 << 20  # keep the masks when they fit, else redraw each round
_DRAW_BYTES = 1 << 30  # transient memory of one redrawn block (uniforms, bools, floats)


class RandomGreenLists:
    """``n`` random keys' green masks over ``rows x vocab`` (context, token) cells.

    :meth:`sums` evaluates ``<change, mask_k>`` for a batch of flat changes and every key ``k``
    in one pass over the masks. The masks are kept between rounds when they fit
    ``cache_bytes``: as the float32 the matrix product reads when ``4 n rows vocab`` bytes fit
    (a round is then only the product), else as bools (converted each round), else redrawn
    every round, as many keys at a time as keep the draw within ``draw_bytes``.
    """

    def __init__(
        self,
        n: int,
        seed: int,
        cells: int,
        gamma: float,
        device: torch.device | str = "cpu",
        cache_bytes: int = _CACHE_BYTES,
        draw_bytes: int = _DRAW_BYTES,
    ) -> None:
        if n < 1:
            raise ValueError(f"attribution.calibrated.null_keys: must be >= 1, got {n}")
        self.n = n
        self.seed = seed
        self.cells = cells
        self.gamma = gamma
        self.device = torch.device(device)
        self.cache_bytes = cache_bytes
        # Redrawn keys: on the CPU several chunks at once (one serial generator each), and
        # per chunk as many keys together as keep every draw in flight within draw_bytes
        # (9 bytes a cell: a large vocabulary's 1,300 contexts x 49,152 tokens are 9 GB per 16
        # keys). Rows come from the chunk's generator in order, so on the CPU the keys are
        # those of a one-piece draw.
        self._parallel = torch.get_num_threads() if self.device.type == "cpu" else 1
        self._rows = max(1, min(_CHUNK, draw_bytes // self._parallel // max(1, 9 * cells)))
        self._dtype = torch.float32 if 4 * n * cells <= cache_bytes else torch.bool
        self._cached = n * cells * self._dtype.itemsize <= cache_bytes
        self._masks: list[torch.Tensor] = []

    def _chunk(self, index: int) -> torch.Tensor:
        """Masks ``[keys, cells]`` of chunk ``index`` (keys ``index*16 ...``), kept or drawn."""
        if self._cached and index < len(self._masks):
            return self._masks[index]
        mask = self._draw(index)
        if self._cached:
            self._masks.append(mask)
        return mask

    def _draw(self, index: int) -> torch.Tensor:
        """Chunk ``index``'s masks from its own generator (as cached when cached)."""
        mask = torch.cat(list(self._blocks(index)))
        return mask.to(self._dtype) if self._cached else mask

    def _blocks(self, index: int) -> Iterator[torch.Tensor]:
        """Chunk ``index``'s masks as bool blocks of at most ``self._rows`` keys, in order."""
        keys = min(_CHUNK, self.n - index * _CHUNK)
        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.seed * 1_000_003 + index) % (1 << 63))
        for start in range(0, keys, self._rows):
            rows = min(self._rows, keys - start)
            block = torch.rand((rows, self.cells), generator=gen, device=self.device) < self.gamma
            yield block

    def sums(self, changes: torch.Tensor) -> torch.Tensor:
        """``[batch, n]`` float64: each flat change (``[batch, cells]``) summed over every
        key's green cells."""
        if changes.dim() != 2 or changes.shape[1] != self.cells:
            raise ValueError(f"changes: expected [batch, {self.cells}], got {tuple(changes.shape)}")
        values = changes.to(self.device, torch.float32).contiguous()
        chunks = (self.n + _CHUNK - 1) // _CHUNK
        if self._cached and not self._masks and self.device.type == "cpu" and chunks > 1:
            # The first round draws every key (one CPU generator each, serial inside torch):
            # several chunks at once, in order, so the keys are those of a serial draw; as
            # many at once as keep their transient uniforms, bools and floats (9 bytes per
            # cell) within the cache's size.
            fit = self.cache_bytes // (9 * _CHUNK * self.cells)
            at_once = max(1, min(torch.get_num_threads(), fit))
            with ThreadPoolExecutor(at_once) as pool:
                self._masks = list(pool.map(self._draw, range(chunks)))
        # changes @ masks^T, both row-major along the cells: the long inner dimension is
        # contiguous in both operands (1.8x faster on a CPU than masks @ changes^T).
        if self._cached:
            out = [values @ self._chunk(index).to(torch.float32).T for index in range(chunks)]
        else:  # redrawn a block at a time: never more than draw_bytes in flight

            def chunk_sums(index: int) -> torch.Tensor:
                return torch.cat([values @ b.to(torch.float32).T for b in self._blocks(index)], 1)

            with ThreadPoolExecutor(max(1, min(self._parallel, chunks))) as pool:
                out = list(pool.map(chunk_sums, range(chunks)))
        return torch.cat(out, dim=1).double()


class RandomSubsetKeys:
    """``n`` random keys of exactly the owners' law: every row (context) an independent
    uniform ``m``-subset of its ``cols`` columns (tokens), as a KGW key's green lists are under
    a random secret. Read against an owner's key they are exchangeable with it under the null,
    so the rank of the owner's value among theirs is an exact p-value at any ``n`` (the
    Bernoulli masks of :class:`RandomGreenLists` match the law only to a factor
    ``V / (V - 1)`` in variance).

    Each chunk of 16 keys comes from its own seeded generator (the same keys whenever they are
    drawn, by any party); nothing is kept between calls. A change over fewer rows is read by
    the keys' first rows (still independent uniform subsets, row by row), so changes over
    several owners' documents are read in one draw (:meth:`values_many`)."""

    def __init__(self, n: int, seed: int, rows: int, cols: int, m: int) -> None:
        if n < 1:
            raise ValueError(f"random keys: n must be >= 1, got {n}")
        if not 1 <= m < cols:
            raise ValueError(f"random keys: need 1 <= m < cols, got m={m}, cols={cols}")
        self.n, self.seed, self.rows, self.cols, self.m = n, seed, rows, cols, m

    def _chunk(self, index: int) -> torch.Tensor:
        """Chunk ``index``'s masks, ``[keys, rows, cols]`` float64."""
        keys = min(_CHUNK, self.n - index * _CHUNK)
        gen = torch.Generator().manual_seed((self.seed * 1_000_033 + index) % (1 << 63))
        u = torch.rand((keys, self.rows, self.cols), generator=gen)
        picks = u.topk(self.m, dim=-1, sorted=False).indices
        mask = torch.zeros((keys, self.rows, self.cols), dtype=torch.float64)
        return mask.scatter_(-1, picks, 1.0)

    def values_many(self, changes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """For each ``[batch, rows_j * cols]`` block of flat changes (``rows_j <= rows``):
        ``[batch, n]`` float64, ``<change, key_k>`` read by the keys' first ``rows_j`` rows;
        every key drawn once for all blocks."""
        blocks = []
        for c in changes:
            rows, rest = divmod(c.shape[1], self.cols) if c.dim() == 2 else (0, 1)
            if rest or not 0 < rows <= self.rows:
                raise ValueError(
                    f"changes: expected [batch, rows * {self.cols}] with rows <= {self.rows}, "
                    f"got {tuple(c.shape)}"
                )
            blocks.append((c.double().cpu(), rows))
        out: list[list[torch.Tensor]] = [[] for _ in blocks]
        for index in range((self.n + _CHUNK - 1) // _CHUNK):
            mask = self._chunk(index)
            for j, (values, rows) in enumerate(blocks):
                out[j].append(values @ mask[:, :rows].reshape(len(mask), -1).T)
        return [torch.cat(o, dim=1) for o in out]

    def values(self, changes: torch.Tensor) -> torch.Tensor:
        """``[batch, n]`` float64: ``<change, key_k>`` for every flat change of ``[batch,
        rows * cols]`` and key."""
        return self.values_many([changes])[0]
