"""Exact tails of a detection statistic that is linear in the key.

An owner's statistic over a change ``W`` (rows: probe contexts or questions, columns: the
vocabulary or the candidate values) is ``T = <W, G>``, with ``G`` the owner's key: row ``x``
of ``G`` marks the ``m`` green tokens of context ``x`` (KGW: a uniform ``m``-subset of the
``V`` tokens, ``m = gamma V``) or the true value among the candidates (Fictitious Knowledge:
``m = 1``). Under the null that ``W`` does not depend on the owner's key, ``G`` is a random
key: its rows are independent uniform ``m``-subsets. Each row of ``W`` is centred first (a
function of ``W`` alone), which changes ``T`` by a constant for fixed-size rows and makes its
null mean exactly 0. The tail ``P(T >= t)`` then follows from ``W`` alone, with no random key
drawn:

- **exact** where every row picks one column and the rows' combinations are few (FK): all
  ``prod(cols)`` sums, enumerated half against half (meet in the middle);
- **saddlepoint** (Barndorff-Nielsen's ``r*``, equivalent to Lugannani-Rice) on the cumulant
  generating function of independent cells, each green with probability ``gamma``, where the
  change is spread over at least :data:`~.methods.MIN_EFFECTIVE_CELLS` effective cells (30).
  Fixed-size rows differ from independent cells by ``O(1 / V)`` in every cumulant of a centred
  row (the variance by the factor ``V / (V - 1)``); the tail check (``experiment
  calibration``) measures the agreement by tilted Monte Carlo;
- elsewhere a valid upper bound, the smaller of two: **chernoff**, ``P(T >= t) <= exp(min_s
  K(s) - s t)`` with ``K`` an upper bound on the fixed-size rows' CGF
  (:class:`~.cgf.RowSubsetsBound`: each row's 16 largest cells exactly (hypergeometric), the
  rest as draws *with* replacement, Hoeffding, 1963, Theorem 4); and **patterns**
  (:class:`~.methods.RowPatternsBound`): the rows that carry the change read pattern by pattern
  and convolved, Chernoff's bound kept only for what is left over, which removes most of the
  factor ``z sqrt(2 pi)`` Chernoff's bound stays above the tail.

Where the owner's key itself is at hand, :func:`~.methods.shifted_keys_p` replaces such a bound
by an exact randomization test over the key shifted row by row (the verdict's
``shifted-keys``).

Every tail is returned as ``log10 p`` (finite far below 1e-300) with the method that gave it.

The package, one concern a module:

- :mod:`.laws`: how a random key is distributed (:class:`~.laws.KeyLaw`: KGW's and FK's row
  subsets, the synthetic bed's directions), each law choosing its tail method; the rank check's
  random keys;
- :mod:`.cgf`: the cumulant generating functions the tails are read from;
- :mod:`.methods`: the tail methods themselves (exact enumeration, saddlepoint, the bounds,
  shifted keys) and tilted Monte Carlo, their check.

A change too large to hold is read by row blocks (:class:`fedattr.rows.Rows`).
"""
