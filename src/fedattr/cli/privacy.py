"""``fedattr privacy`` and ``fedattr audit``: what a query design, and a run's SA answers, reveal.

Both only compute on numbers or read a folder: they leave the machine's threads as they are.
"""

from __future__ import annotations

import argparse
import json

from ..errors import UserError

_PRIVACY_BYTES = (36, 100)
"""Peak bytes of ``fedattr privacy`` per Monte Carlo entry (trials x M x (K-1): the subset
draws and their ranks) and per M K^2 (one round's 2MK x K query matrix and its SVD), measured
with NumPy (33 and 95)."""


def _check_privacy(args: argparse.Namespace) -> None:
    """The numbers of ``fedattr privacy``, and whether this machine can hold the computation."""
    import math

    from ..attribution.design import validate_parameters
    from ..runtime import available_memory

    if args.trials < 1:
        raise UserError(f"--trials: Monte Carlo draws, must be >= 1, got {args.trials}")
    if not (args.d_star > 0 and math.isfinite(args.d_star)):
        raise UserError(
            f"--d-star: the effective dimension, must be a number > 0, got {args.d_star:g}"
        )
    if not (args.C >= 0 and math.isfinite(args.C)):
        raise UserError(f"--C: must be a number >= 0, got {args.C:g}")
    K, M, trials = args.K, args.M, args.trials
    validate_parameters(K, args.N, M)
    free = available_memory()
    if free is None:
        return
    limit = free // 2
    per_draw, per_mk2 = _PRIVACY_BYTES
    draws, joint = per_draw * trials * M * (K - 1), per_mk2 * M * K * K
    if max(draws, joint) <= limit:
        return
    k_max = min(1 + limit // (per_draw * trials * M), math.isqrt(limit // (per_mk2 * M)))
    fits = (
        f"at most --K {k_max} with these --M and --trials"
        if k_max >= 3
        else "lower --M or --trials"
    )
    if joint <= limit:
        fits += f", or at most --trials {limit // (per_draw * M * (K - 1))} at this K"

    def gb(n: int) -> str:
        return f"{n / 1e9:,.1f} GB" if n < 1e10 else f"{n / 1e9:,.0f} GB"

    raise UserError(
        f"--K: K={K}, M={M} and {trials} trials need about {gb(max(draws, joint))} of memory "
        f"(Monte Carlo draws {gb(draws)}, one round's joint recovery {gb(joint)}), more than "
        f"the {gb(limit)} allowed here (half the available memory): {fits}"
    )


def _cmd_privacy(args: argparse.Namespace) -> int:
    from ..attribution.privacy import summarize

    _check_privacy(args)  # before anything is allocated
    s = summarize(
        args.K, args.N, args.M, d_star=args.d_star, C=args.C, trials=args.trials, seed=args.seed
    )
    if args.json:
        print(json.dumps(s.to_dict(), indent=2))
        return 0
    a, j = s.acceptance, s.joint
    print(f"FedAttr design K={s.K}, N={s.N}, M={s.M}  (rho = N/(K-1) = {s.rho:.4f})")
    print(
        f"  acceptance rate (Monte Carlo, {a.trials} draws): "
        f"{100 * a.rate:.2f}% ± {100 * a.stderr:.2f}%"
    )
    print(f"  threshold aN = (1-rho)/M * N:                     {s.threshold_aN:.4f}")
    print(f"  E[c] before the rule (2/M)N(K-1-N)/(K-1):         {s.expected_c:.4f}")
    print(f"  E[c] over accepted designs:                       {a.mean_c_accepted:.4f}")
    print(f"  E[M_eff] over accepted designs:                   {a.mean_m_eff_accepted:.3f}")
    print(f"  variance factor N(K-1-N)/(K-2):                   {s.variance_factor:.4f}")
    print(f"  SA queries per round (2MK):                       {s.queries_per_round}")
    print(
        f"  Theorem-4 bound, one estimate (d*={s.d_star:g}, C={s.C:g}): "
        f"{s.leakage_bound_nats:.4f} nats"
    )
    print(
        f"  joint release: the round's {j.queries} queries have rank {j.rank} of {s.K}; "
        f"{j.recoverable_clients} of {s.K} updates are EXACTLY recoverable by least squares"
    )
    print("  (the Theorem-4 bound covers one released estimate only; see README, 'Security')")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from ..reporting.markdown import audit_table, cross_round_table
    from ..reporting.run_folder import audit_run, audit_run_cross_round

    rounds = audit_run(args.run_dir)
    across = audit_run_cross_round(args.run_dir)
    if args.json:
        listed = [r.to_dict() for r in rounds]
        if args.cross_round:
            out = {"rounds": listed, "cross_round": [a.to_dict() for a in across]}
            print(json.dumps(out, indent=2))
        else:  # the per-round list alone, as before --cross-round existed
            print(json.dumps(listed, indent=2))
        return 0
    if not args.cross_round:  # the per-round audit, then the cross-round one
        print(audit_table(rounds))
        exposed = sum(len(r.recoverable) for r in rounds)
        print(
            f"\n{exposed} client-rounds exactly recoverable from the answered queries"
            if exposed
            else "\nno client's update is exactly recoverable in any round"
        )
    elif not across:
        print("no SA answers released: nothing to stack across rounds")
    for i, a in enumerate(across):
        name = f" (session {a.session})" if a.session else ""
        gap = "" if args.cross_round and i == 0 else "\n"  # alone: no blank line first
        print(
            f"{gap}## Across rounds{name}: {a.rounds} rounds stacked, rank {a.rank} of "
            f"{len(a.clients)}\n\n"
            "Model: each update is the client's persistent mean plus independent round noise; "
            "the mean is identifiable when e_j lies in the stacked rows' span, and its best "
            "linear unbiased (GLS) estimate has variance sigma^2 [F+]_jj.\n"
        )
        print(cross_round_table(a))
        only = a.only_across_rounds
        print(
            f"\n{len(a.identifiable)} of {len(a.clients)} clients' mean updates identifiable "
            f"across rounds; {len(only)} of them exactly recoverable in no single round"
            + (f" ({', '.join(map(str, only))})" if only else "")
        )
        rec = a.reconstruction
        if rec and rec.get("median_error_gls") is not None:
            print(
                "measured in the simulation (the server's answers against the true mean "
                f"updates): median relative error GLS {rec['median_error_gls']:.4f}, OLS "
                f"{rec['median_error_ols']:.4f}, the public mean update as the guess "
                + (
                    f"{rec['median_error_public_mean']:.4f}"
                    if rec.get("median_error_public_mean") is not None
                    else "–"
                )
            )
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``privacy`` and ``audit`` (no thread set-up: see the module's docstring)."""
    priv = sub.add_parser("privacy", help="acceptance rate, variance and leakage of a design")
    priv.add_argument("--K", type=int, default=10, help="participating clients (default 10)")
    priv.add_argument("--N", type=int, default=5, help="subset size N (default 5)")
    priv.add_argument("--M", type=int, default=5, help="query pairs per target (default 5)")
    priv.add_argument(
        "--d-star",
        dest="d_star",
        type=float,
        default=1.0,
        help="effective dimension d* of an update (default 1: per dimension)",
    )
    priv.add_argument(
        "--C",
        type=float,
        default=0.0,
        help="Theorem-4 constant C of the second term (default 0: Gaussian term only)",
    )
    priv.add_argument(
        "--trials", type=int, default=20_000, help="Monte Carlo draws (default 20000)"
    )
    priv.add_argument("--seed", type=int, default=0, help="Monte Carlo seed (default 0)")
    priv.add_argument("--json", action="store_true", help="print the summary as JSON")
    priv.set_defaults(func=_cmd_privacy, threads=False)

    audit = sub.add_parser(
        "audit",
        help="what a run's SA answers reveal: exact recovery and joint leakage per round, "
        "and identifiability of each client's mean update across rounds",
    )
    audit.add_argument("run_dir", metavar="RUN_DIR", help="a folder written with --out")
    audit.add_argument(
        "--json", action="store_true", help="print each round's audit as JSON (a list)"
    )
    audit.add_argument(
        "--cross-round",
        dest="cross_round",
        action="store_true",
        help="the cross-round audit: alone (without it the text report has the per-round "
        "audit, then this one); with --json an object, the rounds' list under 'rounds' and "
        "the cross-round audit per SA session under 'cross_round'",
    )
    audit.set_defaults(func=_cmd_audit, threads=False)
