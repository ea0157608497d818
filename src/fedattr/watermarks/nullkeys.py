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

from collections.abc import Iterator
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
