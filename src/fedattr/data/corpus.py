"""The embedded corpus: a procedural instruction/response generator, deterministic by seed.

Ten task families (arithmetic, unit conversion, comparisons, word manipulation, facts from
small tables, descriptions, tips, short stories, notes, definitions), each with several
phrasings and vocabularies, so that a model trained on it has a real, branching next-token
distribution for a watermark to bias. Nothing is downloaded.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .records import Record

ANIMALS = [
    "fox",
    "otter",
    "heron",
    "badger",
    "lynx",
    "sparrow",
    "tortoise",
    "dolphin",
    "beetle",
    "owl",
    "rabbit",
    "salmon",
    "wolf",
    "deer",
    "crab",
    "falcon",
    "frog",
    "bee",
]
HABITATS = [
    "forest",
    "river",
    "desert",
    "meadow",
    "mountain",
    "marsh",
    "coast",
    "valley",
    "jungle",
    "tundra",
    "lake",
    "cave",
]
ADJECTIVES = [
    "small",
    "curious",
    "quiet",
    "bright",
    "clever",
    "old",
    "young",
    "gentle",
    "restless",
    "patient",
    "brave",
    "shy",
    "quick",
    "careful",
    "proud",
]
COLOURS = [
    "red",
    "green",
    "blue",
    "yellow",
    "brown",
    "grey",
    "white",
    "black",
    "orange",
    "purple",
    "silver",
    "golden",
]
FOODS = [
    "bread",
    "soup",
    "rice",
    "cheese",
    "apples",
    "beans",
    "honey",
    "pasta",
    "berries",
    "carrots",
    "tea",
    "porridge",
]
NAMES = [
    "Ada",
    "Ben",
    "Clara",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Iris",
    "Jonas",
    "Kira",
    "Leo",
    "Maya",
    "Nils",
    "Omar",
    "Pia",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
]
PLACES = [
    "the harbour",
    "the market",
    "the library",
    "the old mill",
    "the station",
    "the garden",
    "the bakery",
    "the school",
    "the bridge",
    "the square",
]
ACTIVITIES = {
    "studying": [
        "Set a fixed time each day.",
        "Take short breaks every hour.",
        "Write summaries in your own words.",
        "Test yourself instead of rereading.",
        "Keep your desk free of distractions.",
        "Sleep well before an exam.",
    ],
    "cooking": [
        "Read the whole recipe first.",
        "Prepare all ingredients before you start.",
        "Taste as you go.",
        "Keep your knives sharp.",
        "Clean while food is cooking.",
        "Season in small steps.",
    ],
    "running": [
        "Start slowly and build up distance.",
        "Wear shoes that fit well.",
        "Drink water before and after.",
        "Rest one day each week.",
        "Warm up for five minutes.",
        "Keep a steady breathing rhythm.",
    ],
    "saving money": [
        "Write down every expense.",
        "Set a monthly budget.",
        "Cook at home more often.",
        "Wait a day before big purchases.",
        "Cancel services you do not use.",
        "Put a fixed amount aside each month.",
    ],
    "gardening": [
        "Water early in the morning.",
        "Choose plants that suit your soil.",
        "Remove weeds while they are small.",
        "Add compost every season.",
        "Give seedlings enough light.",
        "Mulch to keep the soil moist.",
    ],
    "sleeping well": [
        "Go to bed at the same time.",
        "Keep the bedroom dark and cool.",
        "Avoid screens before bed.",
        "Avoid coffee late in the day.",
        "Get daylight in the morning.",
        "Keep naps short.",
    ],
}
CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Brazil": "Brasilia",
    "Norway": "Oslo",
    "Egypt": "Cairo",
    "India": "New Delhi",
    "Peru": "Lima",
    "Spain": "Madrid",
    "Italy": "Rome",
    "Chile": "Santiago",
}
PLANETS = {
    "Mercury": "the closest planet to the Sun",
    "Venus": "the hottest planet",
    "Earth": "the only planet known to have life",
    "Mars": "known as the red planet",
    "Jupiter": "the largest planet",
    "Saturn": "famous for its bright rings",
    "Uranus": "tilted on its side",
    "Neptune": "the farthest planet from the Sun",
}
GLOSSARY = {
    "photosynthesis": "the process by which plants turn light, water and air into sugar",
    "erosion": "the slow wearing away of rock and soil by water, wind or ice",
    "democracy": "a system in which people choose their government by voting",
    "gravity": "the force that pulls objects toward each other",
    "recipe": "a set of instructions for preparing a dish",
    "budget": "a plan for how to spend and save money",
    "habitat": "the natural home of an animal or plant",
    "friction": "the force that resists motion between two surfaces",
    "metaphor": "a figure of speech that describes one thing as another",
    "vaccine": "a substance that trains the body to fight a disease",
    "orbit": "the curved path of an object around a star or planet",
    "harvest": "the gathering of ripe crops from the fields",
}
UNITS = [
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("kilograms", "grams", 1000),
    ("liters", "milliliters", 1000),
    ("days", "hours", 24),
    ("weeks", "days", 7),
]
THINGS = {
    "things you might find in a kitchen": [
        "spoon",
        "kettle",
        "bowl",
        "knife",
        "oven",
        "plate",
        "cup",
        "pan",
        "fork",
        "jar",
        "sink",
        "towel",
        "grater",
        "ladle",
        "sieve",
        "tray",
    ],
    "things you might see in a park": [
        "bench",
        "tree",
        "pond",
        "kite",
        "swing",
        "dog",
        "path",
        "flower",
        "fountain",
        "squirrel",
        "ball",
        "bird",
        "statue",
        "gate",
        "lamp",
        "leaf",
    ],
    "things people take on a trip": [
        "map",
        "passport",
        "jacket",
        "camera",
        "ticket",
        "book",
        "charger",
        "umbrella",
        "snack",
        "hat",
        "bag",
        "wallet",
        "phone",
        "scarf",
        "bottle",
    ],
    "jobs people do": [
        "baker",
        "nurse",
        "pilot",
        "farmer",
        "teacher",
        "painter",
        "doctor",
        "driver",
        "writer",
        "tailor",
        "miner",
        "sailor",
        "chef",
        "judge",
        "guard",
        "clerk",
    ],
    "musical instruments": [
        "piano",
        "violin",
        "drum",
        "flute",
        "guitar",
        "harp",
        "trumpet",
        "cello",
        "banjo",
        "oboe",
        "organ",
        "tuba",
        "lute",
        "horn",
        "bell",
        "fiddle",
    ],
    "words that describe the weather": [
        "sunny",
        "windy",
        "cloudy",
        "rainy",
        "foggy",
        "cold",
        "warm",
        "humid",
        "stormy",
        "calm",
        "dry",
        "misty",
        "bright",
        "grey",
        "icy",
        "mild",
    ],
}
WORD_BANK = sorted(
    set(
        "amber anchor apple arrow autumn basket beach berry blanket boat bread breeze brick "
        "bridge brook button cabin candle canyon carpet castle cedar chalk cherry cloud clover "
        "coast comet copper coral cotton crystal daisy dawn desert dune eagle ember feather "
        "fern field flame forest fossil garden glacier granite harbor hazel heather hill honey "
        "island ivory jungle kettle lagoon lantern lava leaf lemon lily linen maple marble "
        "meadow mirror moss mountain night oak ocean olive orchard pebble pepper pine planet "
        "plum pond prairie quartz rain reef ribbon river robin rose saddle sand shadow shell "
        "silk snow spark spice spring star stone storm stream summer sun thunder timber "
        "tulip valley velvet village violet wave willow wind winter wool".split()
    )
)
PET_NAMES = sorted(
    set(
        "Biscuit Pepper Mango Shadow Luna Milo Pixel Nugget Ziggy Olive Clover Bean Pickle "
        "Maple Juniper Waffle Scout Rusty Tango Poppy Comet Noodle Pebble Ginger Sunny Fig "
        "Hazel Bramble Cookie Dusty Echo Fudge Gizmo Honey Indigo Jasper Kiwi Lemon Mocha "
        "Nova Oreo Peanut Quill Rocket Sage Toffee Velvet Willow Yeti Zephyr".split()
    )
)
GAITS = ["great care", "quick steps", "calm grace", "sudden energy"]
SHELTERS = ["hollow tree", "warm burrow", "quiet nest", "dry corner"]
DURATIONS = ["all morning", "three days", "a whole week", "many tries"]
NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]


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
