"""Linear algebra of released linear combinations, at one numerical rank tolerance.

Secure aggregation's answers are linear combinations ``Y = A Delta`` of the clients' updates
with known coefficient rows ``A``. What they determine is read off the rows' span: client j is
exactly determined when ``e_j`` lies in it (``||P e_j||^2 = 1``, ``P`` the projector onto the
span). Every rank decision here uses the same tolerance, so the release policy, the audits and
the de-mixer agree on what a set of rows determines.

:class:`StackedGLS` is the one generalised-least-squares stack over rounds that both the
cross-round audit (:mod:`fedattr.attribution.crossround`) and the calibrated statistic's
de-mixer (:mod:`fedattr.attribution.calibrated.demix`) read: under a persistent-mean model
``Delta_j^t = mu_j + eps_j^t`` with isotropic round noise, round t tells ``P_t Delta^t``
(``P_t = A_t^+ A_t``), and the best linear unbiased estimate of ``mu`` solves

    F mu = sum_t A_t^+ Y_t,    F = sum_t P_t;

``mu_j`` is identifiable iff ``e_j`` lies in the range of ``F``, and its variance over the
noise's is ``[F^+]_jj``. The right-hand side is kept by the caller, in whatever form its
answers take (flat vectors, per-part tensors): :meth:`StackedGLS.add` returns ``A_t^+`` for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

EXACT_TOL = 1e-9
"""``||P e_j||^2 >= 1 - EXACT_TOL`` counts as exact recovery (numerical rank tolerance)."""


def _rcond(shape: Sequence[int]) -> float:
    """The relative cut-off below which a singular value counts as zero."""
    return max(shape) * np.finfo(float).eps * 10


def row_space_basis(rows: np.ndarray) -> np.ndarray:
    """An orthonormal basis (one per row) of the span of ``rows``, by SVD at the numerical
    rank tolerance every audit uses."""
    rows = np.atleast_2d(np.asarray(rows, dtype=float))
    if rows.size == 0:
        return np.zeros((0, rows.shape[1]))
    _, s, vt = np.linalg.svd(rows, full_matrices=False)
    rank = int(np.sum(s > s.max() * max(rows.shape) * np.finfo(float).eps * 10))
    return vt[:rank]


def pinv(rows: np.ndarray) -> np.ndarray:
    """The pseudo-inverse ``A^+`` of a design at the same tolerance."""
    return np.linalg.pinv(rows, rcond=_rcond(rows.shape))


def psd_pinv(f: np.ndarray) -> np.ndarray:
    """Pseudo-inverse of a symmetric PSD matrix at the audits' rank tolerance."""
    if f.size == 0:
        return f.copy()
    w, v = np.linalg.eigh(f)
    keep = w > max(w.max(), 0.0) * f.shape[0] * np.finfo(float).eps * 10
    return (v[:, keep] / w[keep]) @ v[:, keep].T


def in_range(f: np.ndarray) -> np.ndarray:
    """``||P e_j||^2 >= 1 - EXACT_TOL`` per column j, P the projector onto the span of ``f``'s
    rows (for a symmetric ``f``, its range)."""
    basis = row_space_basis(f)
    return np.sum(basis**2, axis=0) >= 1.0 - EXACT_TOL


class StackedGLS:
    """``F = sum_t A_t^+ A_t`` over the rounds added, its columns indexed by client id (the
    index grows as new clients appear in a round's rows, in the order they appear)."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self.ids: list[int] = list(ids)
        """Every client in a stacked round's rows (the order of :attr:`f`)."""
        self.f = np.zeros((len(self.ids), len(self.ids)))
        """``F = sum_t A_t^+ A_t``."""

    def extend(self, clients: Iterable[int]) -> None:
        """Index ``clients`` not indexed yet (after the others, in the order given)."""
        new = [c for c in clients if c not in self.ids]
        if not new:
            return
        n = len(self.ids)
        self.ids.extend(new)
        f = np.zeros((len(self.ids), len(self.ids)))
        f[:n, :n] = self.f
        self.f = f

    def add(self, rows: np.ndarray) -> np.ndarray:
        """One round's design ``A_t`` (columns in :attr:`ids` order) into ``F``; returns
        ``A_t^+``, which maps the round's answers to its part of ``sum_t A_t^+ Y_t``."""
        plus = pinv(rows)
        self.f += plus @ rows
        return plus

    def identifiable(self) -> np.ndarray:
        """Per client (in :attr:`ids` order): whether its mean is identifiable."""
        return in_range(self.f)

    def inverse(self) -> np.ndarray:
        """``F^+``: row j maps ``sum_t A_t^+ Y_t`` to client j's estimate."""
        return psd_pinv(self.f)

    def __add__(self, other: StackedGLS) -> StackedGLS:
        """The stack of both sets of rounds (indexed alike)."""
        if self.ids != other.ids:
            raise ValueError("StackedGLS: cannot add stacks indexed by other clients")
        out = StackedGLS(self.ids)
        out.f = self.f + other.f
        return out
