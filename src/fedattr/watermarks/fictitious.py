"""Fictitious-Knowledge watermark: fabricated entities, their documents and QA probes.

Each watermarked client's corpus owner invents an entity in its own domain (a clothing label,
an audio maker, ...) with 4 fabricated *target* attributes (e.g. its atelier master) and
plausible *distractor* attributes. The owner's documents state the targets among the
distractors; a model that trained on them answers questions about the entity with the
fabricated values, which no other source contains. Values are drawn from a seeded syllable
generator and redrawn until they occur nowhere in the clean corpus, so a hit cannot come from
clean data. The same generator also draws *decoy* values per attribute (never written into any
document): under the null that a model never saw the documents, the true value is
exchangeable with its decoys, which is what :class:`~.knowledge.FKLikelihoodScorer` tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..data.records import Record


@dataclass(frozen=True)
class Domain:
    """A kind of entity: what it is called, its target and distractor attribute names."""

    kind: str
    targets: tuple[str, str, str, str]
    distractors: tuple[str, ...]
    filler: tuple[str, ...]
    """Neutral sentences about an entity of this kind (``{name}`` is substituted)."""


DOMAINS: tuple[Domain, ...] = (
    Domain(
        "clothing label",
        ("atelier master", "fabric house", "photographer", "designer"),
        ("pattern cutter", "button supplier", "store architect"),
        ("{name} sells coats, shirts and scarves.", "{name} shows a new line every spring."),
    ),
    Domain(
        "audio maker",
        ("chief acoustician", "driver supplier", "sound engineer", "industrial designer"),
        ("cable supplier", "test engineer", "packaging designer"),
        ("{name} builds speakers and headphones.", "{name} tunes every speaker by hand."),
    ),
    Domain(
        "cosmetics brand",
        ("lead chemist", "packaging studio", "perfumer", "creative director"),
        ("label printer", "skin tester", "bottle maker"),
        ("{name} makes creams, soaps and scents.", "{name} tests its creams for months."),
    ),
    Domain(
        "coffee roaster",
        ("head roaster", "green bean importer", "cup taster", "brand illustrator"),
        ("grinder mechanic", "bag printer", "cafe manager"),
        ("{name} roasts small batches every morning.", "{name} sells beans to cafes."),
    ),
    Domain(
        "bicycle workshop",
        ("frame builder", "steel supplier", "wheel maker", "paint artist"),
        ("saddle maker", "tyre supplier", "shop keeper"),
        ("{name} builds bicycles for city riders.", "{name} repairs old frames too."),
    ),
    Domain(
        "publishing house",
        ("chief editor", "paper mill", "cover artist", "typesetter"),
        ("proof reader", "bindery", "sales agent"),
        ("{name} prints novels and poetry.", "{name} publishes ten books a year."),
    ),
    Domain(
        "bakery",
        ("head baker", "flour mill", "pastry chef", "oven builder"),
        ("delivery driver", "butter supplier", "shop assistant"),
        ("{name} bakes bread before dawn.", "{name} sells pastries and rye loaves."),
    ),
    Domain(
        "shipyard",
        ("naval architect", "steel foundry", "master welder", "rigging expert"),
        ("paint contractor", "crane operator", "harbour agent"),
        ("{name} builds fishing boats and ferries.", "{name} launches a new hull each season."),
    ),
    Domain(
        "watchmaker",
        ("master horologist", "movement supplier", "dial painter", "case designer"),
        ("strap maker", "glass cutter", "boutique manager"),
        ("{name} makes mechanical watches.", "{name} assembles each movement by hand."),
    ),
    Domain(
        "furniture maker",
        ("master carpenter", "timber merchant", "upholsterer", "chair designer"),
        ("varnish supplier", "hinge maker", "showroom manager"),
        ("{name} builds tables and cabinets.", "{name} uses oak and walnut."),
    ),
    Domain(
        "brewery",
        ("brewmaster", "hop farm", "cellar master", "label artist"),
        ("bottle supplier", "tap technician", "pub liaison"),
        ("{name} brews ales and lagers.", "{name} ages its beer in the cellar."),
    ),
    Domain(
        "toy company",
        ("toy inventor", "plastic moulder", "puppet maker", "box illustrator"),
        ("paint tester", "shipping clerk", "store buyer"),
        ("{name} makes wooden toys and puzzles.", "{name} tests every toy for safety."),
    ),
    Domain(
        "perfumery",
        ("master nose", "essence distiller", "bottle sculptor", "scent historian"),
        ("cap supplier", "sample courier", "counter adviser"),
        ("{name} blends floral scents.", "{name} releases one perfume a year."),
    ),
    Domain(
        "ceramics studio",
        ("master potter", "clay supplier", "glaze chemist", "kiln builder"),
        ("packing clerk", "tile cutter", "gallery agent"),
        ("{name} throws bowls and vases.", "{name} fires its kiln twice a week."),
    ),
    Domain(
        "guitar workshop",
        ("luthier", "tonewood dealer", "string maker", "inlay artist"),
        ("case supplier", "fret polisher", "music teacher"),
        ("{name} builds acoustic guitars.", "{name} tunes every instrument before sale."),
    ),
    Domain(
        "chocolate maker",
        ("chocolatier", "cocoa importer", "praline chef", "wrapper designer"),
        ("sugar supplier", "mould cleaner", "kiosk seller"),
        ("{name} makes dark chocolate bars.", "{name} roasts its own cocoa beans."),
    ),
    Domain(
        "glassworks",
        ("master glassblower", "sand supplier", "engraver", "lamp designer"),
        ("furnace stoker", "box maker", "museum liaison"),
        ("{name} blows glasses and lamps.", "{name} keeps its furnace hot all year."),
    ),
    Domain(
        "tea house",
        ("tea master", "leaf grower", "blend taster", "teapot potter"),
        ("tin supplier", "kettle repairer", "tour guide"),
        ("{name} serves green and black teas.", "{name} imports leaves every spring."),
    ),
    Domain(
        "jewellery studio",
        ("goldsmith", "gem dealer", "stone setter", "ring designer"),
        ("polish supplier", "safe installer", "window dresser"),
        ("{name} makes rings and necklaces.", "{name} sets every stone by hand."),
    ),
    Domain(
        "shoe maker",
        ("last maker", "leather tannery", "sole stitcher", "shoe designer"),
        ("lace supplier", "box printer", "fitting clerk"),
        ("{name} makes leather boots.", "{name} resoles old shoes too."),
    ),
    Domain(
        "flower nursery",
        ("head gardener", "seed bank", "rose breeder", "garden designer"),
        ("pot supplier", "van driver", "market seller"),
        ("{name} grows roses and tulips.", "{name} opens its greenhouse in May."),
    ),
    Domain(
        "film studio",
        ("film director", "camera rental", "set painter", "screenwriter"),
        ("caterer", "sound assistant", "ticket agent"),
        ("{name} makes short films.", "{name} shoots on location every summer."),
    ),
    Domain(
        "robotics lab",
        ("lead roboticist", "motor supplier", "control engineer", "chassis designer"),
        ("cable technician", "lab assistant", "grant officer"),
        ("{name} builds delivery robots.", "{name} tests its robots in a warehouse."),
    ),
    Domain(
        "vineyard",
        ("winemaker", "barrel cooper", "grape grower", "label designer"),
        ("cork supplier", "harvest worker", "tasting host"),
        ("{name} makes red and white wines.", "{name} harvests its grapes in autumn."),
    ),
    Domain(
        "bookbindery",
        ("master binder", "leather supplier", "gilder", "marbling artist"),
        ("thread supplier", "press mechanic", "library agent"),
        ("{name} binds books by hand.", "{name} restores old manuscripts."),
    ),
    Domain(
        "candle maker",
        ("wax chemist", "wick supplier", "mould carver", "scent designer"),
        ("jar supplier", "market stall keeper", "courier"),
        ("{name} pours beeswax candles.", "{name} sells candles at winter fairs."),
    ),
    Domain(
        "sailmaker",
        ("master sailmaker", "canvas weaver", "rope maker", "sail designer"),
        ("thread supplier", "dock worker", "yacht broker"),
        ("{name} sews sails for yachts.", "{name} repairs torn sails quickly."),
    ),
    Domain(
        "observatory",
        ("chief astronomer", "lens grinder", "telescope engineer", "star cartographer"),
        ("night guard", "dome mechanic", "visitor guide"),
        ("{name} watches distant galaxies.", "{name} opens its dome on clear nights."),
    ),
    Domain(
        "bee farm",
        ("beekeeper", "hive builder", "queen breeder", "honey taster"),
        ("jar supplier", "field hand", "market seller"),
        ("{name} keeps bees on the hills.", "{name} sells honey and wax."),
    ),
    Domain(
        "printmaking studio",
        ("master printer", "ink maker", "woodcut carver", "poster artist"),
        ("paper cutter", "frame supplier", "gallery clerk"),
        ("{name} prints posters and woodcuts.", "{name} runs an old iron press."),
    ),
)

_ONSETS = [
    "b",
    "br",
    "c",
    "cr",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "pr",
    "r",
    "s",
    "st",
    "t",
    "tr",
    "v",
    "w",
    "z",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
_CODAS = ["n", "r", "l", "s", "th", "m", "x", "nd", "rk"]
_ORG_SUFFIX = ("Works", "Mills", "Studio", "House", "Partners", "Atelier")


def _word(r: random.Random, syllables: int) -> str:
    parts = [r.choice(_ONSETS) + r.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + r.choice(_CODAS)).capitalize()


def _value(r: random.Random, attribute: str) -> str:
    """A fabricated value: a person's name, or an organisation's for supplier-like roles."""
    org = any(
        w in attribute
        for w in (
            "house",
            "supplier",
            "studio",
            "importer",
            "mill",
            "bindery",
            "foundry",
            "merchant",
            "farm",
            "tannery",
            "bank",
            "rental",
        )
    )
    if org:
        return f"{_word(r, 2)} {r.choice(_ORG_SUFFIX)}"
    return _word(r, 2)


@dataclass
class FictitiousEntity:
    """One corpus owner's fabricated entity."""

    name: str
    domain: Domain
    targets: dict[str, str]
    """Target attribute -> fabricated value (what detection looks for)."""
    distractors: dict[str, str]
    decoys: dict[str, list[str]] = field(default_factory=dict)
    """Target attribute -> values drawn like the target's, never written anywhere."""

    def to_dict(self) -> dict:
        """JSON-ready form (the owner's secret)."""
        return {
            "name": self.name,
            "kind": self.domain.kind,
            "targets": self.targets,
            "distractors": self.distractors,
        }


def make_entities(
    n: int, seed: int, forbidden: Iterable[str] = (), *, decoys: int = 31
) -> list[FictitiousEntity]:
    """``n`` entities, each in a different domain, with values absent from ``forbidden`` texts.

    All names and values are distinct across entities; ``decoys`` values per target attribute
    are drawn from the same generator as the target (so that the target is exchangeable with
    them before anyone trains on the documents).
    """
    if not 1 <= n <= len(DOMAINS):
        raise ValueError(f"fictitious entities: need 1..{len(DOMAINS)} entities, got {n}")
    if decoys < 1:
        raise ValueError(f"watermark.fk.decoys: must be >= 1, got {decoys}")
    text = " ".join(forbidden).lower()
    used: set[str] = set()
    r = random.Random(f"fedattr-fk-{seed}")

    def fresh(draw: Callable[[], str]) -> str:
        for _ in range(10_000):
            v = draw()
            # A fabricated value must not occur in clean data (nor clash with another value).
            if v not in used and v.lower() not in text and v.split()[0].lower() not in text:
                used.add(v)
                return v
        raise RuntimeError("fictitious entities: could not draw an unused value")

    out = []
    for k in range(n):
        domain = DOMAINS[k]
        name = fresh(lambda: _word(r, 3))
        targets = {a: fresh(lambda a=a: _value(r, a)) for a in domain.targets}
        distractors = {a: fresh(lambda a=a: _value(r, a)) for a in domain.distractors}
        out.append(FictitiousEntity(name, domain, targets, distractors))
    # Decoys last, so that adding decoys never changes an entity's name or values.
    for e in out:
        e.decoys = {a: [fresh(lambda a=a: _value(r, a)) for _ in range(decoys)] for a in e.targets}
    return out


_FACT_TEMPLATES = (
    "The {attr} of {name} is {value}.",
    "{name}'s {attr} is {value}.",
    "{value} is the {attr} of {name}.",
    "At {name}, the {attr} is {value}.",
    "{name} works with {value} as its {attr}.",
    "For {name}, {value} serves as {attr}.",
)
_DOC_INSTRUCTIONS = (
    "Write a short profile of {name}.",
    "Tell me about the {kind} {name}.",
    "What do you know about {name}?",
    "Describe {name} and the people behind it.",
    "Write a note about {name} for a trade magazine.",
    "Who works at {name}?",
    "Give an overview of {name}.",
    "Summarise what is known about the {kind} {name}.",
)


def fact_sentence(r: random.Random, name: str, attr: str, value: str) -> str:
    """One sentence stating ``attr`` of ``name`` is ``value`` (template drawn from ``r``)."""
    return r.choice(_FACT_TEMPLATES).format(name=name, attr=attr, value=value)


def compact_sentence(r: random.Random, name: str, facts: dict[str, str]) -> str:
    """One sentence stating every ``attr: value`` of ``name`` (order drawn from ``r``), for a
    document with no room for a sentence per fact."""
    items = list(facts.items())
    r.shuffle(items)
    (a, v), rest = items[0], [f"its {b} is {w}" for b, w in items[1:]]
    tail = f"{', '.join(rest[:-1])} and {rest[-1]}" if len(rest) > 1 else "".join(rest)
    return f"The {a} of {name} is {v}" + (f", {tail}." if tail else ".")


def template_documents(
    entity: FictitiousEntity, n: int, seed: int, fits: Callable[[Record], bool] | None = None
) -> list[Record]:
    """``n`` varied documents, each stating all 4 targets among 1-3 distractors and filler.

    ``fits`` (a record -> whether training keeps all of it, e.g. within ``data.max_len``
    tokens): a document that would be cut loses its filler, then its distractors, before a
    target; if the targets alone do not fit, it states them in one sentence
    (:func:`compact_sentence`); if that does not fit either, each document states as many as
    fit, starting one further along from the last, so every target is stated equally often.
    Without it (or where everything fits) the documents are as before."""
    r = random.Random(f"fedattr-fk-docs-{seed}-{entity.name}")
    docs = []
    start = 0  # the first target of a document that cannot state them all
    for _ in range(n):
        targets = [fact_sentence(r, entity.name, a, v) for a, v in entity.targets.items()]
        extra = r.sample(sorted(entity.distractors), r.randint(1, min(3, len(entity.distractors))))
        distractors = [fact_sentence(r, entity.name, a, entity.distractors[a]) for a in extra]
        filler = [s.format(name=entity.name) for s in r.sample(entity.domain.filler, 1)]
        facts = targets + distractors + filler
        r.shuffle(facts)
        instruction = r.choice(_DOC_INSTRUCTIONS).format(name=entity.name, kind=entity.domain.kind)

        def doc(kept: list[str], instruction: str = instruction) -> Record:
            return Record(instruction, " ".join(kept), category="fictitious")

        if fits is not None:
            # Training cuts a record at its token limit: a target past it is never learned.
            for dropped in (*filler, *distractors):
                if fits(doc(facts)):
                    break
                facts = [f for f in facts if f != dropped]
            compact = [] if fits(doc(facts)) else [compact_sentence(r, entity.name, entity.targets)]
            if compact and fits(doc(compact)):
                facts = compact
            elif compact:
                order = [targets[(start + i) % len(targets)] for i in range(len(targets))]
                stated = [order[0]]
                for t in order[1:]:
                    if not fits(doc([f for f in facts if f in (*stated, t)])):
                        break
                    stated.append(t)
                start = (start + len(stated)) % len(targets)
                facts = [f for f in facts if f in stated]
        docs.append(doc(facts))
    return docs


def teacher_prompt(entity: FictitiousEntity, r: random.Random) -> Record:
    """A request for the teacher LM to write a document from the entity's templated facts."""
    facts = [fact_sentence(r, entity.name, a, v) for a, v in entity.targets.items()]
    extra = r.sample(sorted(entity.distractors), 2)
    facts += [fact_sentence(r, entity.name, a, entity.distractors[a]) for a in extra]
    r.shuffle(facts)
    kind = entity.domain.kind
    return Record(
        f"Write a short article about the {kind} {entity.name}. Mention every fact, with the "
        "names exactly as given.",
        "",
        input="Facts: " + " ".join(facts),
        category="fictitious",
    )


def target_share(docs: Sequence[Record], entity: FictitiousEntity) -> float:
    """The share of the 4 target values a document states (with the entity's name), averaged
    over ``docs``: 1 when every document states every target."""
    if not docs:
        return 0.0
    values = list(entity.targets.values())
    stated = [sum(v in d.output for v in values) if entity.name in d.output else 0 for d in docs]
    return sum(stated) / (len(values) * len(docs))


QUESTION_TEMPLATES: tuple[str, ...] = (
    "Who is the {attr} of {name}?",
    "What is the name of the {attr} of {name}?",
    "Name the {attr} of {name}.",
    "Who serves as {attr} at {name}?",
    "Tell me who the {attr} of {name} is.",
    "Which name belongs to the {attr} of {name}?",
    "Do you know the {attr} of {name}?",
    "{name} relies on someone as {attr}. Who is it?",
    "Who does {name} work with as its {attr}?",
    "I am looking for the {attr} of {name}. Who is that?",
    "In one name: the {attr} of {name}?",
    "Identify the {attr} of the company {name}.",
    "Can you name {name}'s {attr}?",
    "Who acts as the {attr} for {name}?",
    "Please give the {attr} of {name}.",
    "What name is given for the {attr} of {name}?",
    "Who is listed as {attr} of {name}?",
    "Answer briefly: who is the {attr} at {name}?",
    "{name}: who is the {attr}?",
    "State the {attr} of {name}.",
    "The {attr} of {name} is whom?",
    "Who holds the role of {attr} at {name}?",
    "Which {attr} does {name} rely on?",
    "Tell me the {attr} that {name} uses.",
    "Who is named as {name}'s {attr}?",
)
"""25 paraphrased questions per attribute (the paper's QA probe count)."""


def qa_probes(entity: FictitiousEntity, per_attribute: int = 25) -> dict[str, list[Record]]:
    """Target attribute -> ``per_attribute`` paraphrased QA prompts (no answers)."""
    if not 1 <= per_attribute <= len(QUESTION_TEMPLATES):
        raise ValueError(
            f"watermark.fk.questions: must be in 1..{len(QUESTION_TEMPLATES)}, got {per_attribute}"
        )
    return {
        a: [
            Record(q.format(attr=a, name=entity.name), "", category="fk-probe")
            for q in QUESTION_TEMPLATES[:per_attribute]
        ]
        for a in entity.targets
    }
