"""Training prompts written for verispec in the style of Spec-Bench's categories (none taken from it).

Spec-Bench (Xia et al., 2024) mixes MT-Bench-style tasks (writing, roleplay, reasoning, math, coding,
extraction, STEM, humanities) with translation, summarization, QA, grade-school maths and RAG. The
prompts here are built from templates and topic lists written by hand; passage-based tasks
(summarize, extract, answer from context) take their passages from text already on the machine
(package documentation, see :mod:`verispec.distill.data`). The result is deterministic for a seed.
"""

from __future__ import annotations

import random

TOPICS = [
    "the water cycle",
    "photosynthesis",
    "black holes",
    "the French Revolution",
    "machine learning",
    "climate change",
    "the immune system",
    "ancient Rome",
    "renewable energy",
    "the stock market",
    "volcanoes",
    "the printing press",
    "honey bees",
    "the Silk Road",
    "electric cars",
    "sleep",
    "the human brain",
    "coral reefs",
    "inflation",
    "the Internet",
    "vaccines",
    "plate tectonics",
    "the Renaissance",
    "supply and demand",
    "quantum computing",
    "recycling",
    "the Moon landing",
    "urban gardening",
    "social media",
    "the Industrial Revolution",
    "DNA",
    "meditation",
    "the Great Wall of China",
    "antibiotics",
    "earthquakes",
    "jazz music",
    "the Olympic Games",
    "remote work",
    "public libraries",
    "the theory of evolution",
    "solar panels",
    "rainforests",
    "cryptography",
    "the Cold War",
    "nutrition",
    "tides",
    "the periodic table",
    "democracy",
    "3D printing",
    "migration of birds",
    "the Roman Empire's fall",
    "glaciers",
    "small businesses",
]
PLACES = [
    "Japan",
    "Iceland",
    "Peru",
    "Morocco",
    "Norway",
    "Vietnam",
    "Italy",
    "Kenya",
    "New Zealand",
    "Canada",
    "Portugal",
    "Mexico",
    "Egypt",
    "Scotland",
    "Thailand",
    "Chile",
]
PEOPLE = [
    "a pirate captain",
    "Sherlock Holmes",
    "a medieval knight",
    "a friendly robot",
    "a chef",
    "a detective",
    "a personal trainer",
    "a travel guide",
    "Albert Einstein",
    "a wise old wizard",
    "a news reporter",
    "a kindergarten teacher",
    "a startup founder",
    "an astronaut on Mars",
]
WRITING = [
    "Write a short blog post about {topic}.",
    "Compose a persuasive essay on why {topic} matters.",
    "Write a poem about {topic}.",
    "Draft an email to a colleague explaining {topic}.",
    "Write a travel blog post about a trip to {place}, highlighting food and culture.",
    "Write a short story that takes place in {place}.",
    "Write a product description for a gadget related to {topic}.",
    "Write a speech for a school graduation that mentions {topic}.",
    "Create a catchy slogan and a short advertisement about {topic}.",
    "Write a letter to a friend describing your holiday in {place}.",
]
ROLEPLAY = [
    "Pretend you are {person}. Explain {topic} in your own style.",
    "Act as {person} and give advice to someone who is nervous about a job interview.",
    "You are {person}. Describe your typical day.",
    "Imagine you are {person} visiting {place}. What do you say to the locals?",
    "Role-play as {person} answering the question: why should people learn about {topic}?",
]
REASONING = [
    "If a train leaves at {h}:00 and travels for {a} hours, and another leaves at {h2}:00 and travels for "
    "{b} hours, "
    "which one arrives first? Explain step by step.",
    "There are {a} apples in a basket. You take away {b}. How many apples do you have? Explain.",
    "Alice is taller than Bob. Bob is taller than Carol. Is Carol taller than Alice? Explain your reasoning.",
    "A farmer has {a} chickens and {b} cows. How many legs are there in total? Think step by step.",
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
    "What comes next in the sequence {a}, {a2}, {a3}, {a4}? Explain the pattern.",
]
MATH = [
    "What is {a} times {b}? Show your work.",
    "Solve for x: {a}x + {b} = {c}.",
    "What is the area of a rectangle with sides {a} and {b}?",
    "A circle has a radius of {a}. What is its circumference and area?",
    "What is {a}% of {c}?",
    "Find the sum of the integers from 1 to {c}.",
    "The vertices of a triangle are at (0, 0), ({a}, 0) and (0, {b}). What is its area?",
]
MATH_WORD = [
    "{name} buys {a} notebooks at ${b} each and a pen for ${p}. How much does {name} spend in total?",
    "{name} reads {a} pages a day. How many pages does {name} read in {b} weeks?",
    "A shop sells {a} cakes on Monday and twice as many on Tuesday. "
    "How many cakes did it sell in the two days?",
    "{name} has ${c}. After spending ${a} on lunch and ${b} on a book, how much money is left?",
    "A class has {c} students. {a} of them walk to school and the rest take the bus. "
    "What fraction takes the bus?",
    "{name} runs {a} miles every day except Sunday. How many miles does {name} run in {b} weeks?",
]
NAMES = ["Maria", "John", "Aisha", "Carlos", "Mei", "Tom", "Fatima", "Lucas", "Sara", "Ken"]
CODING = [
    "Write a Python function that {task}.",
    "Implement {task} in Python and explain how it works.",
    "Write a JavaScript function that {task}.",
    "Write a C++ program that {task}.",
    "Explain how to write a function that {task}, then give the code.",
]
TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "finds the largest element of a list",
    "counts the words in a text file",
    "sorts a list with merge sort",
    "computes the Fibonacci numbers",
    "removes duplicates from a list",
    "checks if a string is a palindrome",
    "merges two sorted lists",
    "computes the factorial of a number",
    "finds the most common word in a sentence",
    "converts Celsius to Fahrenheit",
    "implements binary search",
    "reads a CSV file and sums a column",
]
STEM = [
    "Explain {topic} to a high school student.",
    "What are the main scientific ideas behind {topic}?",
    "How does {topic} work? Give a clear explanation with an example.",
    "What are the advantages and disadvantages of {topic}?",
]
HUMANITIES = [
    "Discuss the historical importance of {topic}.",
    "How has {topic} shaped modern society?",
    "Compare the economic and social effects of {topic}.",
    "What lessons can we learn from {topic}?",
]
QA = [
    "What is the capital of {place}?",
    "Who invented the telephone?",
    "What is {topic}?",
    "When did the Second World War end?",
    "Why is the sky blue?",
    "How many planets are in the solar system?",
    "What language is spoken in {place}?",
    "Who wrote Romeo and Juliet?",
    "What is the tallest mountain on Earth?",
    "How far is the Moon from the Earth?",
    "What is the boiling point of water?",
    "Who painted the Mona Lisa?",
]
TRANSLATE_SRC = [
    ("German", "Das Wetter ist heute sehr schön, deshalb gehen wir in den Park."),
    ("German", "Die Regierung hat neue Maßnahmen gegen die Inflation angekündigt."),
    ("German", "Ich habe gestern ein interessantes Buch über Geschichte gelesen."),
    ("German", "Die Preise für Wohnungen in der Stadt steigen weiter."),
    ("German", "Der Zug nach Berlin hat leider zwanzig Minuten Verspätung."),
    ("German", "Viele Menschen arbeiten jetzt von zu Hause aus."),
    ("German", "Die Mannschaft hat das Spiel am Samstag knapp gewonnen."),
    ("German", "Wissenschaftler haben eine neue Art von Fischen im Meer entdeckt."),
    ("French", "Le musée sera fermé lundi pour des travaux de rénovation."),
    ("French", "Nous avons mangé dans un petit restaurant près de la gare."),
    ("French", "Les élèves préparent leurs examens de fin d'année."),
    ("Spanish", "El mercado abre todos los días a las ocho de la mañana."),
    ("Spanish", "Mi hermana estudia medicina en la universidad de Madrid."),
    ("Spanish", "La empresa va a contratar a cien nuevos trabajadores."),
]


CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "stem",
    "humanities",
    "qa",
    "math_reasoning",
    "translation",
    "summarization",
    "extraction",
    "rag",
)
"""The categories :func:`prompts_for` cycles over, in order: prompt i is of ``CATEGORIES[i % 13]``."""


def prompts_for(count: int, passages: list[str], seed: int = 0) -> list[str]:
    """``count`` prompts cycling over the :data:`CATEGORIES`, with slots filled at random
    (deterministic)."""
    rng = random.Random(seed)

    def fill(template: str) -> str:
        a, b = rng.randint(2, 40), rng.randint(2, 12)
        step = rng.randint(2, 5)
        return template.format(
            topic=rng.choice(TOPICS),
            place=rng.choice(PLACES),
            person=rng.choice(PEOPLE),
            name=rng.choice(NAMES),
            task=rng.choice(TASKS),
            a=a,
            b=b,
            c=rng.randint(41, 500),
            p=rng.randint(1, 5),
            h=rng.randint(6, 11),
            h2=rng.randint(6, 11),
            a2=a + step,
            a3=a + 2 * step,
            a4=a + 3 * step,
        )

    def passage() -> str:
        text = rng.choice(passages) if passages else rng.choice(TOPICS)
        return text[:1500]

    makers = [
        lambda: fill(rng.choice(WRITING)),
        lambda: fill(rng.choice(ROLEPLAY)),
        lambda: fill(rng.choice(REASONING)),
        lambda: fill(rng.choice(MATH)),
        lambda: fill(rng.choice(CODING)),
        lambda: fill(rng.choice(STEM)),
        lambda: fill(rng.choice(HUMANITIES)),
        lambda: fill(rng.choice(QA)),
        lambda: fill(rng.choice(MATH_WORD)),
        lambda: "Translate {} to English: {}".format(*rng.choice(TRANSLATE_SRC)),
        lambda: "Summarize: " + passage(),
        lambda: "Extract the key facts from the following text as a bulleted list:\n" + passage(),
        lambda: (
            passage()
            + "\n\nBased on the text above, "
            + rng.choice(
                [
                    "what is the main purpose described?",
                    "what are the key features?",
                    "answer briefly: what is it for?",
                ]
            )
        ),
    ]
    assert len(makers) == len(CATEGORIES)
    return [makers[i % len(makers)]() for i in range(count)]
