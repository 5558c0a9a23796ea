"""The verifiable question set of the self-consistency benchmark (issue 17): short questions with
one known answer, generated from a seed, split into router-training and test questions.

    python benchmarks/consistency_questions.py     # rewrites data/consistency-questions.jsonl

Kinds (each answer a single word or number): two-digit addition and subtraction, one- by
two-digit multiplication, the larger of two numbers, letters in a word, a letter's count in a
word, the letter n after / before another, the weekday n days after another, the month n after
another, unit conversions (minutes, seconds, centimetres, days, grams, months) and capitals of
countries (single-word capitals). The mix is tuned so that smollm2-135m's single greedy answer
is right on 20-80% of the questions (measured by benchmarks/bench_consistency.py).

A question is a sentence its answer completes ("The day after Friday is"), asked after a fixed
few-shot prefix of such sentences, one a line (`prompt`); the answer is the first word of the
completion (`EXTRACT`), normalised as rbcompile.consistency does.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

DATA = Path(__file__).parent / "data" / "consistency-questions.jsonl"
SEED = 17
QUESTIONS = 420
TEST_SHARE = 0.5
EXTRACT = r"regex:^\s*(\S+)"        # the completion's first word
STOP = ["\n"]

FEW_SHOT = [
    ("14 + 3 =", "17"),
    ("The larger of 61 and 58 is", "61"),
    ("The letter after G is", "H"),
    ("The day after Friday is", "Saturday"),
    ("In minutes, 2 hours equals", "120"),
    ("The capital of Italy is", "Rome"),
    ("The word 'stone' has", "5"),
]

WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
WORDS = ["apple", "garden", "river", "window", "basket", "planet", "silver", "butter", "candle",
         "forest", "pencil", "rabbit", "summer", "winter", "orange", "bottle", "mirror", "doctor",
         "monkey", "pocket", "yellow", "banana", "letter", "coffee", "kitten", "mountain",
         "elephant", "umbrella", "blanket", "chicken", "dolphin", "library", "morning", "teacher",
         "balloon", "cabbage", "giraffe", "notebook", "sandwich", "tomato", "bicycle", "cupboard",
         "strawberry", "hamburger", "pineapple", "butterfly", "mississippi", "committee",
         "bookkeeper", "assessment", "parallel", "necessary", "tennessee", "raccoon"]
CAPITALS = {"France": "Paris", "Germany": "Berlin", "Spain": "Madrid", "Japan": "Tokyo",
            "Egypt": "Cairo", "Russia": "Moscow", "Greece": "Athens", "Portugal": "Lisbon",
            "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
            "Poland": "Warsaw", "Ireland": "Dublin", "Hungary": "Budapest", "Denmark": "Copenhagen",
            "Belgium": "Brussels", "Peru": "Lima", "Kenya": "Nairobi", "China": "Beijing",
            "Thailand": "Bangkok", "Canada": "Ottawa", "Australia": "Canberra", "Cuba": "Havana",
            "Turkey": "Ankara", "Iran": "Tehran", "Chile": "Santiago", "Ukraine": "Kyiv",
            "Czechia": "Prague", "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade",
            "Nigeria": "Abuja", "Ghana": "Accra", "Ethiopia": "Addis", "Morocco": "Rabat",
            "Pakistan": "Islamabad", "Vietnam": "Hanoi", "Philippines": "Manila",
            "Indonesia": "Jakarta", "Venezuela": "Caracas", "Colombia": "Bogota",
            "Iceland": "Reykjavik", "Switzerland": "Bern", "Scotland": "Edinburgh",
            "Wales": "Cardiff", "Jamaica": "Kingston", "Nepal": "Kathmandu", "Syria": "Damascus",
            "Iraq": "Baghdad", "Lebanon": "Beirut", "Afghanistan": "Kabul", "Mongolia": "Ulaanbaatar"}
CAPITALS.pop("Ethiopia")            # 'Addis Ababa': two words
UNITS = [("minutes", "hours", 60), ("seconds", "minutes", 60), ("centimeters", "meters", 100),
         ("days", "weeks", 7), ("grams", "kilograms", 1000), ("months", "years", 12),
         ("hours", "days", 24), ("millimeters", "centimeters", 10)]


def _steps(n: int, unit: str) -> str:
    """'The day after' for one step, else '3 days after' (`unit` 'day')."""
    return f"The {unit}" if n == 1 else f"{n} {unit}s"


def _arithmetic(rng):
    op = rng.choice(["+", "+", "-", "*"])
    if op == "*":
        a, b = rng.randint(2, 5), rng.randint(2, 12)
        return f"{b} * {a} =", a * b
    a, b = rng.randint(10, 49), rng.randint(1, 9)
    if op == "-":
        return f"{a} - {b} =", a - b
    return f"{a} + {b} =", a + b


def _compare(rng):
    a, b = rng.sample(range(10, 1000), 2)
    word = rng.choice(["larger", "smaller"])
    return f"The {word} of {a} and {b} is", max(a, b) if word == "larger" else min(a, b)


def _letters(rng):
    word = rng.choice(WORDS)
    if rng.random() < 0.5:
        return f"The word '{word}' has", len(word)
    letter = rng.choice(sorted(set(word)))
    return f"The number of times '{letter}' appears in '{word}' is", word.count(letter)


def _alphabet(rng):
    n, direction = rng.choice([1, 1, 1, 2]), rng.choice(["after", "after", "before"])
    index = rng.randint(3, 22)
    target = index + n if direction == "after" else index - n
    letters = string.ascii_uppercase
    return f"{_steps(n, 'letter')} {direction} {letters[index]} is", letters[target]


def _calendar(rng):
    if rng.random() < 0.5:
        n, day = rng.choice([1, 1, 2, 3]), rng.randrange(7)
        return f"{_steps(n, 'day')} after {WEEKDAYS[day]} is", WEEKDAYS[(day + n) % 7]
    n, month = rng.choice([1, 1, 2, 3]), rng.randrange(12)
    return f"{_steps(n, 'month')} after {MONTHS[month]} is", MONTHS[(month + n) % 12]


def _units(rng):
    small, big, factor = rng.choice(UNITS)
    n = rng.randint(2, 9)
    return f"In {small}, {n} {big} equals", n * factor


def _capital(rng):
    country = rng.choice(sorted(CAPITALS))
    return f"The capital of {country} is", CAPITALS[country]


KINDS = {"arithmetic": (_arithmetic, 3), "compare": (_compare, 3), "letters": (_letters, 1),
         "alphabet": (_alphabet, 2), "calendar": (_calendar, 2), "units": (_units, 1),
         "capital": (_capital, 2)}   # kind -> (maker, weight)


def generate(seed: int = SEED, count: int = QUESTIONS) -> list[dict]:
    """`count` distinct questions (kinds drawn by weight), each with its split: a seeded
    shuffle puts `TEST_SHARE` of them in 'test', the rest in 'train'."""
    rng = random.Random(seed)
    names = list(KINDS)
    weights = [KINDS[name][1] for name in names]
    seen, questions = {question for question, _ in FEW_SHOT}, []
    while len(questions) < count:
        kind = rng.choices(names, weights)[0]
        question, answer = KINDS[kind][0](rng)
        if question not in seen:
            seen.add(question)
            questions.append({"kind": kind, "question": question, "answer": str(answer)})
    order = list(range(count))
    rng.shuffle(order)
    test = set(order[:int(count * TEST_SHARE)])
    return [{"id": i, "split": "test" if i in test else "train", **q}
            for i, q in enumerate(questions)]


def prompt(question: str) -> str:
    """The few-shot prompt asking `question` (a sentence the answer completes)."""
    return "".join(f"{q} {a}\n" for q, a in FEW_SHOT) + question


def load(split: str | None = None, path: Path = DATA) -> list[dict]:
    """The committed questions (of one split: 'train' or 'test')."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if split is None or row["split"] == split]


if __name__ == "__main__":
    rows = generate()
    DATA.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{DATA}: {len(rows)} questions, "
          f"{sum(row['split'] == 'test' for row in rows)} test")
