"""The ``[data]`` section: where the clients' instruction data comes from and how it is split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..config import check_literal


@dataclass
class DataConfig:
    """Where the clients' instruction data comes from and how it is split."""

    path: str = ""
    """Local .json/.jsonl (Alpaca or chat form) or a Hugging Face dataset id; empty: the
    embedded procedural corpus."""
    split: str = "train"
    """The split of a Hugging Face dataset (``data.path`` a hub id); unused otherwise."""
    records: int = 2000
    """Records drawn for the clients (embedded corpus size, or a cap on a loaded file)."""
    partition: Literal["iid", "dirichlet", "quantity"] = "iid"
    """``iid``; ``dirichlet``: label skew, each category's records shared out by
    Dirichlet(``dirichlet_alpha``); ``quantity``: quantity skew, shard sizes by
    Dirichlet(``dirichlet_alpha``), records dealt at random (every client at least one; a client
    whose records leave no token to learn within ``max_len`` takes part with a zero update and
    FedAvg weight 0)."""
    dirichlet_alpha: float = 0.5
    """The Dirichlet concentration of ``partition = "dirichlet"`` and ``"quantity"`` (smaller:
    more skewed)."""
    max_len: int = 128
    """Longest training sequence in tokens."""
    seed: int = 0
    """Seed of the records: the embedded corpus's draw (clients' and held-out records), a
    loaded file's shuffle, and the partition among the clients."""

    def __post_init__(self) -> None:
        check_literal(self, "data")
        if self.records < 1:
            raise ValueError(f"data.records: must be >= 1, got {self.records}")
        if self.max_len < 8:
            raise ValueError(f"data.max_len: must be >= 8, got {self.max_len}")
        p = Path(self.path)
        # Checked here, before any model is loaded or trained.
        if self.path and p.is_dir():
            raise ValueError(
                f"data.path: {self.path!r} is a directory; a .json/.jsonl file (or a Hugging "
                "Face dataset id) is expected"
            )
        # Only a .json/.jsonl path is surely a local file: "owner/name" may be a hub dataset id.
        if self.path and p.suffix in (".json", ".jsonl") and not p.exists():
            raise ValueError(f"data.path: file {self.path!r} does not exist")
