"""The built-in instruction suite: short tasks generated from a seed, so the default profile needs no hub.

MARS pays off where a response holds spans that can be predicted several tokens at a time (templates,
text copied from the prompt, fixed formats, well-known sequences) next to spans that cannot (an
arithmetic result, a count, an order, a choice). Every family below mixes both, in different shares:

==============  ===========================================================  ==========================
family          example response                                             hard part
==============  ===========================================================  ==========================
arithmetic      ``47 + 38 = 85``                                             the result
word_problem    ``Mia buys 5 x 3 = 15 pens. Then ... The answer is 27.``     two results, worked steps
counting        ``The word red appears 3 times.``                            the count
sorting         ``7, 19, 42, 88``                                            the order
copying         ``the red fox sees a small boat``                            none: copied from prompt
formatting      ``{"name": "Ann", "age": 31, "city": "Paris"}``              none: a fixed format
listing         ``Wednesday, Thursday, Friday``                              the start; then a sequence
choice          ``horse``                                                    the choice
==============  ===========================================================  ==========================

All templates and word lists are written for this project (none comes from a benchmark test set).

Splits are disjoint by content: an item belongs to the held-out split when a hash of its family and
prompt falls in a fixed bucket, whatever the seed or the number of items drawn, so no held-out prompt
can ever appear in training data. Held-out items are the default benchmark of the evaluation stage,
scored per family with :func:`score` (exact match after stripping; word problems by final answer).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Literal, Sequence

from mars.errors import ConfigError, MarsError

Split = Literal["train", "heldout"]
HELDOUT_PERCENT = 10  # share of the content space reserved for held-out items

NAMES = ["Ann", "Ben", "Mia", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eva", "Tom", "Lily", "Omar", "Nina", "Paul", "Rosa", "Hugo"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Dublin", "Madrid", "Berlin", "Vienna", "Quito", "Seoul"]
COLORS = ["red", "blue", "green", "black", "white", "yellow", "pink", "brown", "gray", "orange"]
ANIMALS = ["cat", "dog", "horse", "cow", "fox", "bird", "fish", "lion", "mouse", "sheep", "goat", "bear"]
FRUITS = ["apple", "pear", "plum", "grape", "lemon", "mango", "peach", "cherry", "melon", "banana"]
OBJECTS = ["chair", "table", "cup", "lamp", "book", "door", "spoon", "box", "clock", "bottle", "pen", "shoe"]
ADJECTIVES = ["small", "big", "old", "new", "happy", "quiet", "fast", "slow", "warm", "cold", "tall", "short"]
VERBS = ["sees", "finds", "likes", "moves", "paints", "carries", "follows", "watches", "holds", "takes"]
PLACES = ["park", "house", "garden", "river", "school", "shop", "field", "beach", "forest", "market"]
ITEMS = ["pens", "apples", "books", "cards", "coins", "stamps", "shells", "candies", "marbles", "stickers"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
CATEGORIES = {"animal": ANIMALS, "fruit": FRUITS, "color": COLORS, "city": CITIES}


@dataclass(frozen=True)
class Item:
    prompt: str
    response: str
    family: str
    id: str

    def to_dict(self) -> dict:
        return asdict(self)


# ---- generators: one random.Random in, one (prompt, response) out -----------------------------------


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    op = rng.choice("+-x")
    if op == "+":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        c = a + b
    elif op == "-":
        a, b = rng.randint(10, 99), rng.randint(2, 99)
        a, b = max(a, b), min(a, b)
        c = a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        c = a * b
    lead = rng.choice(["What is {e}?", "Compute {e}.", "Calculate {e}.", "Work out {e}."])
    expr = f"{a} {op} {b}"
    return lead.format(e=expr), f"{expr} = {c}"


def _word_problem(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start = rng.randint(3, 40)
    kind = rng.randrange(3)
    if kind == 0:
        bags, per = rng.randint(2, 9), rng.randint(2, 9)
        total = start + bags * per
        prompt = (f"{name} has {start} {item}. {name} buys {bags} bags with {per} {item} in each bag. "
                  f"How many {item} does {name} have now?")
        response = (f"{name} buys {bags} x {per} = {bags * per} {item}. "
                    f"Then {name} has {start} + {bags * per} = {total} {item}. The answer is {total}.")
    elif kind == 1:
        gift = rng.randint(2, start - 1) if start > 3 else 1
        found = rng.randint(2, 30)
        left = start - gift
        total = left + found
        prompt = (f"{name} has {start} {item} and gives {gift} to a friend. Later {name} finds {found} more {item}. "
                  f"How many {item} does {name} have now?")
        response = (f"After giving some away, {name} has {start} - {gift} = {left} {item}. "
                    f"After finding more, {name} has {left} + {found} = {total} {item}. The answer is {total}.")
    else:
        friends = rng.randint(2, 6)
        per = rng.randint(2, 9)
        total = friends * per
        other = rng.choice([n for n in NAMES if n != name])
        prompt = (f"{name} gives {per} {item} to each of {friends} friends. {other} gives away {start} {item}. "
                  f"How many {item} do they give away in total?")
        response = (f"{name} gives away {friends} x {per} = {total} {item}. "
                    f"Together they give away {total} + {start} = {total + start} {item}. "
                    f"The answer is {total + start}.")
    return prompt, response


def _counting(rng: random.Random) -> tuple[str, str]:
    pool = rng.choice([COLORS, ANIMALS, FRUITS])
    choices = rng.sample(pool, 3)
    words = [rng.choice(choices) for _ in range(rng.randint(4, 9))]
    target = rng.choice(words)
    n = words.count(target)
    prompt = f"How many times does the word {target} appear in this list: {', '.join(words)}?"
    return prompt, f"The word {target} appears {n} {'time' if n == 1 else 'times'}."


def _sorting(rng: random.Random) -> tuple[str, str]:
    nums = rng.sample(range(1, 100), rng.randint(3, 6))
    descending = rng.random() < 0.3
    order = "descending" if descending else "ascending"
    prompt = f"Sort these numbers in {order} order: {', '.join(map(str, nums))}."
    return prompt, ", ".join(map(str, sorted(nums, reverse=descending)))


def _copying(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.3:
        word, times = rng.choice(ANIMALS + FRUITS + OBJECTS), rng.randint(2, 6)
        return f"Repeat the word {word} {NUMBER_WORDS[times]} times.", " ".join([word] * times)
    adj, noun, verb = rng.choice(ADJECTIVES), rng.choice(ANIMALS), rng.choice(VERBS)
    adj2, obj, place = rng.choice(ADJECTIVES), rng.choice(OBJECTS), rng.choice(PLACES)
    color = rng.choice(COLORS)
    sentence = f"the {adj} {noun} {verb} a {adj2} {color} {obj} in the {place}"
    lead = rng.choice(["Repeat this sentence exactly:", "Copy this text:", "Say it back word for word:"])
    return f"{lead} {sentence}", sentence


def _formatting(rng: random.Random) -> tuple[str, str]:
    name, age, city = rng.choice(NAMES), rng.randint(18, 90), rng.choice(CITIES)
    style = rng.randrange(3)
    if style == 0:
        prompt = f"Write a JSON object with name {name}, age {age} and city {city}."
        return prompt, f'{{"name": "{name}", "age": {age}, "city": "{city}"}}'
    if style == 1:
        prompt = f"Write one line per field, as key: value, for name {name}, age {age} and city {city}."
        return prompt, f"name: {name}\nage: {age}\ncity: {city}"
    prompt = f"Write a table row with the columns name, age and city for {name}, {age} years old, from {city}."
    return prompt, f"| {name} | {age} | {city} |"


def _listing(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    count = rng.randint(2, 5)
    if kind == 0:
        start = rng.randrange(7)
        seq = [DAYS[(start + i + 1) % 7] for i in range(count)]
        prompt = f"List the {NUMBER_WORDS[count]} days that come after {DAYS[start]}."
    elif kind == 1:
        start = rng.randrange(12)
        seq = [MONTHS[(start + i + 1) % 12] for i in range(count)]
        prompt = f"List the {NUMBER_WORDS[count]} months that come after {MONTHS[start]}."
    elif kind == 2:
        start = rng.randrange(26 - count)
        seq = list(LETTERS[start + 1: start + 1 + count])
        prompt = f"List the {NUMBER_WORDS[count]} letters that come after {LETTERS[start]}."
    else:
        step, start = rng.randint(2, 9), rng.randint(1, 60)
        count = rng.randint(3, 6)
        seq = [str(start + step * i) for i in range(count)]
        prompt = f"Count from {start} to {seq[-1]} in steps of {step}."
    return prompt, ", ".join(seq)


def _choice(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, b = rng.sample(range(1, 1000), 2)
        which = rng.choice(["larger", "smaller"])
        answer = max(a, b) if which == "larger" else min(a, b)
        return f"Which number is {which}: {a} or {b}?", str(answer)
    category = rng.choice(sorted(CATEGORIES))
    answer = rng.choice(CATEGORIES[category])
    others = [w for c, ws in CATEGORIES.items() if c != category for w in ws]
    options = rng.sample(others, rng.randint(2, 3)) + [answer]
    rng.shuffle(options)
    return f"Which of these is a {category}: {', '.join(options)}?", answer


_NUMBER = re.compile(r"-?\d+")


def exact_match(prediction: str, reference: str) -> float:
    return float(prediction.strip() == reference.strip())


def final_number(prediction: str, reference: str) -> float:
    """1.0 when the last number of the prediction is the last number of the reference (GSM-style)."""
    pred, ref = _NUMBER.findall(prediction), _NUMBER.findall(reference)
    return float(bool(pred) and bool(ref) and pred[-1] == ref[-1])


@dataclass(frozen=True)
class Family:
    name: str
    generate: Callable[[random.Random], tuple[str, str]]
    scorer: Callable[[str, str], float] = exact_match
    description: str = ""


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("arithmetic", _arithmetic, description="two-number +, -, x; the expression is copied, the result is not"),
        Family("word_problem", _word_problem, final_number, "two-step story problems with worked steps"),
        Family("counting", _counting, description="count a word's occurrences in a list"),
        Family("sorting", _sorting, description="sort 3-6 numbers ascending or descending"),
        Family("copying", _copying, description="repeat a sentence or a word from the prompt"),
        Family("formatting", _formatting, description="render fields as JSON, key: value lines or a table row"),
        Family("listing", _listing, description="continue days, months, letters or an arithmetic sequence"),
        Family("choice", _choice, description="pick the larger/smaller number or the member of a category"),
    ]
}


def family_names() -> list[str]:
    return list(FAMILIES)


def resolve_families(families: Iterable[str] | None) -> list[str]:
    names = list(families) if families is not None else family_names()
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ConfigError(f"families: unknown {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
    if not names:
        raise ConfigError("families: empty list")
    return names


def content_hash(family: str, prompt: str) -> str:
    return hashlib.blake2b(f"{family}\x00{prompt}".encode(), digest_size=8).hexdigest()


def split_of(family: str, prompt: str) -> Split:
    """The split an item belongs to, fixed by its content alone."""
    return "heldout" if int(content_hash(family, prompt), 16) % 100 < HELDOUT_PERCENT else "train"


def _per_family(n: int, names: Sequence[str]) -> list[int]:
    base, extra = divmod(n, len(names))
    return [base + (i < extra) for i in range(len(names))]


def _draw(family: str, split: Split, n: int, seed: int) -> list[Item]:
    """``n`` distinct items of one family and split; the family's own RNG keeps families independent."""
    gen = FAMILIES[family].generate
    rng = random.Random(f"mars-suite:{seed}:{split}:{family}")
    seen: set[str] = set()
    items: list[Item] = []
    attempts = 0
    while len(items) < n:
        attempts += 1
        if attempts > 200 * n + 1000:
            raise MarsError(f"suite family {family!r}: only {len(items)} distinct {split} items found, {n} asked")
        prompt, response = gen(rng)
        if split_of(family, prompt) != split or prompt in seen:
            continue
        seen.add(prompt)
        items.append(Item(prompt, response, family, f"{family}-{content_hash(family, prompt)}"))
    return items


def generate(split: Split, n: int, seed: int = 0, families: Iterable[str] | None = None) -> list[Item]:
    """``n`` items of ``split`` spread evenly over ``families`` (all by default), deterministic in ``seed``.

    Training items come shuffled (families interleaved); held-out items are grouped by family.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, got {split!r}")
    names = resolve_families(families)
    items = [it for name, k in zip(names, _per_family(n, names)) for it in _draw(name, split, k, seed)]
    if split == "train":
        random.Random(f"mars-suite:{seed}:shuffle").shuffle(items)
    return items


def train(n: int, seed: int = 0, families: Iterable[str] | None = None) -> list[Item]:
    return generate("train", n, seed, families)


def heldout(n: int, seed: int = 0, families: Iterable[str] | None = None) -> list[Item]:
    return generate("heldout", n, seed, families)


def score(family: str, prediction: str, reference: str) -> float:
    """Score one prediction; families outside the suite (external data) are scored by exact match."""
    fam = FAMILIES.get(family)
    return (fam.scorer if fam else exact_match)(prediction, reference)
