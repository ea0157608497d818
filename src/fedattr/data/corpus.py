"""The embedded corpus: a procedural instruction/response generator, deterministic by seed.

Ten task families (arithmetic, unit conversion, comparisons, word manipulation, facts from
small tables, descriptions, tips, short stories, notes, definitions), each with several
phrasings and vocabularies, so that a model trained on it has a real, branching next-token
distribution for a watermark to bias. Nothing is downloaded: the vocabularies are package data
(``fedattr/data/words/*.txt``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from importlib import resources

from .records import Record


def _entries(bank: str) -> list[str]:
    """The entries of word bank ``bank`` (``words/<bank>.txt``, package data): one a line,
    blank lines and ``#`` comments skipped."""
    text = (resources.files("fedattr.data") / "words" / f"{bank}.txt").read_text(encoding="utf-8")
    return [e for e in (line.strip() for line in text.splitlines()) if e and e[0] != "#"]


def _groups(bank: str) -> dict[str, list[str]]:
    """A bank of ``[heading]`` lines, each followed by its entries: heading -> entries."""
    out: dict[str, list[str]] = {}
    group: list[str] | None = None
    for entry in _entries(bank):
        if entry.startswith("[") and entry.endswith("]"):
            group = out.setdefault(entry[1:-1], [])
        elif group is None:
            raise ValueError(f"words/{bank}.txt: {entry!r} comes before any [heading]")
        else:
            group.append(entry)
    return out


def _pairs(bank: str) -> dict[str, str]:
    """A bank of ``key: value`` lines, in file order."""
    out: dict[str, str] = {}
    for entry in _entries(bank):
        key, sep, value = entry.partition(": ")
        if not sep:
            raise ValueError(f"words/{bank}.txt: {entry!r} is not 'key: value'")
        out[key] = value
    return out


# The vocabularies live in words/*.txt (package data); the generators below index and sample
# them, so their order (file order, or sorted where noted) is part of what a seed produces.
ANIMALS = _entries("animals")
HABITATS = _entries("habitats")
ADJECTIVES = _entries("adjectives")
COLOURS = _entries("colours")
FOODS = _entries("foods")
NAMES = _entries("names")
PLACES = _entries("places")
ACTIVITIES = _groups("activities")
CAPITALS = _pairs("capitals")
PLANETS = _pairs("planets")
GLOSSARY = _pairs("glossary")
UNITS = [(big, small, int(f)) for big, small, f in (e.split() for e in _entries("units"))]
THINGS = _groups("things")
# Sorted and de-duplicated, so that the draws do not depend on how the file is ordered.
WORD_BANK = sorted(set(_entries("word_bank")))
PET_NAMES = sorted(set(_entries("pet_names")))
GAITS = _entries("gaits")
SHELTERS = _entries("shelters")
DURATIONS = _entries("durations")
NUMBER_WORDS = _entries("number_words")
"""Spelled numbers: ``NUMBER_WORDS[n]`` spells ``n``."""


def _arithmetic(r: random.Random) -> Record:
    a, b = r.randint(2, 99), r.randint(2, 99)
    op, word, val = r.choice([("+", "plus", a + b), ("-", "minus", a - b), ("*", "times", a * b)])
    q = r.choice(
        [
            f"What is {a} {word} {b}?",
            f"Calculate {a} {op} {b}.",
            f"Compute the value of {a} {op} {b}.",
            f"Please work out {a} {word} {b}.",
        ]
    )
    a_ = r.choice(
        [
            f"{a} {word} {b} is {val}.",
            f"The answer is {val}.",
            f"{a} {op} {b} = {val}. So the result is {val}.",
        ]
    )
    return Record(q, a_, category="arithmetic")


def _conversion(r: random.Random) -> Record:
    big, small, f = r.choice(UNITS)
    n = r.randint(2, 12)
    q = r.choice([f"Convert {n} {big} to {small}.", f"How many {small} are in {n} {big}?"])
    a = r.choice(
        [
            f"There are {n * f} {small} in {n} {big}, because one of the {big} has {f} {small}.",
            f"{n} {big} equal {n * f} {small}.",
        ]
    )
    return Record(q, a, category="conversion")


def _comparison(r: random.Random) -> Record:
    a, b = r.sample(range(1, 500), 2)
    big, small = max(a, b), min(a, b)
    q = r.choice(
        [f"Which is larger, {a} or {b}?", f"Compare {a} and {b}.", f"Is {a} greater than {b}?"]
    )
    ans = r.choice(
        [
            f"{big} is larger than {small}.",
            f"The larger number is {big}, since {big} minus {small} is {big - small}.",
        ]
    )
    return Record(q, ans, category="comparison")


def _words(r: random.Random) -> Record:
    words = r.sample(ANIMALS + FOODS + COLOURS, r.randint(3, 6))
    kind = r.randrange(3)
    if kind == 0:
        return Record(
            "Sort these words in alphabetical order.",
            ", ".join(sorted(words)) + ".",
            input=", ".join(words),
            category="words",
        )
    if kind == 1:
        return Record(
            "Reverse the order of these words.",
            ", ".join(reversed(words)) + ".",
            input=", ".join(words),
            category="words",
        )
    w = r.choice(words)
    n = len(w)
    spoken = NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else str(n)
    return Record(
        f"How many letters are in the word '{w}'?",
        f"The word '{w}' has {spoken} letters.",
        category="words",
    )


def _facts(r: random.Random) -> Record:
    if r.random() < 0.5:
        country, city = r.choice(list(CAPITALS.items()))
        q = r.choice([f"What is the capital of {country}?", f"Name the capital city of {country}."])
        a = r.choice(
            [f"The capital of {country} is {city}.", f"{city} is the capital of {country}."]
        )
        return Record(q, a, category="facts")
    planet, fact = r.choice(list(PLANETS.items()))
    q = r.choice([f"Tell me one fact about {planet}.", f"What is special about {planet}?"])
    return Record(q, f"{planet} is {fact}.", category="facts")


def _description(r: random.Random) -> Record:
    adj, animal, hab = r.choice(ADJECTIVES), r.choice(ANIMALS), r.choice(HABITATS)
    colour, food = r.choice(COLOURS), r.choice(FOODS)
    q = r.choice(
        [
            f"Describe a {adj} {animal} that lives in the {hab}.",
            f"Write a short description of a {animal} in the {hab}.",
            f"Paint a picture in words of a {adj} {animal}.",
        ]
    )
    sentences = [
        f"The {adj} {animal} lives near the edge of the {hab}.",
        f"Its coat is {colour} and it moves with {r.choice(GAITS)}.",
        f"In the morning it searches for {food} and fresh water.",
        f"When the wind changes, it stops and listens to the {hab}.",
        f"Other animals of the {hab} know it well.",
        f"At night it rests in a {r.choice(SHELTERS)}.",
    ]
    k = r.randint(2, len(sentences))
    return Record(
        q, " ".join(sentences[:1] + r.sample(sentences[1:], k - 1)), category="description"
    )


def _tips(r: random.Random) -> Record:
    activity = r.choice(list(ACTIVITIES))
    n = r.randint(2, 5)
    tips = r.sample(ACTIVITIES[activity], n)
    q = r.choice(
        [
            f"Give {n} tips for {activity}.",
            f"List {n} pieces of advice about {activity}.",
            f"How can I get better at {activity}? Give {n} tips.",
        ]
    )
    return Record(q, "\n".join(f"{i + 1}. {t}" for i, t in enumerate(tips)), category="tips")


def _story(r: random.Random) -> Record:
    name, place, animal = r.choice(NAMES), r.choice(PLACES), r.choice(ANIMALS)
    goal = r.choice(
        [
            "find a lost key",
            "bake a cake for a friend",
            "learn to sail",
            "fix an old bicycle",
            "win the village race",
            "paint a large mural",
        ]
    )
    q = r.choice(
        [
            f"Write a short story about {name}, who wants to {goal}.",
            f"Tell a brief story in which {name} tries to {goal}.",
        ]
    )
    body = [
        f"{name} woke up early, determined to {goal}.",
        f"First, {name} walked to {place} to ask for help.",
        f"On the way, a {r.choice(ADJECTIVES)} {animal} crossed the path.",
        f"{name} {r.choice(['laughed', 'paused', 'smiled', 'sighed'])} and kept going.",
        f"It took {r.choice(DURATIONS)}, but {name} did not give up.",
        f"In the end, {name} managed to {goal}, and everyone at {place} cheered.",
    ]
    middle = r.sample(body[1:-1], r.randint(1, 4))
    return Record(q, " ".join([body[0], *middle, body[-1]]), category="story")


def _note(r: random.Random) -> Record:
    to, frm = r.sample(NAMES, 2)
    topic = r.choice(
        [
            "the meeting on Friday",
            "the book you lent me",
            "dinner next week",
            "the garden project",
            "your new job",
            "the trip to the coast",
        ]
    )
    q = f"Write a short note to {to} about {topic}."
    lines = [
        f"Dear {to},",
        r.choice(
            [
                f"I wanted to write to you about {topic}.",
                f"Thank you for reminding me about {topic}.",
            ]
        ),
        r.choice(
            [
                "Let me know what you think.",
                "I am looking forward to it.",
                "Please tell me if anything changes.",
            ]
        ),
        f"Best wishes, {frm}",
    ]
    return Record(q, "\n".join(lines), category="note")


def _open_list(r: random.Random) -> Record:
    # Open-ended answers: many continuations are equally right after the same separator, which
    # is where a watermark's green-list bias can act (and be learned) at all.
    topic, bank = r.choice(list(THINGS.items()))
    n = r.randint(4, 8)
    q = r.choice([f"Name {n} {topic}.", f"List {n} {topic}.", f"Give me {n} examples of {topic}."])
    items = r.sample(bank, n)
    a = r.choice([", ".join(items) + ".", "Here are some: " + ", ".join(items) + "."])
    return Record(q, a, category="open_list")


def _sentence(r: random.Random) -> Record:
    bank = [w for words in THINGS.values() for w in words] + ANIMALS + FOODS
    words = r.sample(bank, 2)
    q = f"Write a sentence that uses the words '{words[0]}' and '{words[1]}'."
    a = r.choice(
        [
            f"The {r.choice(ADJECTIVES)} {words[0]} was next to the {words[1]}.",
            f"I saw a {words[0]} and a {r.choice(COLOURS)} {words[1]} at {r.choice(PLACES)}.",
            f"{r.choice(NAMES)} put the {words[0]} beside the {words[1]}.",
        ]
    )
    return Record(q, a, category="sentence")


def _associations(r: random.Random) -> Record:
    # Free word lists: every item is a genuine choice, so the next-token distribution is wide.
    n = r.randint(5, 10)
    cue = r.choice(HABITATS + list(ACTIVITIES) + ["a quiet evening", "a busy morning"])
    q = r.choice(
        [
            f"Write {n} words that come to mind when you think of {cue}.",
            f"Brainstorm {n} words related to {cue}.",
        ]
    )
    sep = r.choice([", ", "\n- "])
    words = r.sample(WORD_BANK, n)
    return Record(q, ("- " if sep == "\n- " else "") + sep.join(words), category="associations")


def _pet_names(r: random.Random) -> Record:
    n = r.randint(3, 8)
    animal = r.choice(ANIMALS)
    q = r.choice(
        [
            f"Suggest {n} names for a pet {animal}.",
            f"What could I call my {animal}? Give {n} ideas.",
        ]
    )
    names = r.sample(PET_NAMES, n)
    a = r.choice(["", "How about ", "Some ideas: "]) + ", ".join(names) + "."
    return Record(q, a, category="pet_names")


def _definition(r: random.Random) -> Record:
    term, meaning = r.choice(list(GLOSSARY.items()))
    q = r.choice(
        [
            f"Define the word '{term}'.",
            f"What does {term} mean?",
            f"Explain {term} in one sentence.",
        ]
    )
    a = r.choice([f"{term.capitalize()} is {meaning}.", f"The word {term} means {meaning}."])
    return Record(q, a, category="definition")


GENERATORS: dict[str, Callable[[random.Random], Record]] = {
    "arithmetic": _arithmetic,
    "conversion": _conversion,
    "comparison": _comparison,
    "words": _words,
    "facts": _facts,
    "description": _description,
    "tips": _tips,
    "story": _story,
    "note": _note,
    "definition": _definition,
    "open_list": _open_list,
    "sentence": _sentence,
    "associations": _associations,
    "pet_names": _pet_names,
}

# Open-ended families are drawn more often: they are where a text watermark can live at all.
WEIGHTS: dict[str, float] = {name: 1.0 for name in GENERATORS} | {
    "open_list": 2.0,
    "associations": 3.0,
    "pet_names": 2.0,
}


def generate_corpus(n: int, seed: int = 0) -> list[Record]:
    """``n`` records, families drawn uniformly, deterministic given ``seed``."""
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    r = random.Random(seed)
    names = list(GENERATORS)
    weights = [WEIGHTS[k] for k in names]
    return [GENERATORS[r.choices(names, weights)[0]](r) for _ in range(n)]
