"""The built-in prompt templates of :mod:`drafter.data.prompts`: combinatorial templates with seeded
random slots, one generator per domain (``general``, ``code``, ``math``, ``agent``). Each generator maps
a seeded ``random.Random`` to the messages of one conversation, assistant turns as placeholders
(``content: None``). Written for this project; no third-party prompt text.
"""
from __future__ import annotations

import random


_GENERAL_TOPICS = [
    "how tides are caused", "why the sky looks blue in daytime", "how a refrigerator keeps food cold",
    "what compound interest is", "how vaccines train the immune system", "why bread rises",
    "how a bicycle stays upright", "what a leap year is for", "how noise-cancelling headphones work",
    "why leaves change colour in autumn", "how a bill becomes law in a parliament",
    "what inflation means for savings", "how GPS finds your position", "why we have time zones",
    "how bees communicate", "what makes a good night's sleep", "how solar panels make electricity",
    "why some metals rust and others do not", "how a library classifies books",
    "what a carbon footprint is", "how rainbows form", "why cats purr",
    "how an elevator knows where to stop", "what the water cycle is", "how a compass works",
    "why airplanes leave white trails", "how composting turns scraps into soil",
    "what a credit score measures", "how glaciers shape valleys", "why onions make people cry",
    "how a microwave oven heats food", "what makes a password strong", "how coral reefs grow",
    "why the moon has phases", "how recycling of glass works", "what a healthy breakfast contains",
    "how a camera lens focuses", "why ice floats on water", "how public libraries are funded",
    "how earthquakes are measured",
]
_AUDIENCES = [
    "a curious ten-year-old", "a busy office worker", "a first-year university student",
    "my grandmother", "someone learning English", "a high-school science class",
    "a friend who dislikes jargon", "a new employee",
]
_GENERAL_FORMS = [
    "Explain {topic} to {audience} in {n} sentences.",
    "In plain words, tell {audience} {topic}. Keep it under {w} words.",
    "Write a short paragraph for {audience} about {topic}, ending with one surprising fact.",
    "Give {n} bullet points that summarise {topic}, written for {audience}.",
    "I have to explain {topic} to {audience} tomorrow. Suggest an analogy and a one-line summary.",
    "What is a common misconception about {topic}? Answer for {audience}.",
]
_TASKS_GENERAL = [
    "Write a polite email to {who} asking to move our meeting from {day1} to {day2}.",
    "Plan a {n}-day trip to {place} for someone who likes {hobby}. One line per day.",
    "Suggest {n} names for a small {shop} and say in a few words why each fits.",
    "Write a {form} about {thing}, in a {tone} tone.",
    "Give me {n} practical tips for {activity}.",
    "Compare {a} and {b} for {purpose}. Finish with a recommendation.",
    "Draft a short announcement telling {who} that {news}.",
    "Turn this to-do list into a schedule for {day1}: {chores}.",
]
_WHO = ["my manager", "the landlord", "a client", "the team", "my neighbour", "the school office",
        "a supplier", "the volunteers"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
_PLACES = ["a mountain village", "a coastal town", "a large capital city", "a lake district",
           "a desert national park", "an island with ferries", "a wine region", "a river valley"]
_HOBBIES = ["hiking", "museums", "street food", "photography", "cycling", "quiet cafes",
            "local markets", "birdwatching"]
_SHOPS = ["bakery", "bicycle repair shop", "bookshop", "plant nursery", "tea room",
          "pottery studio", "tailor", "secondhand furniture store"]
_FORMS = ["haiku", "four-line poem", "limerick", "short fable", "product description",
          "diary entry", "toast for a wedding", "motivational note"]
_THINGS = ["a rainy Monday", "an old lighthouse", "the first snow", "a lost umbrella",
           "a kitchen robot", "a city at night", "a stubborn cat", "the last train home"]
_TONES = ["cheerful", "wistful", "formal", "playful", "dry, understated", "dramatic"]
_ACTIVITIES = ["learning a new language", "keeping houseplants alive", "running a first 5 km",
               "saving money on groceries", "working from home", "preparing for a job interview",
               "reducing screen time", "cooking for one", "studying for exams", "decluttering a flat"]
_COMPARE = [("trains", "buses", "a daily commute"), ("paper notebooks", "note-taking apps", "students"),
            ("renting", "buying a home", "a young family"), ("e-readers", "printed books", "travel"),
            ("electric kettles", "stovetop kettles", "a small kitchen"),
            ("spreadsheets", "a database", "a club's membership list"),
            ("walking meetings", "video calls", "a small team"), ("tea", "coffee", "an afternoon break")]
_NEWS = ["the office will be closed on {day1}", "the quarterly report is delayed by a week",
         "we reached our fundraising goal", "the parking lot will be repainted on {day1}",
         "a new colleague starts on {day2}", "the heating will be off for repairs on {day1}"]
_CHORES = ["laundry", "call the bank", "buy groceries", "reply to emails", "water the plants",
           "fix the shelf", "go to the gym", "pay the electricity bill", "clean the oven",
           "book a dentist appointment"]

_LANGS = ["Python", "JavaScript", "Rust", "Go", "C", "TypeScript", "Java", "Bash"]
_CODE_TASKS = [
    "returns the {k} largest numbers of a list", "checks whether a string is a palindrome, ignoring case",
    "counts the words in a text file", "merges two sorted lists into one sorted list",
    "converts a temperature from Celsius to Fahrenheit", "removes duplicate items while keeping order",
    "parses a date in YYYY-MM-DD format and returns the weekday", "computes the nth Fibonacci number iteratively",
    "finds the longest common prefix of a list of strings", "validates that brackets in a string are balanced",
    "groups a list of words by their first letter", "returns the running average of a stream of numbers",
    "splits a list into chunks of size {k}", "flattens a nested list of integers",
    "computes the greatest common divisor of two integers", "rotates a square matrix by 90 degrees",
    "reads a CSV file and sums the values of one column", "retries a function up to {k} times with a delay",
    "turns a snake_case identifier into camelCase", "checks whether a number is prime",
    "counts how often each character occurs in a string", "returns the median of a list of numbers",
    "formats a number of bytes as a human-readable size", "finds all pairs in a list that sum to {k}",
]
_CODE_EXTRAS = ["", " Add a short docstring.", " Include two example calls.", " Keep it under 20 lines.",
                " Explain the time complexity in one sentence.", " Handle empty input gracefully.",
                " Use no external libraries."]
_CODE_FORMS = [
    "Write a {lang} function that {task}.{extra}",
    "How would you write a {lang} program that {task}? Show the code.{extra}",
    "Implement, in {lang}, a helper that {task}.{extra}",
]
_SNIPPETS = [
    ("Python", "def f(xs):\n    out = []\n    for x in xs:\n        if x % {k} == 0:\n            out.append(x * x)\n    return out"),
    ("Python", "def g(s):\n    seen = set()\n    for ch in s:\n        if ch in seen:\n            return ch\n        seen.add(ch)\n    return None"),
    ("JavaScript", "function h(arr) {\n  return arr.reduce((acc, v) => acc + (v > {k} ? v : 0), 0);\n}"),
    ("Python", "def total(prices, rate):\n    return sum(p for p in prices) * rate / {k}"),
    ("Go", "func count(xs []int) int {\n\tn := 0\n\tfor _, x := range xs {\n\t\tif x < {k} {\n\t\t\tn++\n\t\t}\n\t}\n\treturn n\n}"),
    ("Python", "def avg(xs):\n    return sum(xs) / len(xs)\n\nprint(avg([]))"),
    ("C", "int sum_to(int n) {\n    int s = 0;\n    for (int i = 0; i <= n; i++) s += i;\n    return s;\n}\n/* called with n = {k} */"),
    ("Python", "items = [{k}, 3, 8, 1]\nfor i in range(len(items)):\n    if items[i] > items[i + 1]:\n        items[i], items[i + 1] = items[i + 1], items[i]\nprint(items)"),
]
_SNIPPET_ASKS = [
    "What does this {lang} code do?", "Is there a bug in this {lang} code? If so, fix it.",
    "Rewrite this {lang} code to be clearer, and explain the change.",
    "What does this {lang} code return or print? Walk through it briefly.",
    "Add comments to this {lang} code.",
]


def _general(rng: random.Random) -> list[dict]:
    if rng.random() < 0.5:
        text = rng.choice(_GENERAL_FORMS).format(
            topic=rng.choice(_GENERAL_TOPICS), audience=rng.choice(_AUDIENCES), n=rng.randint(2, 6),
            w=rng.choice([40, 60, 80, 100, 150]))
    else:
        a, b, purpose = rng.choice(_COMPARE)
        day1, day2 = rng.sample(_DAYS, 2)
        text = rng.choice(_TASKS_GENERAL).format(
            who=rng.choice(_WHO), day1=day1, day2=day2, n=rng.randint(2, 6), place=rng.choice(_PLACES),
            hobby=rng.choice(_HOBBIES), shop=rng.choice(_SHOPS), form=rng.choice(_FORMS),
            thing=rng.choice(_THINGS), tone=rng.choice(_TONES), activity=rng.choice(_ACTIVITIES),
            a=a, b=b, purpose=purpose,
            news=rng.choice(_NEWS).format(day1=day1, day2=day2),
            chores=", ".join(rng.sample(_CHORES, rng.randint(3, 5))))
    return [{"role": "user", "content": text}, {"role": "assistant", "content": None}]


def _code(rng: random.Random) -> list[dict]:
    k = rng.randint(2, 9)
    if rng.random() < 0.65:
        text = rng.choice(_CODE_FORMS).format(
            lang=rng.choice(_LANGS), task=rng.choice(_CODE_TASKS).format(k=k), extra=rng.choice(_CODE_EXTRAS))
    else:
        lang, snippet = rng.choice(_SNIPPETS)
        fence = lang.lower()
        text = rng.choice(_SNIPPET_ASKS).format(lang=lang) + f"\n\n```{fence}\n{snippet.replace('{k}', str(k))}\n```"
    msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": None}]
    if rng.random() < 0.25:  # a short follow-up turn
        msgs += [{"role": "user", "content": rng.choice([
            "Now write a test for it.", "Can you make it shorter?", "What edge cases should I worry about?",
            "How would this look in {l}?".format(l=rng.choice(_LANGS))])}, {"role": "assistant", "content": None}]
    return msgs


_NAMES = ["Ana", "Bo", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemi", "Lior", "Mina", "Nils"]
_ITEMS = [("apples", "kg"), ("notebooks", "packs"), ("paint", "litres"), ("tiles", "boxes"), ("rope", "metres"),
          ("flour", "kg"), ("cable", "metres"), ("seeds", "bags")]


def _math(rng: random.Random) -> list[dict]:
    kind = rng.randrange(8)
    r = rng.randint
    name, other = rng.sample(_NAMES, 2)
    if kind == 0:
        d, t = r(60, 480), r(2, 8)
        text = f"A train travels {d} km in {t} hours at a constant speed. How far does it go in {r(1, 12)} hours?"
    elif kind == 1:
        a, b = r(2, 12), r(-30, 30)
        c = a * r(-10, 10) + b
        text = f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {c}. Show each step."
    elif kind == 2:
        p, price = r(5, 60), r(12, 480)
        text = f"A jacket costs {price} euros and is discounted by {p}%. What is the new price?"
    elif kind == 3:
        item, unit = rng.choice(_ITEMS)
        q1, q2, cost = r(2, 20), r(2, 20), r(2, 15)
        text = (f"{name} buys {q1} {unit} of {item} and {other} buys {q2} {unit}. One {unit[:-1] if unit.endswith('s') else unit} "
                f"costs {cost} dollars. How much do they spend together, and how much more does the bigger buyer pay?")
    elif kind == 4:
        w, h = r(3, 40), r(3, 40)
        text = rng.choice([
            f"A rectangle is {w} cm wide and {h} cm tall. What are its area and perimeter?",
            f"A circle has radius {w} m. What is its area, to two decimal places?",
            f"A right triangle has legs of {w} and {h}. How long is the hypotenuse?"])
    elif kind == 5:
        a, d = r(-10, 20), r(2, 9)
        seq = ", ".join(str(a + i * d) for i in range(4))
        text = f"What is the next number in the sequence {seq}, ...? And what is the {r(10, 50)}th term?"
    elif kind == 6:
        n = r(2, 4)
        text = rng.choice([
            f"If you roll {n} fair six-sided dice, what is the probability that all show the same number?",
            f"A bag has {r(2, 9)} red and {r(2, 9)} blue marbles. Two are drawn without replacement. "
            f"What is the probability both are red?",
            f"A fair coin is flipped {r(3, 8)} times. What is the probability of exactly {n} heads?"])
    else:
        x, y = r(11, 99), r(11, 99)
        text = rng.choice([
            f"Compute {x} × {y} step by step.", f"What is {x * y} divided by {y}? Explain briefly.",
            f"Is {x * r(2, 9) + 1} a prime number? Explain how you checked.",
            f"Convert {x * 10} minutes into hours and minutes."])
    msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": None}]
    if rng.random() < 0.3:
        msgs += [{"role": "user", "content": rng.choice([
            "Can you check that answer another way?", "Explain the same result to a child.",
            f"What if the numbers were doubled?", "Write the answer as a single sentence."])},
                 {"role": "assistant", "content": None}]
    return msgs


# Agent scenarios: (tools, task template, [tool-output templates shown in later user turns]).
_TOOLS = {
    "search_files": "search_files(pattern: str) -> list of paths matching a glob pattern",
    "read_file": "read_file(path: str) -> the text of a file",
    "run_tests": "run_tests(target: str) -> the test runner's output",
    "run_shell": "run_shell(command: str) -> stdout and exit code of a shell command",
    "sql_query": "sql_query(sql: str) -> result rows of a read-only SQL query",
    "http_get": "http_get(url: str) -> status code and body of an HTTP GET",
    "calendar_find": "calendar_find(person: str, day: str) -> free time slots",
    "calendar_book": "calendar_book(title: str, start: str, minutes: int, attendees: list) -> booking id",
    "weather": "weather(city: str, date: str) -> forecast summary",
    "send_message": "send_message(to: str, text: str) -> delivery status",
}
_AGENT_SCENARIOS = [
    (["search_files", "read_file", "run_tests"],
     "The test `test_{mod}_{fn}` started failing after yesterday's change. Find the cause and propose a fix.",
     ["TOOL RESULT run_tests:\nFAILED tests/test_{mod}.py::test_{mod}_{fn} - AssertionError: expected {a}, got {b}\n1 failed, {n} passed in {t}.2s",
      "TOOL RESULT read_file src/{mod}.py:\ndef {fn}(values):\n    total = 0\n    for v in values[1:]:\n        total += v\n    return total",
      "TOOL RESULT run_tests:\n{m} passed in {t}.9s"]),
    (["run_shell", "read_file"],
     "Our server {host} reports the disk is almost full. Find what is using the space and suggest what to clean up.",
     ["TOOL RESULT run_shell `df -h /`:\nFilesystem  Size  Used Avail Use%\n/dev/sda1   {a}G  {b}G  {c}G  9{d}%",
      "TOOL RESULT run_shell `du -sh /var/*`:\n{b2}G\t/var/log\n{c2}G\t/var/lib\n120M\t/var/cache",
      "TOOL RESULT read_file /etc/logrotate.d/app:\n/var/log/app/*.log {{\n    weekly\n    rotate {n}\n    nocompress\n}}"]),
    (["sql_query"],
     "How many orders did we ship to {country} last month, and which product sold best there?",
     ["TOOL RESULT sql_query:\ncount\n{a}",
      "TOOL RESULT sql_query:\nproduct | units\n{p1} | {b}\n{p2} | {c}\n{p3} | {d}"]),
    (["calendar_find", "calendar_book", "send_message"],
     "Set up a {m}-minute meeting with {name} and {other} on {day} about {subject}, then tell them.",
     ["TOOL RESULT calendar_find {name} {day}:\n09:00-10:30, 13:00-1{d}:00",
      "TOOL RESULT calendar_find {other} {day}:\n10:00-11:00, 14:00-16:00",
      "TOOL RESULT calendar_book:\nbooking id BK-{a}{b}, confirmed"]),
    (["weather", "send_message"],
     "I am cycling from {city} to {city2} on {day}. Check the weather for both and message {name} whether we should go.",
     ["TOOL RESULT weather {city} {day}:\n{cond1}, {t1} °C, wind {w1} km/h",
      "TOOL RESULT weather {city2} {day}:\n{cond2}, {t2} °C, wind {w2} km/h"]),
    (["http_get", "read_file"],
     "The status page says service `{svc}` is degraded. Check its health endpoint and the config, and explain what is wrong.",
     ["TOOL RESULT http_get http://{svc}.internal/health:\nstatus 503\n{{\"db\": \"timeout\", \"cache\": \"ok\", \"uptime_s\": {a}{b}}}",
      "TOOL RESULT read_file config/{svc}.yaml:\ndatabase:\n  host: db-{n}.internal\n  pool_size: {m}\n  timeout_ms: {c}"]),
    (["search_files", "read_file"],
     "Where in the repository is the {setting} setting defined, and what is its default?",
     ["TOOL RESULT search_files **/*.py:\nsrc/app.py\nsrc/settings.py\nsrc/{mod}.py\ntests/test_{mod}.py",
      "TOOL RESULT read_file src/settings.py:\nDEFAULTS = {{\n    \"{setting}\": {a},\n    \"log_level\": \"info\",\n}}"]),
    (["run_shell"],
     "Our nightly backup job on {host} did not run. Find out why.",
     ["TOOL RESULT run_shell `systemctl status backup.timer`:\ninactive (dead) since {day} 02:0{d}",
      "TOOL RESULT run_shell `journalctl -u backup --since yesterday`:\nbackup.sh: error: destination /mnt/backup not mounted\nexit status {n}"]),
]
_COUNTRIES = ["Portugal", "Kenya", "Canada", "Japan", "Chile", "Norway", "India", "Ghana"]
_PRODUCTS = ["desk lamp", "travel mug", "wool socks", "phone stand", "notebook", "water filter", "backpack"]
_SUBJECTS = ["the budget review", "onboarding", "the product launch", "hiring plans", "the office move"]
_CITIES = ["Riverton", "Hillford", "Lakeside", "Stonebridge", "Northgate", "Ashvale"]
_CONDS = ["sunny", "light rain", "overcast", "thunderstorms", "fog", "strong showers"]
_MODS = ["billing", "parser", "metrics", "auth", "export", "scheduler"]
_FNS = ["total", "sum_values", "aggregate", "accumulate"]
_SETTINGS = ["max_upload_mb", "retry_limit", "session_ttl", "page_size", "cache_seconds"]
_AGENT_STYLES = [
    "To call a tool, reply with exactly one line `CALL <tool>(<arguments>)` and nothing else. "
    "Tool results arrive in the next user message, starting with `TOOL RESULT`. When you have the answer, reply "
    "with `FINAL:` followed by the answer.",
    "Think step by step. When you need information, write `CALL <tool>(<arguments>)` on its own line. "
    "The user will paste the tool's output back to you. Give a short final answer when done.",
    "Use tools only when needed. Format a tool call as a JSON object {\"tool\": name, \"args\": {...}} on one line. "
    "Results come back as user messages beginning with `TOOL RESULT`.",
]


def _agent(rng: random.Random) -> list[dict]:
    tools, task, results = rng.choice(_AGENT_SCENARIOS)
    r = rng.randint
    name, other = rng.sample(_NAMES, 2)
    city, city2 = rng.sample(_CITIES, 2)
    p1, p2, p3 = rng.sample(_PRODUCTS, 3)
    b = r(10, 90)
    slots = dict(
        mod=rng.choice(_MODS), fn=rng.choice(_FNS), a=r(10, 999), b=b, c=r(1, 9), d=r(0, 9), n=r(2, 40),
        m=rng.choice([15, 30, 45, 60]), t=r(1, 9), b2=max(1, b - r(1, 9)), c2=r(1, 9),
        host=f"{rng.choice(['web', 'db', 'build', 'files'])}-{r(1, 20):02d}", country=rng.choice(_COUNTRIES),
        p1=p1, p2=p2, p3=p3, name=name, other=other, day=rng.choice(_DAYS), subject=rng.choice(_SUBJECTS),
        city=city, city2=city2, cond1=rng.choice(_CONDS), cond2=rng.choice(_CONDS), t1=r(-2, 30), t2=r(-2, 30),
        w1=r(0, 60), w2=r(0, 60), svc=rng.choice(["checkout", "search", "login", "reports"]),
        setting=rng.choice(_SETTINGS))
    extra = [t for t in _TOOLS if t not in tools]
    shown = list(tools) + rng.sample(extra, r(0, 2))
    rng.shuffle(shown)
    system = ("You are an assistant that completes tasks with tools.\nAvailable tools:\n"
              + "\n".join(f"- {_TOOLS[t]}" for t in shown) + "\n" + rng.choice(_AGENT_STYLES))
    n_results = r(1, len(results))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": task.format(**slots)},
            {"role": "assistant", "content": None}]
    for res in results[:n_results]:
        msgs += [{"role": "user", "content": res.format(**slots)}, {"role": "assistant", "content": None}]
    return msgs


GENERATORS = {"general": _general, "code": _code, "math": _math, "agent": _agent}
