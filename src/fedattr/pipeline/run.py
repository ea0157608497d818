"""``fedattr run`` and ``fedattr demo-protocol``: assemble a federation, hand it to the round
engine, and turn what the observers saw into results.

Data flows one way: config -> data and model -> client pool -> round engine (every update only
through SA) -> FedAttr observers (SA queries, then scores) -> results and run folder. No round
is run here: :class:`~fedattr.fl.server.RoundEngine` runs them.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..attribution.config import AttributionConfig
from ..attribution.contract import KeyStatisticScorer, Parties, ProbeScorer
from ..attribution.crossround import CrossRoundObserver
from ..attribution.export import ExportObserver
from ..attribution.observer import AttributionObserver, CeilingObserver
from ..attribution.protocol import FedAttr
from ..attribution.scoring import LinearScorer, scorer_null
from ..attribution.sealed import SealedObserver
from ..attribution.stouffer import AttributionReport
from ..baselines import BaselineRecorder, BaselineResult
from ..baselines.observer import BaselineObserver
from ..config import flat_keys, to_dict
from ..errors import UserError, require_extra
from ..fl.clients import resolve_profiles
from ..fl.fedavg import FedAvgServer
from ..fl.federation import build_federation
from ..fl.inprocess import InProcessPool
from ..fl.pool import ClientPool
from ..fl.progress import Progress
from ..fl.registry import make_strategy
from ..fl.server import Checkpointer, Observer, RoundEngine, Stopwatch
from ..fl.synthetic import SyntheticPool
from ..fl.timing import overhead
from ..models.loading import load_model, resolve_device, weights_digest
from ..models.lora import attach_lora, candidate_stacker, load_state
from ..models.text import encode_examples
from ..reporting.markdown import run_report
from ..reporting.run_folder import RunFolder
from ..runtime import cpu_name, take_note
from ..secagg import SecureAggregator, make_aggregator
from ..watermarks.registry import WATERMARKS, DetectionSetup, Detector
from .config import DemoConfig, RunConfig, require_in_process

Say = Callable[[str], None]


@dataclass
class RunResult:
    """Everything a run produced (``fedattr run`` or ``demo-protocol``)."""

    config: RunConfig | DemoConfig
    report: AttributionReport
    rounds: list[dict]
    sa_queries: int
    timing: dict[str, Any]
    queries: list[dict] = field(default_factory=list)
    null: str = "theoretical"
    """The null the differential scores were read under (``attribution.paper.null`` resolved)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Keys of ``results.json`` particular to the command (federation, strategy, ...)."""
    baselines: list[BaselineResult] = field(default_factory=list)
    variants: dict[str, dict] = field(default_factory=dict)
    """Extra FedAttr configurations on the same run: name -> what differs, flags, rates."""
    changes: dict[str, Any] = field(default_factory=dict)
    """Calibrated statistic: each client's summed standardised change, ``"<client>/<part>"``
    -> tensor (``changes.safetensors``; the key laws are in ``results.json``)."""
    key_laws: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready form (``results.json``)."""
        out = self.report.to_dict()
        out.update(
            mode=self.config.attribution.protocol.mode,
            null=self.null,
            sa_queries=self.sa_queries,
            sa_backend=self.config.secagg.backend,
            timing=self.timing,
            **self.details,
            baselines=[b.to_dict() for b in self.baselines],
            variants=self.variants,
        )
        if self.key_laws:
            out["key_laws"] = self.key_laws
        owner_of = self.details.get("federation", {}).get("watermarked")
        if owner_of is not None and self.report.components:
            out["wrong_pairs"] = wrong_pairs(self.report, owner_of)
        return out

    def markdown(self) -> str:
        """``report.md``: what ran, the attribution table, stages, variants, baselines."""
        c = self.config
        if isinstance(c, RunConfig):
            title = (
                f"# FedAttr run: {c.fl.strategy}, {c.watermark.kind.upper()} "
                f"({c.watermark.detector} detector), {c.model.preset} "
                f"({c.attribution.protocol.mode} mode, {c.attribution.statistic} statistic)"
            )
            K, T = c.fl.K, c.fl.rounds
        else:
            title = (
                f"# FedAttr synthetic protocol run ({c.attribution.protocol.mode} mode, "
                f"{c.attribution.statistic} statistic)"
            )
            K, T = c.synthetic.K, c.synthetic.rounds
        a = c.attribution.protocol
        summary = [
            f"K={K}, T={T}, N={a.N}, M={a.M}, {self.null} null, SA backend "
            f"`{c.secagg.backend}` ({self.sa_queries} SA queries)."
        ]
        return run_report(
            title,
            summary,
            self.report,
            timing=self.timing,
            memory=self.details.get("memory_gb"),
            variants=self.variants,
            baselines=[b.to_dict() for b in self.baselines],
        )

    def write(self, folder: RunFolder | str | Path) -> RunFolder:
        """The run folder's result files. A path is claimed first (a new folder: its
        ``config.json`` is written; anything else is refused); a :class:`RunFolder` is taken
        as claimed when the run started."""
        if not isinstance(folder, RunFolder):
            folder = RunFolder(folder)
            folder.claim(to_dict(self.config))
        if self.changes:  # before results.json, which marks the run finished
            from ..rows import save_changes

            # A block of rows at a time where a change is spilled to disk.
            save_changes(folder.file("changes.safetensors"), self.changes)
        folder.write_results(
            rounds=self.rounds,
            queries=self.queries,
            results=self.to_dict(),
            report_md=self.markdown(),
            report=self.report,
        )
        return folder


def wrong_pairs(report: AttributionReport, owner_of: Mapping[str, str]) -> list[list]:
    """``[client, owner]`` of every pair ``report`` names although the client did not train on
    that owner's documents (``owner_of``: client -> the owner whose documents it trained on):
    a clean client named, or a watermarked client named for another owner. A simulation's
    measurement (it reads the ground truth); the family-wise level bounds how often a run has
    any."""
    return [
        [row.id, owner]
        for owner, part in sorted(report.components.items())
        for row in part.clients
        if row.flagged and owner_of.get(str(row.id)) != owner
    ]


def _observers(
    variants: Mapping[str, AttributionConfig],
    scorer: Any,
    marked: Collection[int],
    background: Executor | None = None,
) -> list[AttributionObserver]:
    return [
        AttributionObserver(
            FedAttr(cfg),
            scorer,
            name,
            primary=(k == 0),
            marked=marked,
            background=background if cfg.overlap else None,
        )
        for k, (name, cfg) in enumerate(variants.items())
    ]


def _finish(
    cfg: RunConfig | DemoConfig,
    engine: RoundEngine,
    observers: list[AttributionObserver],
    truth: Mapping[int, bool],
    details: dict,
    baselines: list[BaselineResult] = (),
    say: Say | None = None,
) -> RunResult:
    """Results of the primary observer, with the other observers as variants."""
    # The verdicts read every client's summed change once more (exact tails, the rank
    # check): on a vocabulary-sized change that is a stage of its own, so it says so.
    announce = say if observers[0].fedattr.config.statistic == "calibrated" else None
    if announce is not None:
        announce("final verdicts: each client's summed change read with every owner's key")
    start = time.perf_counter()
    losses = {h.round: h.losses for h in engine.history}
    primary, *others = observers
    rounds = [
        {
            **r,
            **(
                {"train_loss": {str(c): v for c, v in losses[r["round"]].items()}}
                if losses.get(r["round"])
                else {}
            ),
        }
        for r in primary.records
    ]

    def queries_of(name: str) -> int:
        return sum(1 for q in engine.queries if q.get("session", "") in ("", name))

    base = flat_keys(to_dict(primary.fedattr.config))
    variants = {}
    for o in others:
        with engine.timing.watch("verdict_s"):
            rep = o.fedattr.report(truth)
        variants[o.name] = {
            "differs": {
                k: v for k, v in flat_keys(to_dict(o.fedattr.config)).items() if base[k] != v
            },
            "null": o.fedattr.null,
            "tpr": rep.tpr,
            "fpr": rep.fpr,
            "flagged": rep.flagged,
            "statistic": rep.statistic,
            # The ceiling reads true updates: no SA query of its own (not even the aggregates).
            "sa_queries": 0 if isinstance(o, CeilingObserver) else queries_of(o.name),
            "timing": o.timing,
            "clients": [c.to_dict() for c in rep.clients],
            "by_statistic": rep.to_dict()["by_statistic"],
        }
    # The primary's verdict is FedAttr's last stage of work, part of its overhead.
    with engine.timing.measure("verdict_s"):
        changes, laws = primary.fedattr.statistic.changes()
        report = primary.fedattr.report(truth)
    if announce is not None:
        announce(f"final verdicts: {time.perf_counter() - start:.1f} s")
    if isinstance(primary, SealedObserver):
        details = {**details, "sealed": primary.summary()}
    timing: dict[str, Any] = dict(engine.timing.seconds)
    timing["total_s"] = engine.timing.elapsed()
    timing["overhead"] = overhead(timing)
    # Each stage's seconds and peak memory together; on a GPU its memory and how busy it was.
    timing["stages"] = engine.timing.profile()
    engine.timing.close()
    details = {
        **details,
        "work": dict(engine.timing.counts),
        "memory_gb": {k.removesuffix("_s"): v for k, v in engine.timing.peaks.items()},
    }
    return RunResult(
        dataclasses.replace(cfg),
        report,
        rounds,
        queries_of(primary.name),
        timing,
        engine.queries,
        primary.fedattr.null,
        details,
        list(baselines),
        variants,
        changes,
        laws,
    )


def _checkpointing(folder: RunFolder | None, engine_observers: list[Observer]) -> None:
    if folder is not None:
        engine_observers.append(Checkpointer(folder.save_checkpoint))


def check_devices(cfg: RunConfig | DemoConfig) -> None:
    """The devices a run on this machine asks for (``secagg.device``, ``model.device``),
    checked against its hardware when the run starts, not when its settings load: a
    ``config.json`` written on a GPU machine loads anywhere. One :class:`UserError` naming the
    setting, before any folder is written."""
    from ..models.loading import resolve_device

    cfg.secagg.torch_device()
    if isinstance(cfg, RunConfig):
        resolve_device(cfg.model.device)


def check_inputs(cfg: RunConfig) -> None:
    """What a run reads besides its settings, checked before any folder is written or model
    loaded, so a bad file costs nothing: the devices it asks for (:func:`check_devices`), a
    local data file (its rows, and enough records for ``fl.K`` clients), the owners' key files
    and watermarked corpus, a local model path. A Hugging Face dataset id is left to the run
    (it may need the network)."""
    from ..data.loaders import load_records
    from ..fl.federation import check_client_records
    from ..models.loading import check_model_source
    from ..watermarks.keys import load_key

    check_devices(cfg)
    if cfg.baselines:  # FLDetector's k-means and FLForensics' HDBSCAN
        require_extra("sklearn", "baselines", "baselines=true (FLDetector, FLForensics)")
    d, wm = cfg.data, cfg.watermark
    if d.path and (Path(d.path).suffix in (".json", ".jsonl") or Path(d.path).exists()):
        check_client_records(d, wm, len(load_records(d.path, d.split)), cfg.fl.K)
    if wm.kind == "kgw":
        for path in wm.kgw.key_files:
            load_key(path, "kgw", "watermark.kgw.key_files")
        if wm.kgw.documents:
            load_records(wm.kgw.documents, option="watermark.kgw.documents")
    if cfg.model.preset == "hf":
        check_model_source(cfg.model.name_or_path)


def detection_scorer(
    cfg: RunConfig,
    model: Any,
    tokenizer: Any,
    fed: Any,
    detector: Detector,
    probes: str | None = None,
) -> Any:
    """The configured watermark's scorer reading ``model`` (with LoRA attached) on the
    federation's detection data and owners' documents (``probes`` overrides
    ``watermark.kgw.probes``)."""
    wm = cfg.watermark
    setup = DetectionSetup(
        config=wm
        if probes is None
        else dataclasses.replace(wm, kgw=dataclasses.replace(wm.kgw, probes=probes)),
        model=model,
        tokenizer=tokenizer,
        owners=fed.owners,
        detect_records=fed.detect_records,
        detect_prompts=fed.detect_prompts,
        load_state=load_state,
        max_len=cfg.data.max_len,
        stack=candidate_stacker(model),
        owner_documents=fed.owner_docs,
    )
    return WATERMARKS[wm.kind].scorer(setup, detector)


def public_reader(cfg: RunConfig, documents: dict[str, Any], say: Say | None = None) -> Any:
    """The run's reading detector as a party that holds no client data builds it: the model
    (LoRA attached), the owners' documents (from ``documents``, a store as the run folder
    keeps it; written by the teacher where it holds none, and added to it) and the detector
    over them. The sealed mode's servers read shares with it; its owners take their keys from
    it (a simulation: every party derives the documents from the configuration)."""
    progress = Progress(say)
    model, tokenizer = load_model(cfg.model, progress)
    fed = build_federation(
        cfg.data, cfg.watermark, cfg.fl.K, cfg.fl.seed, model, tokenizer, progress, documents
    )
    model = attach_lora(model, cfg.lora, seed=cfg.fl.seed)
    return detection_scorer(cfg, model, tokenizer, fed, cfg.watermark.detector)


def run_experiment(
    cfg: RunConfig,
    progress: Say | None = None,
    folder: RunFolder | None = None,
    pool: ClientPool | None = None,
    sa: SecureAggregator | None = None,
    parties: Parties | None = None,
) -> RunResult:
    """Run one configured LLM federation end to end.

    With ``folder``, the engine checkpoints after every round and a run with a checkpoint there
    resumes after its round. Everything else (data, teacher documents, training and design
    randomness) is a deterministic function of the configuration and the round, so a resumed
    run ends with the same results as an uninterrupted one.

    ``pool`` and ``sa`` replace the in-process clients and the configured SA backend (a remote
    runtime's clients and their aggregator, e.g. :mod:`fedattr.flower`); the server side here
    still builds the federation for its ground truth, the owners' keys and detection data.
    ``parties`` are the sealed mode's parties on that runtime (its servers and owners: see
    :mod:`fedattr.attribution.sealed.parties`); without them a remote runtime refuses the mode.
    """
    if pool is not None and parties is None:
        require_in_process(cfg)
    say = Progress(progress)
    note = take_note()
    if note:
        say(note)
    timing = Stopwatch(
        ("load_s", "teacher_s", "train_s", "sa_s", "scoring_s"),
        device=resolve_device(cfg.model.device),
    )
    saved = folder.load_checkpoint() if folder is not None else None
    with timing.measure("load_s"):
        model, tokenizer = load_model(cfg.model, say)
        weights = weights_digest(model)  # before training: FLoRA merges into these weights
    # The teacher's documents of an earlier session of this run: restored, not written again.
    documents = folder.load_documents() if folder is not None else {}
    restored = bool(documents)
    with timing.measure("teacher_s"):
        fed = build_federation(
            cfg.data, cfg.watermark, cfg.fl.K, cfg.fl.seed, model, tokenizer, say, documents
        )
    if folder is not None and not restored:
        folder.save_documents(documents)
    if saved is None and not restored:
        # Counted once: a checkpoint carries the first session's count (and time).
        timing.count("teacher_documents", sum(fed.wm_docs.values()))
    profiles = resolve_profiles(cfg.fl.clients, cfg.fl.K, sorted(fed.owner_of), cfg.fl.seed)
    model = attach_lora(model, cfg.lora, seed=cfg.fl.seed)
    server, client = make_strategy(cfg.fl, cfg.lora)
    state = server.initial_state(model)
    if pool is None:
        examples = [encode_examples(tokenizer, s, cfg.data.max_len) for s in fed.shards]
        pool = InProcessPool.from_config(
            model, examples, client, cfg.fl, tokenizer.pad_token_id, profiles
        )
    wm = cfg.watermark

    background: ThreadPoolExecutor | None = None

    def scorer_for(detector: Detector, reader: Any = model, probes: str | None = None) -> Any:
        return detection_scorer(cfg, reader, tokenizer, fed, detector, probes)

    if cfg.attribution.scoring == "owner":
        # The server holds no owner key: it exports each round for the owners to score.
        if folder is None:
            raise UserError("attribution.scoring=owner: the round exports need a run folder")
        observers: list[Observer] = [
            ExportObserver(FedAttr(cfg.attribution), folder.path, to_dict(cfg))
        ]
        attribution = list(observers)
    else:
        variants = cfg.attribution_variants()
        if any(a.overlap for a in variants.values()):
            # Scoring runs beside the next round's training: it reads its own copy of the
            # model, one round at a time (one worker shared by every variant).
            background = ThreadPoolExecutor(1, thread_name_prefix="fedattr-scoring")
            scoring_model = copy.deepcopy(model)
            scorer = scorer_for(wm.detector, scoring_model)
        else:
            scorer = scorer_for(wm.detector)
        observers = list(_observers(variants, scorer, fed.owner_of, background))
        for k, (name, a) in enumerate(variants.items()):
            if a.protocol.mode == "sealed":
                dtype = next(model.parameters()).dtype
                if dtype != torch.float32:
                    # Shares far larger than the update, rounded to a 16-bit type, would
                    # bury the update's reading in rounding noise.
                    raise UserError(
                        "attribution.protocol.mode=sealed: reads shares in float32; set "
                        f"model.dtype=float32 (the model computes in {dtype})"
                    )
                # No SA query: each update read as shares by two servers (a simulation's
                # clients split what the pool holds, as they would before sending).
                observers[k] = SealedObserver(
                    a,
                    scorer,
                    pool.open_tap() if parties is None else None,
                    pool.scales,
                    cfg.secagg.min_members,
                    name,
                    primary=(k == 0),
                    marked=fed.owner_of,
                    folder=None if folder is None else folder.path,
                    parties=parties,
                )
        if cfg.ceiling:
            # Reads the plaintext updates (as the baselines do): a simulation's measurement.
            ceiling = CeilingObserver(
                FedAttr(cfg.attribution), scorer, pool.open_tap(), pool.scales, marked=[]
            )
            observers.append(ceiling)
        attribution = list(observers)
    if cfg.baselines:
        with timing.measure("baselines_s"):
            # FLForensics reads probes and the statistic under references (random keys,
            # decoys): the held-out reading offers both; a greedy or documents reader does not.
            complete = isinstance(scorer, ProbeScorer) and isinstance(scorer, KeyStatisticScorer)
            probe = scorer if complete else scorer_for("reading", probes="held-out")
            # Direct reads its per-round z as the paper's statistic does: FedAttr's null when
            # that is one, else (calibrated FedAttr) the scorer's own (empirical for FK).
            fedattr_null = attribution[0].fedattr.null
            direct_null = (
                fedattr_null
                if fedattr_null in ("empirical", "theoretical")
                else scorer_null(scorer)
            )
            recorder = BaselineRecorder(
                scorer,
                probe,
                server.apply_estimate,
                server.scoring_params(state),
                gamma=cfg.attribution.paper.threshold,
                seed=cfg.fl.seed,
                null=direct_null,
                fldetector=cfg.fldetector,
                flforensics=cfg.flforensics,
            )
        baseline_observer = BaselineObserver(recorder, pool.open_tap())
        observers.append(baseline_observer)
    _checkpointing(folder, observers)
    engine = RoundEngine(
        pool,
        server,
        sa or make_aggregator(cfg.secagg),
        observers,
        rounds=cfg.fl.rounds,
        per_round=cfg.fl.per_round,
        seed=cfg.fl.seed,
        timing=timing,
        progress=say,
    )
    if saved is not None:
        engine.restore(saved)
    try:
        engine.run(state)
    finally:
        if background is not None:
            background.shutdown(cancel_futures=True)
    truth = fed.truth(cfg.fl.K)
    details = {
        "scoring": cfg.attribution.scoring,
        "federation": {
            **fed.summary(),
            "client_sizes": pool.data_sizes(),
            "profiles": profiles.summary(),
        },
        "strategy": cfg.fl.strategy,
        # Whether a round's clients were trained together (fl.batched, where it pays) or one
        # after another (fl.batched=false, a remote runtime's clients).
        "training": {"batched": bool(getattr(pool, "batched", False))},
        "watermark": cfg.watermark.kind,
        "detector": cfg.watermark.detector,
        "model": {
            "parameters": sum(p.numel() for p in model.parameters()),
            "device": str(next(model.parameters()).device),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            # what model.dtype resolved to (auto: bfloat16 only on a GPU computing in it)
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            # What a seed's run depends on beyond its configuration: the same code gives other
            # floats on another CPU, and the tiny preset is pre-trained where it first runs.
            "weights": weights,
            "cpu": cpu_name(),
            "torch": torch.__version__,
        },
    }
    baselines = recorder.results(truth) if cfg.baselines else []
    return _finish(cfg, engine, attribution, truth, details, baselines, say)


def run_demo(
    config: DemoConfig | None = None,
    progress: Say | None = None,
    folder: RunFolder | None = None,
    pool: ClientPool | None = None,
    sa: SecureAggregator | None = None,
) -> RunResult:
    """The synthetic federation through SA and FedAttr (no language model); ``pool`` and
    ``sa`` as in :func:`run_experiment`."""
    cfg = config or DemoConfig()
    if any(a.protocol.mode == "sealed" for a in cfg.attribution_variants().values()):
        raise UserError(
            "attribution.protocol.mode=sealed: runs a language model's detector read to first "
            "order; the synthetic demo has none (allowed here: paper, hardened)"
        )
    syn = cfg.synthetic
    synthetic = SyntheticPool(syn)
    observers = _observers(
        cfg.attribution_variants(), LinearScorer(synthetic.direction), synthetic.watermarked
    )
    watchers: list[Observer] = list(observers)
    cross_round = None
    if pool is None:
        # The server's cross-round attack on its answers; the in-process bed knows the true
        # updates (what each client submitted), which only measure the attack's error.
        def submitted(t: int, clients: Collection[int]) -> dict[int, Any]:
            updates, scales = synthetic.updates(t), synthetic.scales(list(clients))
            return {j: synthetic.scaled(updates[j], scales[j]).double().numpy() for j in clients}

        cross_round = CrossRoundObserver(syn.K, submitted)
        watchers.append(cross_round)
    engine = RoundEngine(
        pool or synthetic,
        FedAvgServer(),
        sa or make_aggregator(cfg.secagg),
        watchers,
        rounds=syn.rounds,
        seed=syn.seed,
        progress=Progress(progress),
    )
    engine.run(synthetic.initial_params())
    truth = {j: j in synthetic.watermarked for j in range(syn.K)}
    details: dict[str, Any] = {"config": to_dict(cfg)}
    if cross_round is not None:
        details["cross_round"] = cross_round.attack.results()
    return _finish(cfg, engine, observers, truth, details)
