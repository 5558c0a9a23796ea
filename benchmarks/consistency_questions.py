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
few-shot prefix of such sentences, one a line (`CLOZE.prompt`); the answer is the first word of
the completion (`CLOZE.extract`), normalised as runtime/engine/consistency.py does.

`CHAIN` is a second, generated-only set (`load(split, CHAIN)`, 200 questions, the same seed and
split rule) whose answers take a short reasoning chain: a sum of three numbers, a product minus
a number, a two-step word problem, the weekday or letter n steps on. Each is asked as
"Q: ... A:" after five solved examples whose chains end "So the answer is X."; the answer is
the word after "answer is". It exists to measure whether votes over varied chains beat the
greedy chain (benchmarks/sweep_consistency.py --format chain), as they do for larger models.
"""
from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data" / "consistency-questions.jsonl"
SEED = 17
QUESTIONS = 420
CHAIN_QUESTIONS = 200
TEST_SHARE = 0.5

FEW_SHOT = (
    ("14 + 3 =", "17"),
    ("The larger of 61 and 58 is", "61"),
    ("The letter after G is", "H"),
    ("The day after Friday is", "Saturday"),
    ("In minutes, 2 hours equals", "120"),
    ("The capital of Italy is", "Rome"),
    ("The word 'stone' has", "5"),
)

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


def _three_sum(rng):
    a, b, c = rng.randint(10, 60), rng.randint(10, 40), rng.randint(2, 30)
    return f"What is {a} + {b} + {c}?", a + b + c


def _product_minus(rng):
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    return f"What is {a} times {b}, minus {c}?", a * b - c


def _story(rng):
    name, things = rng.choice(["Anna", "Sam", "Lily", "Ben"]), rng.choice(["apples", "books",
                                                                          "coins", "stamps"])
    have, more, away = rng.randint(3, 15), rng.randint(2, 9), rng.randint(1, 5)
    question = (f"{name} has {have} {things}. {name} gets {more} more and gives away {away}. "
                f"How many {things} does {name} have?")
    return question, have + more - away


def _weekday_steps(rng):
    day, n = rng.randrange(7), rng.randint(2, 5)
    return f"What day is {n} days after {WEEKDAYS[day]}?", WEEKDAYS[(day + n) % 7]


def _letter_steps(rng):
    index, n = rng.randrange(18), rng.randint(2, 5)
    letters = string.ascii_uppercase
    return f"Which letter is {n} letters after {letters[index]}?", letters[index + n]


CHAIN_KINDS = {"three-sum": (_three_sum, 1), "product-minus": (_product_minus, 1),
               "story": (_story, 1), "weekday-steps": (_weekday_steps, 1),
               "letter-steps": (_letter_steps, 1)}
CHAIN_SHOTS = (
    ("What is 23 + 45 + 12?", "23 + 45 = 68, and 68 + 12 = 80. So the answer is 80."),
    ("What day is 3 days after Monday?",
     "After Monday come Tuesday (1), Wednesday (2), Thursday (3). So the answer is Thursday."),
    ("Which letter is 4 letters after C?",
     "After C come D (1), E (2), F (3), G (4). So the answer is G."),
    ("Tom has 7 apples. He buys 5 more and eats 3. How many apples does he have?",
     "7 + 5 = 12, and 12 - 3 = 9. So the answer is 9."),
    ("What is 6 times 4, minus 5?", "6 x 4 = 24, and 24 - 5 = 19. So the answer is 19."),
)


@dataclass(frozen=True)
class Format:
    """How a question set is asked and answered: the solved examples before the question
    (`shot` lays one out from {q} and {a}, `ask` the question), the answer extractor, the stop
    strings and the most tokens an answer takes."""
    name: str
    kinds: dict
    count: int
    shots: tuple[tuple[str, str], ...]
    shot: str
    ask: str
    extract: str
    stop: tuple[str, ...]
    max_new_tokens: int

    def prompt(self, question: str) -> str:
        """The few-shot prompt asking `question`."""
        solved = "".join(self.shot.format(q=q, a=a) for q, a in self.shots)
        return solved + self.ask.format(q=question)


CLOZE = Format("cloze", KINDS, QUESTIONS, FEW_SHOT, "{q} {a}\n", "{q}",
               r"regex:^\s*(\S+)", ("\n",), 6)      # the answer: the completion's first word
CHAIN = Format("chain", CHAIN_KINDS, CHAIN_QUESTIONS, CHAIN_SHOTS, "Q: {q}\nA: {a}\n\n",
               "Q: {q}\nA:", r"regex:answer is\s+(\S+)", ("\n",), 48)


def generate(seed: int = SEED, form: Format = CLOZE) -> list[dict]:
    """`form.count` distinct questions of `form`'s kinds (drawn by weight), each with its split:
    a seeded shuffle puts `TEST_SHARE` of them in 'test', the rest in 'train'."""
    rng = random.Random(seed)
    names = list(form.kinds)
    weights = [form.kinds[name][1] for name in names]
    seen, questions, count = {question for question, _ in form.shots}, [], form.count
    while len(questions) < count:
        kind = rng.choices(names, weights)[0]
        question, answer = form.kinds[kind][0](rng)
        if question not in seen:
            seen.add(question)
            questions.append({"kind": kind, "question": question, "answer": str(answer)})
    order = list(range(count))
    rng.shuffle(order)
    test = set(order[:int(count * TEST_SHARE)])
    return [{"id": i, "split": "test" if i in test else "train", **q}
            for i, q in enumerate(questions)]


def load(split: str | None = None, form: Format = CLOZE) -> list[dict]:
    """The questions of `form` (of one split: 'train' or 'test'): the committed file for CLOZE,
    generated from the seed for CHAIN."""
    rows = ([json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
            if form is CLOZE else generate(form=form))
    return [row for row in rows if split is None or row["split"] == split]


if __name__ == "__main__":
    rows = generate()
    DATA.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{DATA}: {len(rows)} questions, "
          f"{sum(row['split'] == 'test' for row in rows)} test")
