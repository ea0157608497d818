"""Clients that train or submit differently from the rest (``fl.clients``): free-riders,
stragglers, clients with another learning rate or more or fewer local epochs.

A federation in the field is not uniform, and a verdict must not read a client that does less
than the others as evidence. Each group of ``fl.clients`` names its clients (``ids``) or draws
``count`` of them by seed among the clean, the watermarked or all clients, and says how they
differ. Values given as ``[lo, hi]`` are drawn per client, uniformly (log-uniformly for the
scales, whose natural unit is a factor). Every client ends up with one :class:`ClientProfile`
(the default one where no group names it), which the client pool applies and ``results.json``
records (``federation.profiles``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import numpy as np

from ..config import ConfigError, check_literal
from ..models.training import TrainSettings

Range = float | list[float]
"""A value, or ``[lo, hi]``: drawn per client."""


@dataclass
class ClientGroup:
    """One group of clients that differ from the rest (an entry of ``fl.clients``)."""

    ids: list[int] | None = None
    """These clients; ``None``: ``count`` clients drawn by seed among ``among``."""
    count: int = 0
    """How many clients to draw (when ``ids`` is not given)."""
    among: Literal["clean", "watermarked", "any"] = "clean"
    """Whom ``count`` is drawn among: clients with no watermarked documents, those with, or
    all. A group never takes a client an earlier group took."""
    update_scale: Range = 1.0
    """Multiplies the update the client sends (0: a free-rider, who sends a zero update; 0.1: a
    client that sends a tenth of what it learned)."""
    lr_scale: Range = 1.0
    """Multiplies its local learning rate (``fl.train.lr``)."""
    steps: Range = 1.0
    """Share of its planned local steps it completes before it sends (0.5: a straggler that
    stops half-way through its schedule). At least one step is taken."""
    epochs: int | None = None
    """Local epochs in place of ``fl.train.epochs``."""
    drop: float = 0.0
    """Probability that it drops out of a round it was sampled for: it trains but its update
    never reaches secure aggregation (the round's aggregate and FedAttr's queries go on
    without it)."""

    def __post_init__(self) -> None:
        check_literal(self, "fl.clients[]")

    def check(self, key: str) -> None:
        """Raise :class:`ConfigError` (naming the group as ``key``) unless its values are
        allowed."""
        if self.ids is None and self.count < 1:
            raise ConfigError(f"{key}: give ids (a list of client ids) or count >= 1")
        if self.ids is not None and self.count:
            raise ConfigError(f"{key}: give ids or count, not both")
        for name in ("update_scale", "lr_scale", "steps"):
            _check_range(getattr(self, name), f"{key}.{name}", positive=name != "update_scale")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"{key}.epochs: must be >= 1, got {self.epochs}")
        if not 0.0 <= self.drop < 1.0:
            raise ConfigError(f"{key}.drop: must be in [0, 1), got {self.drop}")


def _check_range(value: Range, key: str, positive: bool) -> None:
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and (len(value) != 2 or value[0] > value[1]):
        raise ConfigError(f"{key}: a number or [lo, hi] with lo <= hi, got {value}")
    bad = [v for v in values if v < 0 or (positive and v <= 0)]
    if bad:
        allowed = "> 0" if positive else ">= 0"
        raise ConfigError(f"{key}: must be {allowed}, got {value}")
    if key.endswith("steps") and any(v > 1 for v in values):
        raise ConfigError(f"{key}: a share of the planned steps, in (0, 1]; got {value}")


@dataclass(frozen=True)
class ClientProfile:
    """How one client trains and submits (resolved from ``fl.clients``)."""

    update_scale: float = 1.0
    lr_scale: float = 1.0
    steps: float = 1.0
    epochs: int | None = None
    drop: float = 0.0
    group: int | None = None
    """The index of the ``fl.clients`` group that set it (``None``: the default)."""

    @property
    def default(self) -> bool:
        """Whether this client trains and submits as every client does by default."""
        return self == ClientProfile()

    def settings(self, base: TrainSettings) -> TrainSettings:
        """``base`` with this client's learning rate and epochs."""
        return replace(
            base,
            lr=base.lr * self.lr_scale,
            epochs=self.epochs if self.epochs is not None else base.epochs,
        )

    def to_dict(self) -> dict:
        """JSON-ready (``results.json`` -> ``federation.profiles``)."""
        return asdict(self)


@dataclass
class Profiles:
    """Every client's profile, and who drops out of which round."""

    of: dict[int, ClientProfile] = field(default_factory=dict)
    seed: int = 0

    def __getitem__(self, client: int) -> ClientProfile:
        return self.of.get(client, ClientProfile())

    def drops(self, round_id: int, participants: Sequence[int]) -> list[int]:
        """The participants of ``round_id`` that drop out of it: a draw per (round, client),
        fixed by the seed, so a resumed run and a remote runtime drop the same clients."""
        out = []
        for c in participants:
            p = self[c].drop
            if p > 0 and np.random.default_rng([self.seed, round_id, c, 0xD20]).random() < p:
                out.append(int(c))
        return out

    def summary(self) -> dict[str, dict]:
        """The clients that differ from the default, JSON-ready."""
        return {str(c): p.to_dict() for c, p in sorted(self.of.items()) if not p.default}


def resolve_profiles(
    groups: Sequence[ClientGroup], K: int, watermarked: Sequence[int], seed: int
) -> Profiles:
    """Each client's profile: every group's clients named or drawn (in order; a client taken by
    an earlier group is not drawn again), and its ``[lo, hi]`` values drawn per client."""
    rng = np.random.default_rng([seed, 0xC11E])
    marked = set(watermarked)
    taken: dict[int, ClientProfile] = {}
    for g, group in enumerate(groups):
        group.check(f"fl.clients[{g}]")
        if group.ids is not None:
            bad = [c for c in group.ids if not 0 <= c < K]
            if bad or len(set(group.ids)) != len(group.ids):
                raise ConfigError(
                    f"fl.clients[{g}].ids: distinct client ids in 0..{K - 1}, got {group.ids}"
                )
            twice = [c for c in group.ids if c in taken]
            if twice:
                raise ConfigError(
                    f"fl.clients[{g}].ids: client {twice[0]} is already in group "
                    f"{taken[twice[0]].group}"
                )
            members = list(group.ids)
        else:
            pool = [
                c
                for c in range(K)
                if c not in taken
                and (group.among == "any" or (group.among == "clean") == (c not in marked))
            ]
            if group.count > len(pool):
                raise ConfigError(
                    f"fl.clients[{g}].count: {group.count} {group.among} clients asked for, "
                    f"{len(pool)} left to draw among (fl.K={K}, {len(marked)} watermarked)"
                )
            members = sorted(int(c) for c in rng.choice(pool, group.count, replace=False))
        for c in members:
            taken[c] = ClientProfile(
                update_scale=_draw(group.update_scale, rng, log=True),
                lr_scale=_draw(group.lr_scale, rng, log=True),
                steps=_draw(group.steps, rng, log=False),
                epochs=group.epochs,
                drop=group.drop,
                group=g,
            )
    return Profiles(taken, seed)


def _draw(value: Range, rng: np.random.Generator, log: bool) -> float:
    if not isinstance(value, list):
        return float(value)
    lo, hi = value
    if lo == hi:
        return float(lo)
    if log and lo > 0:
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    return float(rng.uniform(lo, hi))


def profiles_of(profiles: Profiles | Mapping[int, ClientProfile] | None) -> Profiles:
    """``profiles`` as :class:`Profiles` (``None``: every client the default)."""
    if profiles is None:
        return Profiles()
    if isinstance(profiles, Profiles):
        return profiles
    return Profiles(dict(profiles))
