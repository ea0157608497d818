"""Benchmark: milliseconds per subset-sum query for each SA backend vs a plain sum."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..errors import UserError
from ..reporting.markdown import table
from ..secagg import BACKENDS, SecAggConfig, make_aggregator


@dataclass
class BenchRow:
    """Timing of one backend (or the plain-sum baseline) on one device."""

    backend: str
    device: str
    dim: int
    members: int
    ms_per_query: float
    client_ms_max: float
    upload_ms: float
    bytes_per_query: int
    ratio_to_plain_sum: float

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def _plain_sum_ms(vectors: Sequence[torch.Tensor], device: str, repeats: int) -> float:
    xs = [v.to(device) for v in vectors]
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = xs[0].clone()
        for x in xs[1:]:
            total += x
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def bench_secagg(
    dim: int,
    members: int,
    backends: Sequence[str] | None = None,
    repeats: int = 3,
    base: SecAggConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Time ``repeats`` queries over ``members`` clients of ``dim`` float32 coordinates each."""
    if dim < 1:
        raise UserError(f"--dim: must be >= 1, got {dim}")
    if members < 1:
        raise UserError(f"--members: must be >= 1, got {members}")
    if repeats < 1:
        raise UserError(f"--repeats: must be >= 1, got {repeats}")
    names = list(backends or BACKENDS)
    unknown = [b for b in names if b not in BACKENDS]
    if unknown:
        raise UserError(f"--backend: unknown {unknown}; allowed: {', '.join(BACKENDS)}")
    say = progress or (lambda msg: print(msg, file=sys.stderr))
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(dim, generator=gen) * 1e-2 for _ in range(members)]
    rows = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    plain = {d: _plain_sum_ms(vectors, d, repeats) for d in devices}
    for d in devices:
        rows.append(BenchRow("plain-sum", d, dim, members, plain[d], 0.0, 0.0, 0, 1.0))
    base = base or SecAggConfig()
    for name in names:
        say(f"benchmarking {name} (dim={dim}, members={members}, repeats={repeats})")
        cfg = SecAggConfig(
            backend=name,
            min_members=min(base.min_members, members),
            ring_bits=base.ring_bits,
            frac_bits=base.frac_bits,
            clip=base.clip,
            prg=base.prg,
        )
        sa = make_aggregator(cfg)
        sa.open_round(0, range(members))
        t0 = time.perf_counter()
        for j, v in enumerate(vectors):
            sa.submit(j, v)
        upload_ms = 1000 * (time.perf_counter() - t0) / members
        for _ in range(repeats):
            sa.subset_sum_flat(range(members))
        sa.close_round()
        log = sa.log[-repeats:]
        ms = 1000 * statistics.median(r.seconds for r in log)
        client_ms = 1000 * statistics.median(r.client_seconds_max for r in log)
        rows.append(
            BenchRow(
                name,
                "cpu",
                dim,
                members,
                ms,
                client_ms,
                upload_ms,
                log[-1].bytes_moved,
                ms / plain["cpu"],
            )
        )
    return rows


def format_rows(rows: Sequence[BenchRow]) -> str:
    """Markdown table of benchmark rows."""
    head = ["backend", "device", "dim", "members", "ms/query", "slowest client ms",
            "upload ms/client", "MB moved/query", "× plain sum"]  # fmt: skip
    return table(head, (
        [r.backend, r.device, f"{r.dim:,}", r.members, f"{r.ms_per_query:.1f}",
         f"{r.client_ms_max:.1f}", f"{r.upload_ms:.1f}", f"{r.bytes_per_query / 1e6:.1f}",
         f"{r.ratio_to_plain_sum:.1f}"]
        for r in rows
    ))  # fmt: skip
