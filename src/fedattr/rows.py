"""Change matrices read by row blocks: held in memory, in a file, or in a saved run.

A client's summed change ``W_i`` has ``contexts x vocab`` cells: at Llama-3's 128,256 tokens and
8,000 probe contexts that is 1e9 cells, 8 GB in float64 and 4 GB in float32 per client. The
calibrated statistic reads ``W_i`` only through sums over cells or rows (its owners' values, its
null variance, the tails' cumulant generating functions, the rank check), so it never needs it
whole: every reader takes a block of rows at a time from a :class:`Rows`, which is

- :class:`DenseRows`: a tensor or array in memory;
- :class:`DiskRows`: a float32 file, summed into and read by row blocks
  (``attribution.calibrated.spill``: the sums kept on disk, in a :class:`TemporaryFolder`);
- :class:`SavedRows`: one change of a finished run's ``changes.safetensors``
  (:func:`save_changes` writes it a block of rows at a time, :func:`open_changes` reads it).

Files are read and written with ``pread``/``pwrite``, not memory-mapped: the pages read stay in
the page cache (reclaimable), not in the process's resident set.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

BLOCK_CELLS = 1 << 22
"""Cells of one row block where a change is read by blocks (a stored ``W``): 32 MB as float64,
so the tails of a 1e9-cell change hold a few such blocks (and their temporaries) at a time."""


@runtime_checkable
class Rows(Protocol):
    """A ``[rows, cols]`` change read by row blocks (a stored ``W``, e.g. on disk): the tails,
    the variance and the rank check read it a block at a time, never whole."""

    rows: int
    cols: int

    def block(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` as float64 (a new array the caller may keep)."""
        ...


class DenseRows:
    """:class:`Rows` over a tensor or array held in memory (float64 blocks of it)."""

    def __init__(self, W: torch.Tensor | np.ndarray, cols: int) -> None:
        self.W = W.reshape(-1, cols)
        self.rows, self.cols = int(self.W.shape[0]), cols

    def block(self, lo: int, hi: int) -> np.ndarray:
        b = self.W[lo:hi]
        if isinstance(b, torch.Tensor):
            return b.detach().double().cpu().numpy()
        return np.asarray(b, dtype=np.float64)


def block_rows(cols: int, cells: int = BLOCK_CELLS) -> int:
    """Rows per block of at most ``cells`` cells (at least one row)."""
    return max(1, cells // max(1, cols))


def row_blocks(
    src: Rows, cells: int = BLOCK_CELLS, rows: np.ndarray | None = None
) -> Iterator[np.ndarray]:
    """``src`` a block of rows at a time, in order (``rows``: only these, sorted)."""
    step = block_rows(src.cols, cells)
    for lo in range(0, src.rows, step):
        hi = min(src.rows, lo + step)
        b = src.block(lo, hi)
        if rows is not None:
            b = b[rows[(rows >= lo) & (rows < hi)] - lo]
            if not len(b):
                continue
        yield b


def blocks_of(W: np.ndarray | Rows, cells: int) -> tuple[Rows, bool]:
    """``W`` as :class:`Rows`, and whether it is one block (then read once and kept)."""
    src = W if isinstance(W, Rows) else DenseRows(W, W.shape[-1])
    return src, src.rows <= block_rows(src.cols, cells)


class TemporaryFolder:
    """A temporary folder for spilled sums, removed once nothing refers to it (each
    :class:`DiskRows` in it keeps it alive, so saved changes outlive the statistic)."""

    def __init__(self, prefix: str = "fedattr-sums-") -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        weakref.finalize(self, shutil.rmtree, str(self.path), True)


class DiskRows:
    """A ``[rows, cols]`` float32 matrix in a raw file (row-major), summed into and read by row
    blocks. A new file reads as zeros (it is created sparse). ``keep``: an object the file
    needs alive (its :class:`TemporaryFolder`)."""

    def __init__(self, path: str | Path, rows: int, cols: int, keep: object = None) -> None:
        self.path, self.rows, self.cols, self.keep = Path(path), int(rows), int(cols), keep
        size = 4 * self.rows * self.cols
        with open(self.path, "ab") as f:
            if f.tell() != size:
                f.truncate(size)

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)``."""
        return self.rows, self.cols

    def _read(self, lo: int, hi: int) -> np.ndarray:
        count = (hi - lo) * self.cols
        out = np.empty(count, dtype=np.float32)
        view = out.data.cast("B")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done, offset = 0, 4 * lo * self.cols
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"{self.path}: short read at byte {offset + done}")
                done += n
        finally:
            os.close(fd)
        return out.reshape(hi - lo, self.cols)

    def block(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` as float64."""
        return self._read(lo, hi).astype(np.float64)

    def add(self, lo: int, rows: torch.Tensor | np.ndarray) -> np.ndarray:
        """``W[lo : lo + len(rows)] += rows``: summed in float64, stored in float32 (one
        rounding per round, as the saved changes already were). Returns what the stored rows
        changed by (float64, exact: the difference of two float32 values), so a statistic
        linear in ``W`` can follow the stored ``W`` itself rather than the rows added."""
        x = rows.detach().cpu().double().numpy() if isinstance(rows, torch.Tensor) else rows
        x = np.asarray(x, dtype=np.float64).reshape(-1, self.cols)
        hi = lo + len(x)
        old = self._read(lo, hi)
        total = (old + x).astype(np.float32)
        self.write(total, lo)
        return total.astype(np.float64) - old

    def write(self, rows: torch.Tensor | np.ndarray, lo: int = 0) -> None:
        """``W[lo : lo + len(rows)] = rows`` (stored in float32: float32 values exactly)."""
        x = rows.detach().cpu().float().numpy() if isinstance(rows, torch.Tensor) else rows
        data = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(-1, self.cols))
        view = data.data.cast("B")
        fd = os.open(self.path, os.O_WRONLY)
        try:
            done, offset = 0, 4 * lo * self.cols
            while done < len(view):
                done += os.pwritev(fd, [view[done:]], offset + done)
        finally:
            os.close(fd)

    def rows_as_tensor(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` as a float32 tensor (the stored values)."""
        return torch.from_numpy(self._read(lo, hi))

    def tensor(self) -> torch.Tensor:
        """The whole matrix as a float32 tensor (memory: all of it)."""
        return self.rows_as_tensor(0, self.rows)


def save_changes(path: str | Path, changes: Mapping[str, torch.Tensor | DiskRows]) -> None:
    """A ``changes.safetensors`` of float32 tensors, written a block of rows at a time where a
    change is on disk (:class:`DiskRows`), so saving holds no change whole: a file that
    :func:`safetensors.torch.load_file` reads as those tensors (the format: an 8-byte header
    length, a JSON header padded with spaces to 8 bytes, then the data at its offsets)."""
    names = sorted(changes)
    header: dict[str, dict] = {}
    offset = 0
    for name in names:
        x = changes[name]
        shape = list(x.shape)
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            x = changes[name]
            if isinstance(x, DiskRows):
                step = block_rows(x.cols)
                for lo in range(0, x.rows, step):
                    f.write(x._read(lo, min(x.rows, lo + step)).tobytes())
            else:
                f.write(x.detach().float().contiguous().cpu().numpy().tobytes())


LAZY_BYTES = 1 << 30
"""A saved ``changes.safetensors`` larger than this is read a block of rows at a time."""


class SavedRows:
    """One ``[rows, cols]`` tensor of a ``changes.safetensors``, read by row blocks
    (:class:`Rows`) without loading the file."""

    def __init__(self, path: str | Path, name: str) -> None:
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="pt")
        self._slice = self._file.get_slice(name)
        shape = list(self._slice.get_shape())
        if len(shape) != 2:
            raise ValueError(f"{name}: expected a [rows, cols] change, got shape {shape}")
        self.rows, self.cols = shape
        self.shape = tuple(shape)

    def block(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` as float64."""
        return self._slice[lo:hi].double().numpy()


def open_changes(
    path: str | Path, lazy_bytes: int = LAZY_BYTES
) -> dict[str, torch.Tensor | SavedRows]:
    """A run's ``changes.safetensors``: loaded whole (float32 tensors, as saved), or where the
    file is larger than ``lazy_bytes`` its two-dimensional changes as :class:`SavedRows`, read
    a block of rows at a time (a run over a large vocabulary and many contexts)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor | SavedRows] = {}
    if Path(path).stat().st_size <= lazy_bytes:
        out.update(load_file(str(path)))
        return out
    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        shapes = {n: f.get_slice(n).get_shape() for n in names}
    for name in names:
        if len(shapes[name]) == 2:
            out[name] = SavedRows(path, name)
        else:
            with safe_open(str(path), framework="pt") as f:
                out[name] = f.get_tensor(name)
    return out
