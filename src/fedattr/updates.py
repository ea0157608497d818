"""Client updates as plain tensors or named collections of tensors.

An *update* is what one client contributes in one round: a single ``torch.Tensor`` or a mapping
from names to tensors (e.g. the LoRA ``A``/``B`` factors of every adapted module). Secure
aggregation and the FedAttr estimator work on one flat float64 vector per update; an
:class:`UpdateLayout` remembers names, shapes and dtypes so the vector can be turned back into
the structure the caller submitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

Update = torch.Tensor | Mapping[str, torch.Tensor]
"""A client's update: one tensor, or a mapping of names to tensors."""


@dataclass(frozen=True)
class UpdateLayout:
    """Names, shapes and dtypes of an update, so flat vectors can be restored.

    ``names`` is ``None`` for a bare tensor, else the mapping's keys in sorted order (sorting
    makes the layout independent of dict insertion order, so every client agrees on it).
    """

    names: tuple[str, ...] | None
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def size(self) -> int:
        """Number of scalar coordinates in the flattened update."""
        return sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @classmethod
    def of(cls, update: Update) -> UpdateLayout:
        """Layout of ``update``; raises ``TypeError`` for anything but a tensor or mapping."""
        if isinstance(update, torch.Tensor):
            return cls(None, (tuple(update.shape),), (update.dtype,))
        if isinstance(update, Mapping):
            if not update:
                raise ValueError("update: an empty mapping has nothing to aggregate")
            names = tuple(sorted(update))
            for name in names:
                if not isinstance(update[name], torch.Tensor):
                    raise TypeError(
                        f"update[{name!r}]: expected a torch.Tensor, "
                        f"got {type(update[name]).__name__}"
                    )
            return cls(
                names,
                tuple(tuple(update[n].shape) for n in names),
                tuple(update[n].dtype for n in names),
            )
        raise TypeError(
            f"update: expected a torch.Tensor or a mapping of names to tensors, "
            f"got {type(update).__name__}"
        )

    def flatten(self, update: Update) -> np.ndarray:
        """The update as one contiguous float64 vector, checked against this layout."""
        other = UpdateLayout.of(update)
        if (other.names, other.shapes) != (self.names, self.shapes):
            raise ValueError(
                f"update: layout {other.describe()} does not match this round's layout "
                f"{self.describe()}; every client must submit the same names and shapes"
            )
        if isinstance(update, torch.Tensor):
            parts = [update]
        else:
            parts = [update[n] for n in self.names or ()]
        flat = np.empty(self.size, dtype=np.float64)
        offset = 0
        for t in parts:
            n = t.numel()
            flat[offset : offset + n] = t.detach().to("cpu", torch.float64).reshape(-1).numpy()
            offset += n
        return flat

    def unflatten(self, flat: np.ndarray) -> Update:
        """Restore the submitted structure (names, shapes, dtypes) from a flat vector."""
        if flat.shape != (self.size,):
            raise ValueError(f"flat vector has shape {flat.shape}, layout needs ({self.size},)")
        tensors = []
        offset = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            n = int(np.prod(shape, dtype=np.int64))
            chunk = torch.from_numpy(np.ascontiguousarray(flat[offset : offset + n]))
            tensors.append(chunk.reshape(shape).to(dtype))
            offset += n
        if self.names is None:
            return tensors[0]
        return dict(zip(self.names, tensors, strict=True))

    def to_dict(self) -> dict:
        """JSON-ready form (a remote client reports its update's layout, never its values)."""
        return {
            "names": None if self.names is None else list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": [str(d).removeprefix("torch.") for d in self.dtypes],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> UpdateLayout:
        """Inverse of :meth:`to_dict`."""
        dtypes = []
        for name in d["dtypes"]:
            dtype = getattr(torch, str(name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"layout.dtypes: unknown torch dtype {name!r}")
            dtypes.append(dtype)
        names = d["names"]
        return cls(
            None if names is None else tuple(str(n) for n in names),
            tuple(tuple(int(x) for x in s) for s in d["shapes"]),
            tuple(dtypes),
        )

    def describe(self) -> str:
        """Short human-readable description, for error messages."""
        if self.names is None:
            return f"tensor{list(self.shapes[0])}"
        items = ", ".join(f"{n}{list(s)}" for n, s in zip(self.names, self.shapes, strict=True))
        return "{" + items + "}"


def add_update(params: Update, delta: Update) -> Update:
    """``params + delta`` for a tensor or a mapping (keys of ``delta`` must exist in ``params``).

    Parameters missing from ``delta`` are kept unchanged, so a LoRA update can be applied to
    a larger parameter dictionary.
    """
    # The delta is moved to each parameter's device and dtype: SA answers live on the CPU while
    # the parameters may sit on a GPU (or the meta device in tests).
    if isinstance(params, torch.Tensor) and isinstance(delta, torch.Tensor):
        return params + delta.to(device=params.device, dtype=params.dtype)
    if isinstance(params, Mapping) and isinstance(delta, Mapping):
        missing = sorted(set(delta) - set(params))
        if missing:
            raise KeyError(f"delta names {missing[:3]} are not among the model parameters")
        return {
            k: (v + delta[k].to(device=v.device, dtype=v.dtype)) if k in delta else v
            for k, v in params.items()
        }
    raise TypeError(
        f"cannot add a {type(delta).__name__} update to {type(params).__name__} parameters"
    )


def scale_update(update: Update, factor: float) -> Update:
    """``factor * update`` for a tensor or key-wise for a mapping."""
    if isinstance(update, Mapping):
        return {k: v * factor for k, v in update.items()}
    return update * factor
