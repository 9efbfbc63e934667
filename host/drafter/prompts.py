"""The prompt set a draft head is self-distilled on: the target answers these, and the head learns
to predict the target's own next-next choices over those answers.

Deterministic and self-contained (no data set, no download, nothing from the benchmark prompts):
general topics crossed with task templates (explain, summarise, list, compare, rewrite, answer,
argue, teach...), plus families with their own items: code tasks, math word problems, story
openings to continue, dialogues, text to rewrite or summarise, and short factual questions.
Given the target's vocabulary words (`vocabulary_words`), single-word topics, each in one prompt
only, take most of the topics' share.
`training_prompts()` interleaves the families so that any prefix of the list is still diverse.
"""

from __future__ import annotations

import random

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "vaccines", "the immune system",
    "climate change", "renewable energy", "electric cars", "the printing press", "the Roman Empire",
    "the French Revolution", "the Industrial Revolution", "ancient Egypt", "the Silk Road", "democracy",
    "inflation", "supply and demand", "compound interest", "cryptocurrency", "machine learning",
    "neural networks", "the internet", "computer viruses", "public key cryptography", "databases",
    "operating systems", "cloud computing", "quantum computing", "the human heart", "sleep",
    "nutrition", "exercise", "meditation", "coffee", "bread baking", "composting", "honey bees",
    "coral reefs", "rainforests", "volcanoes", "earthquakes", "the moon landing", "Mars exploration",
    "the solar system", "gravity", "electricity", "magnetism", "light and color", "sound waves",
    "DNA", "evolution", "antibiotics", "the periodic table", "chess", "jazz music", "the Olympic Games",
    "social media", "remote work", "time management", "public speaking", "learning a new language",
    "urban gardening", "recycling", "the stock market", "small businesses", "architecture",
    "bridges", "trains", "airplanes", "the ocean tides", "weather forecasting", "mountains",
    "deserts", "friendship", "kindness", "libraries", "museums", "photography", "painting",
    "poetry", "video games", "smartphones", "robots", "3D printing", "space telescopes",
]

TOPIC_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Explain {t} to a ten-year-old.",
    "What is {t}? Give a short answer.",
    "Write a short paragraph about {t}.",
    "Give me five interesting facts about {t}.",
    "List the main advantages and disadvantages of {t}.",
    "Summarize what everyone should know about {t} in three sentences.",
    "Write a short poem about {t}.",
    "What are the most common misconceptions about {t}?",
    "How would you teach {t} to a beginner? Give a step-by-step plan.",
    "Write a blog post introduction about {t}.",
    "What is the history of {t}?",
    "Why is {t} important? Answer in a few sentences.",
    "Describe {t} using an analogy.",
    "Write three quiz questions about {t}, with answers.",
    "What questions do people often ask about {t}? Answer two of them.",
    "Write a tweet about {t}.",
    "Give a one-sentence definition of {t}, then explain it in more detail.",
    "Write an outline for an essay on {t}.",
    "What would a future without {t} look like?",
]

COMPARE_PAIRS = [
    ("cats", "dogs"), ("tea", "coffee"), ("Python", "JavaScript"), ("trains", "planes"),
    ("renting", "buying a home"), ("books", "movies"), ("summer", "winter"), ("cities", "the countryside"),
    ("solar power", "wind power"), ("email", "phone calls"), ("running", "swimming"),
    ("paper books", "e-readers"), ("lists", "tuples in Python"), ("TCP", "UDP"), ("viruses", "bacteria"),
    ("weather", "climate"), ("SQL", "NoSQL databases"), ("classical music", "rock music"),
    ("working from home", "working in an office"), ("stocks", "bonds"),
]
COMPARE_TEMPLATES = [
    "Compare {a} and {b}.",
    "What are the differences between {a} and {b}?",
    "Which is better, {a} or {b}? Give arguments for both sides.",
    "Write a short table comparing {a} and {b}.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the nth Fibonacci number",
    "sorts a list of dictionaries by a key", "counts the words in a text file", "merges two sorted lists",
    "finds the largest element in a list", "removes duplicates from a list while keeping order",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit",
    "computes the factorial of a number", "flattens a nested list", "implements binary search",
    "validates an email address with a regular expression", "reads a CSV file and prints the average of a column",
    "implements a stack class", "computes the greatest common divisor of two numbers",
    "counts the vowels in a string", "finds all pairs in a list that sum to a target",
    "implements bubble sort", "transposes a matrix", "generates all permutations of a list",
    "parses a date string and prints the weekday", "implements a simple linked list",
    "computes the moving average of a list of numbers", "checks whether two strings are anagrams",
    "converts a Roman numeral to an integer", "implements a queue using two stacks",
    "finds the longest common prefix of a list of strings", "returns the n most common words in a text",
]
CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "C", "Rust", "Java", "Go", "Bash", "C++"]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Write a {lang} program that {task}, and explain how it works.",
    "Show me how to write code in {lang} that {task}. Include a test.",
]
CODE_MISC = [
    "What is the difference between a list and a set in Python?",
    "Explain what a closure is in JavaScript with an example.",
    "What does the `yield` keyword do in Python?",
    "Explain recursion with a simple code example.",
    "What is Big O notation? Give examples.",
    "Write a SQL query that returns the ten customers with the highest total orders.",
    "Explain what a race condition is and how to avoid it.",
    "How do I read a JSON file in Python?",
    "Write a regular expression that matches US phone numbers and explain it.",
    "What is the difference between git merge and git rebase?",
    "Explain object-oriented programming in simple terms.",
    "Write a Python class representing a bank account with deposit and withdraw methods.",
    "How does a hash table work?",
    "Explain the difference between a process and a thread.",
    "Write an HTML page with a form that asks for a name and an email.",
    "What is an API? Give an example.",
]

NAMES = ["Anna", "Ben", "Carlos", "Dina", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack", "Lena", "Omar"]
ITEMS = [("apples", 3), ("pencils", 2), ("books", 12), ("cookies", 1), ("marbles", 5), ("stickers", 4),
         ("tickets", 15), ("cupcakes", 3), ("notebooks", 6), ("oranges", 2)]


def _math_problems(rng: random.Random, n: int) -> list[str]:
    out = []
    for i in range(n):
        a, b = rng.sample(NAMES, 2)
        item, price = ITEMS[i % len(ITEMS)]
        x, y, z = rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)
        kind = i % 8
        if kind == 0:
            out.append(f"{a} has {x} {item}. {b} gives {a} {y} more, and then {a} gives away {z}. "
                       f"How many {item} does {a} have now? Explain step by step.")
        elif kind == 1:
            out.append(f"Each of the {item} costs ${price}. {a} buys {y} of them and pays with a ${price * y + z * 5} "
                       f"bill. How much change does {a} get?")
        elif kind == 2:
            out.append(f"A train travels at {x + 40} km per hour for {z} hours. How far does it travel? "
                       "Show your work.")
        elif kind == 3:
            out.append(f"{a} reads {y} pages a day. The book has {y * x} pages. How many days will it take "
                       f"{a} to finish the book?")
        elif kind == 4:
            out.append(f"A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?")
        elif kind == 5:
            out.append(f"{a} is {x} years old and {b} is {y} years younger. How old will {b} be in {z} years?")
        elif kind == 6:
            out.append(f"A shop sells a jacket for ${x * 5}. It is on sale for {z * 5}% off. What is the sale price?")
        else:
            out.append(f"Solve for x: {z}x + {y} = {z * x + y}. Explain each step.")
    return out


STORY_OPENINGS = [
    "The lighthouse keeper had not seen a ship in forty years, until one stormy night",
    "When Maya opened the old wooden box in her grandmother's attic, she found",
    "The robot woke up in an empty factory and realized",
    "On the first day of school, the new teacher walked in carrying a cage with",
    "The map was drawn in faded ink, and at its center was a small red X",
    "Nobody in the village believed the old fisherman when he said",
    "The spaceship's computer announced that fuel was running low, and the captain",
    "It was the last train of the night, and only two passengers were left:",
    "The dragon was tired of guarding gold and decided",
    "Every morning at seven, the bakery on the corner smelled of cinnamon, but today",
    "The detective looked at the muddy footprints and smiled, because",
    "After the power went out across the whole city,",
    "The letter arrived fifty years late, addressed to",
    "A small cat followed Leo home from the park and",
    "The scientist checked the results three times; they were impossible, yet",
    "Deep in the forest there was a door standing by itself, with no house around it.",
]
STORY_TEMPLATES = [
    "Continue this story: \"{s}\"",
    "Write a short story that begins with: \"{s}\"",
    "Continue the story in a funny way: \"{s}\"",
]

DIALOGUES = [
    "Write a dialogue between a customer and a waiter at a restaurant.",
    "Write a conversation between two friends planning a weekend trip.",
    "Write a dialogue between a teacher and a student who forgot their homework.",
    "Write a short job interview between a manager and a candidate for a barista position.",
    "Write a conversation between a doctor and a patient with a cold.",
    "Write a dialogue in which a child asks a parent why the sky is blue.",
    "Write a conversation between a tourist asking for directions and a local.",
    "Write a dialogue between two robots discussing humans.",
    "Write a phone call between a customer and tech support about a broken laptop.",
    "Write a conversation between a grandparent and a grandchild about life before smartphones.",
    "Write a debate between two students about whether homework should be banned.",
    "Write a dialogue between a shop assistant and a customer returning a pair of shoes.",
]

REWRITE_TEXTS = [
    "me and him goes to the store yesterday and buyed some milk",
    "The meeting has been moved to Thursday because the manager is sick.",
    "Our product is very good and you should buy it because it is good.",
    "I am writing to complain about the late delivery of my order, which arrived two weeks after the promised date.",
    "The cat sat on the mat and looked at the bird outside the window.",
    "Due to unforeseen circumstances, the event is cancelled.",
    "hey can u send me the report asap thx",
    "Exercise improves mood, sleep, and energy, and it lowers the risk of many diseases.",
    "The city council approved a new budget that increases funding for parks and public transport.",
    "It was a dark and stormy night, and the wind howled through the trees.",
]
REWRITE_TEMPLATES = [
    "Rewrite this sentence in a more formal tone: \"{x}\"",
    "Fix the grammar in this text: \"{x}\"",
    "Rewrite this so a child can understand it: \"{x}\"",
    "Translate this into French: \"{x}\"",
    "Summarize this in a few words: \"{x}\"",
    "Make this text more enthusiastic: \"{x}\"",
]

QUESTIONS = [
    "What is the capital of Australia?", "How many continents are there? Name them.",
    "Why do leaves change color in autumn?", "How do airplanes stay in the air?",
    "What causes rainbows?", "Who wrote Romeo and Juliet, and what is it about?",
    "How does a refrigerator work?", "Why is the ocean salty?", "What is the speed of light?",
    "How do I make a cup of tea?", "What should I pack for a week-long camping trip?",
    "How can I improve my sleep?", "What are some tips for a job interview?",
    "How do I start learning to play the guitar?", "What is a healthy breakfast?",
    "How do vaccines work?", "Why do we have seasons?", "How does the heart pump blood?",
    "What is the difference between weather and climate?", "How do I change a flat tire?",
    "What are good habits for studying?", "How can I save money each month?",
    "What is the tallest mountain in the world?", "Why do cats purr?",
    "How do bees make honey?", "What is the Pythagorean theorem?", "How do I write a good resume?",
    "What are the planets in our solar system?", "How does recycling help the environment?",
    "Give me a recipe for pancakes.", "Plan a three-day trip to Paris.",
    "Suggest five names for a pet goldfish.", "Write a thank-you note to a friend who helped me move.",
    "Write an email asking my boss for a day off.", "Give me ideas for a birthday party for a seven-year-old.",
    "Write a haiku about the rain.", "Tell me a joke about computers.", "Write a limerick about a cat.",
    "What are the rules of chess, briefly?", "Describe a sunset to someone who has never seen one.",
]


# Topics named by single words of the target's own vocabulary: thousands of them, so that no topic
# recurs across many prompts. With only TOPICS (86, each under 20 templates) a head learnt replies
# about those topics: 0.51 top-1 on held-apart prompts over the same topics, 0.28 on new ones.
WORD_TEMPLATES = [
    "Tell me about {w}.",
    "Explain {w} to a beginner.",
    "What does the word \"{w}\" mean? Use it in two sentences.",
    "Write a short story in which {w} plays a part.",
    "Write a blog post about {w}.",
    "Write a short poem inspired by the word \"{w}\".",
    "Give me three practical tips related to {w}.",
    "Write a product description for something called \"{W}\".",
    "Pretend you are an expert on {w}. What do most people get wrong about it?",
    "Draft a short email to a colleague about {w}.",
    "Write a persuasive paragraph about {w}.",
    "Describe a day in the life of someone whose work involves {w}.",
    "Write a news headline and a short article about {w}.",
    "Ask and answer three questions about {w}.",
    "Write a dialogue between two people who disagree about {w}.",
    "Why might someone care about {w}? Answer in a few sentences.",
    "Write a speech for a school assembly about {w}.",
    "Describe {w} as if to someone from the year 1800.",
]
WORD2_TEMPLATES = [
    "Write a short story that includes {a} and {b}.",
    "Compare {a} and {b}.",
    "What do {a} and {b} have in common?",
    "Write a funny dialogue about {a} and {b}.",
    "Explain how {a} could be connected to {b}.",
]


def vocabulary_words(tokenizer, min_len: int = 6, max_len: int = 14) -> list[str]:
    """Whole lowercase English-looking words of a tokenizer's vocabulary (a token that is a space
    and letters), sorted: a target's own topic list, with no data set. Empty for tokenizers whose
    pieces do not mark a leading space."""
    words = set()
    for piece in tokenizer.get_vocab():
        if piece[:1] in ("\u0120", "\u2581"):  # byte-level BPE's "Ġ", SentencePiece's "▁"
            w = piece[1:]
            if min_len <= len(w) <= max_len and w.isascii() and w.isalpha() and w.islower():
                words.add(w)
    return sorted(words)


def _word_prompts(rng: random.Random, words: list[str]) -> list[str]:
    """One prompt per word (every fifth over a pair of words), in a seeded order."""
    pool = list(words)
    rng.shuffle(pool)
    out, i = [], 0
    while i < len(pool):
        if len(out) % 5 == 4 and i + 1 < len(pool):
            out.append(rng.choice(WORD2_TEMPLATES).format(a=pool[i], b=pool[i + 1]))
            i += 2
        else:
            w = pool[i]
            out.append(rng.choice(WORD_TEMPLATES).format(w=w, W=w.capitalize()))
            i += 1
    return out


def _families(seed: int, words: list[str] | None = None) -> list[list[str]]:
    rng = random.Random(seed)
    topic = [tpl.format(t=t) for t in TOPICS for tpl in TOPIC_TEMPLATES]
    compare = [tpl.format(a=a, b=b) for a, b in COMPARE_PAIRS for tpl in COMPARE_TEMPLATES]
    code = [tpl.format(lang=lang, task=task) for i, task in enumerate(CODE_TASKS)
            for j, tpl in enumerate(CODE_TEMPLATES) for lang in [CODE_LANGS[(i + 3 * j) % len(CODE_LANGS)]]]
    code += CODE_MISC
    math = _math_problems(rng, 120)
    story = [tpl.format(s=s) for s in STORY_OPENINGS for tpl in STORY_TEMPLATES]
    rewrite = [tpl.format(x=x) for x in REWRITE_TEXTS for tpl in REWRITE_TEMPLATES]
    fams = [topic, compare, code, math, story, list(DIALOGUES), rewrite, list(QUESTIONS)]
    for f in fams:
        rng.shuffle(f)
    if words:
        fams.append(_word_prompts(rng, words))
    return fams


# how many of each family per round of interleaving (the mix any prefix of the list has):
# topics, compare, code, math, story, dialogue, rewrite, questions (and words, when given)
MIX = (8, 1, 3, 2, 1, 1, 1, 2)
MIX_WORDS = (2, 1, 3, 2, 1, 1, 1, 2, 6)


def training_prompts(seed: int = 0, words: list[str] | None = None) -> list[str]:
    """Every prompt of the set, deterministically ordered so that any prefix mixes the families in
    the proportions of MIX (topics 8 : compare 1 : code 3 : math 2 : story 1 : dialogue 1 :
    rewrite 1 : questions 2; about 2,400 prompts), or with `words` (vocabulary_words) of MIX_WORDS,
    where word topics take 6 of the topics' 8 shares; then the remainders."""
    fams = [list(f) for f in _families(seed, words)]
    out, seen = [], set()
    while any(fams):
        for f, k in zip(fams, MIX_WORDS if words else MIX):
            for _ in range(k):
                if f:
                    p = f.pop(0)
                    if p not in seen:
                        seen.add(p)
                        out.append(p)
    return out


def is_validation(index: int, every: int = 10) -> bool:
    """The held-apart split, by prompt: every `every`-th prompt of the list."""
    return index % every == every - 1


# ---- the second round: tasks over the target's own text ---------------------------------
# Summarising, translating, extracting and answering from a given text mostly copy from it. A head
# trained only on free replies never learns to copy, so a second round gives the target passages to
# work on: its own first-round replies (no outside text), one or two per prompt.

CONTEXT_TEMPLATES = [
    "Summarize the following text in two sentences.\n\n{p}",
    "Summarize: {p}",
    "Write a one-paragraph summary of this article:\n\n{p}",
    "Translate the following text into French:\n\n{p}",
    "Translate into German: {p}",
    "Translate this text into Spanish.\n\n{p}",
    "Extract the key facts from this text as a bulleted list.\n\n{p}",
    "List every name, number and technical term that appears in the text below.\n\n{p}",
    "Read the passage and answer: what is its main point?\n\nPassage: {p}",
    "Answer using only the information in the context.\nContext: {p}\nQuestion: What are the two most important details mentioned?",
    "Rewrite the following text in a more formal tone:\n\n{p}",
    "Rewrite this for a ten-year-old reader:\n\n{p}",
    "Give this text a title, then a one-sentence summary.\n\n{p}",
    "Here is a draft. Improve its wording without changing its meaning.\n\n{p}",
    "Based on the following notes, write a short email to a colleague.\n\nNotes: {p}",
    "Turn this text into three quiz questions with answers.\n\n{p}",
    "Rate how clear the following text is on a scale of 1 to 5 and explain your rating.\n\n{p}",
    "Continue this text for one more paragraph.\n\n{p}",
    "Quote the sentence from this text that best states its main idea, then explain why.\n\n{p}",
    "Convert the following text into a JSON object with the keys \"topic\", \"summary\" and \"keywords\".\n\n{p}",
]
CONTEXT2_TEMPLATES = [
    "Use the two documents below to answer the question.\n\nDocument 1: {p}\n\nDocument 2: {q}\n\n"
    "Question: What do these documents have in common?",
    "Compare the following two texts and say which one is easier to read.\n\nText A: {p}\n\nText B: {q}",
    "Summarize both passages in one paragraph.\n\nPassage 1: {p}\n\nPassage 2: {q}",
]


def context_prompts(passages: list[tuple[int, str]], first_index: int, count: int, seed: int = 0,
                    every: int = 10) -> list[str]:
    """`count` second-round prompts, numbered from `first_index` on, over first-round replies
    (index, text). Prompt i uses only passages from the same split as itself (is_validation), so
    a held-apart reply never appears in a training sequence. Deterministic in its arguments."""
    rng = random.Random(seed * 7_919 + 17)
    split = {True: [t for i, t in passages if is_validation(i, every)],
             False: [t for i, t in passages if not is_validation(i, every)]}
    out = []
    for j in range(count):
        pool = split[is_validation(first_index + j, every)]
        if not pool:
            raise ValueError("no first-round replies in one of the splits to build second-round prompts from")
        if j % 8 == 7 and len(pool) > 1:
            a, b = rng.sample(pool, 2)
            out.append(rng.choice(CONTEXT2_TEMPLATES).format(p=a, q=b))
        else:
            out.append(rng.choice(CONTEXT_TEMPLATES).format(p=rng.choice(pool)))
    return out
