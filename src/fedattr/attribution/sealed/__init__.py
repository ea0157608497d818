"""The sealed mode (``attribution.protocol.mode = "sealed"``): attribution that opens the
verdict and little else, across rounds too.

Paper mode asks secure aggregation for subset sums, and one round's sums reveal every update
(Finding 1); hardened mode rations them, yet every client's mean update is identifiable across
rounds. Here no subset sum is ever asked:

1. **Shares.** Each client splits what it submits into two real-valued additive shares
   (:func:`fedattr.secagg.sealed.split_update`: the update plus Gaussian noise, and minus the
   noise) for two non-colluding servers (:mod:`.servers`). The servers open the round's
   aggregate and nothing else about a round.
2. **First-order reading on shares.** The detector's change is read to first order at the
   public reference (forward-mode AD), a linear map of the update: each server reads its own
   share, and the two readings add up to the client's. Each server keeps only its share of
   every client's summed change ``W_i`` (public weights and scales, round 1 centred on the
   aggregate's change).
3. **Openings to the owners only.** At the end each owner receives, per client, ``<W_i, G>``
   under its own key (a Beaver-triple inner product on ring shares of ``W_i`` and of the key:
   the key never leaves the owner in the clear) and under ``n`` public random keys of the same
   law; its p-value is the owner key's rank among them, exact at any ``n`` (:mod:`.owner`).

Where the parties run (:mod:`.parties`): all in this process, or each on its own Flower node
(:mod:`fedattr.flower.sealed`). The threat model (who may collude with whom, what each party
sees) is in ``docs/explanation/sealed-mode.md``.
"""

from ..contract import Parties
from .observer import SealedAttribution, SealedObserver
from .owner import OwnerOpenings, sealed_report
from .parties import LocalParties, Verdicts
from .servers import ReadingServer, first_order_parts

__all__ = [
    "LocalParties",
    "OwnerOpenings",
    "Parties",
    "ReadingServer",
    "SealedAttribution",
    "SealedObserver",
    "Verdicts",
    "first_order_parts",
    "sealed_report",
]
