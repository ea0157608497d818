"""Calibrated verdicts: a statistic linear in the owner's key, and its exact tail.

The paper reads each round's differential score as N(0, 1) and adds rounds with Stouffer. On a
real model neither holds (docs, *Findings*): the round's common learning direction projects on
a fixed key as one draw shared by every client and round, a client's own data drift does the
same round after round, and each estimate carries alpha-weighted copies of the watermarked
clients' updates (cross-talk). Here each client's evidence is kept as a *change matrix*, and an
owner's statistic is that matrix read with the owner's key:

1. **Changes.** The detector turns each estimate into a change that its statistic is linear in
   (KGW reading: the next-token distributions' change per previous token, ``[contexts,
   vocab]``; FK: the candidate values' log-probability change per attribute; the synthetic
   bed: the parameter change).
2. **Cross-talk undone.** When every participant of a round is a target, the round's changes
   are ``Y = A X`` with ``A`` the known design matrix (row i: 1 for the target, alpha for the
   others), so ``X = A^{-1} Y`` is each client's own change. Hardened mode targets few clients
   per round, so no round alone undoes it; there every such round is stacked and de-mixed
   across rounds instead (``attribution.calibrated.across_rounds = "demix"``,
   :class:`~.demix.DeMixer`): each client's mean change over the rounds by generalised least
   squares is read once as that client's ``W_i``.
3. **Centred without a key, in round 1.** Round 1's reference is the base model, which no
   client's update has reached, so every clean client's change there is a function of inputs
   that depend on no key. From each client's round-1 change the cell-wise median over the
   round's clients is subtracted where cross-talk was undone (a minority of watermarked clients
   barely moves it), else the change the round's SA mean makes. The cell weights (taper, spread:
   :mod:`.weights`) are round 1's too, kept for every later round.
   From round 2 the reference has learned the watermarked clients' documents and every client's
   change reacts to it (a clean client forgets them): nothing made of the other clients'
   changes or of that reference is read into a client's change
   (``attribution.calibrated.centre = "first"``, ``cell_weights = "first"``), so a clean
   client's reading depends on a key only through its own reaction to the reference,
   forgetting, which reads against the key; a centre made of the other clients' changes would
   carry their forgetting into it with a plus sign and read a client that updates less than
   the median (a free-rider, a straggler, a small shard) as evidence.
4. **Standardised and summed.** Each (client, round) change is divided by the standard
   deviation its statistic has under a random key (analytic), so every round weighs the same,
   as in Stouffer, and summed over rounds: ``W_i = sum_t (E_it - C_t) / sigma_it`` (``C_t = 0``
   after round 1).
5. **Exact tail.** The owner's statistic is ``<W_i, G>``; with ``W_i`` fixed, its law under a
   random key is known exactly (:mod:`fedattr.watermarks.tail`: exact enumeration, saddlepoint
   or a Chernoff bound; where it is a bound and the detector lends the owner's key, an exact
   randomization test over that key shifted row by row; the method is recorded): exact for
   round 1's reading, conservative for the rounds after it as long as a clean client does not
   move towards a key its reference learned. Over several owners ``p`` is Bonferroni-adjusted
   and a client is named when it is below ``alpha / K``: family-wise level ``alpha`` over
   clients x owners. ``null_keys`` random keys read ``W_i`` once at the end as a
   check (``p_rank``, resolution ``1 / (null_keys + 1)``).

A detector whose key is exchangeable with a random one only in the first rounds says so
(``exchangeable_rounds``; KGW and FK: 1, since from round 2 the reference model has learned
the owners' documents from the watermarked clients). The later rounds are read as step 3 says
(``attribution.calibrated.late_rounds = "read"``; ``"skip"`` reads round 1 alone, whose
p-values are exact); read with a centre of the clients' or with each round's own cell weights
(``attribution.calibrated.centre = "every"``, ``cell_weights = "round"``: the statistic before,
see the CHANGELOG) they are uncalibrated: reported, and no client is named by them unless
``attribution.calibrated.name_uncalibrated`` asks for it. The same holds for a client with a
round whose cross-talk was kept and not de-mixed (``attribution.calibrated.across_rounds =
"keep"``, or a client the stacked rounds do not identify): its estimate then carries
alpha-weighted copies of the other clients' updates, watermarked ones included, which the SA
mean does not remove (measured on the synthetic bed at r = 3: 6.3% of runs named a clean client
at family-wise 1%). De-mixed, a watermarked client's key-aligned change leaks into another
client's only through its variation across rounds (see :mod:`.demix`): none on the synthetic
bed, whose watermark signal is the same every round.

The package, one concern a module, in the order a round goes through them:

- :mod:`.plan`: :class:`~.plan.RoundPlan`, how a round is read, decided once from its public
  designs (``A^{-1}``, whether cross-talk is undone and on what, by rows or whole, de-mixed);
- :mod:`.weights`: the key-free cell weights (taper, spread) and the cell-wise median;
- :mod:`.crosstalk`: the design matrix and ``A^{-1}`` applied to updates or changes (step 2);
- :mod:`.standardise`: steps 2-4 over a round's changes, whole or a block of rows at a time;
- :mod:`.demix`: rounds whose cross-talk is kept, de-mixed across rounds;
- :mod:`.sums`: :class:`~.sums.CalibratedNull`, the sums ``W_i`` and owners' values over
  rounds (in memory or spilled to disk), checkpoints, a finished run's sums read back;
- :mod:`.reading`: one round's models read into changes and handed to the sums;
- :mod:`.verdict`: step 5, a pure function of the sums: exact tails, shifted keys, the rank
  check, the report.

What a detector must offer is :class:`~fedattr.attribution.contract.LinearKeyScorer`
(:mod:`fedattr.attribution.contract`).
"""
