"""An offline GSM8K-format task, generated here from a seed (no GSM8K data).

Each question states how many things a person has and asks for them:
"Ann has 37 apples. How many apples does Ann have?" with the GSM8K-style
answer "Ann has 37 apples.\n#### 37". The number (2..99) is stated only in
the question being answered, and the few-shot examples before it carry other
numbers, so answering needs that question's KV: a decode side that reads a
corrupted KV cache loses score.

``max_items`` > 1 states several counts and asks for one ("Ann has 37 apples
and 5 pears. How many pears ..."). That lookup is the stronger test, but the
tiny CPU-trained model did not learn it within its few-minute budget (about
0.3 greedy accuracy after 500-900 steps, against 1.0 for one item after 300),
so the default is one item.

``write_task`` writes the train/test JSONL splits and an lm-eval task YAML
(usable as lm-eval's ``include_path``) rendered like lm-eval's builtin gsm8k.
The same spec always gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from harness.core.argtypes import HarnessArgumentParser
from harness.core.cache import build_cached
from harness.core.paths import CACHE_ROOT

DEFAULT_CACHE = CACHE_ROOT / "tasks"
GENERATOR_VERSION = 2  # bump when the examples or the YAML change, so caches are rebuilt

NAMES = [
    "Ann",
    "Bob",
    "Carl",
    "Dana",
    "Emma",
    "Fred",
    "Gina",
    "Hugo",
    "Ivy",
    "Jack",
    "Kate",
    "Leo",
    "Mia",
    "Nick",
    "Olga",
    "Paul",
    "Rosa",
    "Sam",
    "Tina",
    "Umar",
    "Vera",
    "Will",
    "Xena",
    "Yuri",
    "Zoe",
    "Alan",
    "Beth",
    "Cody",
    "Dora",
    "Eric",
]
ITEMS = [
    "apples",
    "pears",
    "books",
    "coins",
    "cards",
    "shells",
    "stamps",
    "pens",
    "cups",
    "hats",
    "kites",
    "bells",
    "rings",
    "boxes",
    "keys",
    "socks",
    "eggs",
    "nuts",
    "plums",
    "beads",
]
MIN_N, MAX_N = 2, 99  # >= 2 so every item is plural; <= 99 so each number is one token

# lm-eval renders a few-shot example as doc_to_text + target_delimiter +
# doc_to_target; the leading space lives in doc_to_target, so the delimiter is
# empty and the result is "Answer: <answer>" exactly as builtin gsm8k renders it.
DOC_TO_TEXT = "Question: {{question}}\nAnswer:"
DOC_TO_TARGET = " {{answer}}"
TARGET_DELIMITER = ""
FEWSHOT_DELIMITER = "\n\n"
UNTIL = ["Question:", "</s>", "\n\n"]
ANSWER_REGEX = r"#### (\-?[0-9\.\,]+)"


@dataclass(frozen=True)
class TaskSpec:
    n_train: int = 300
    n_test: int = 200
    num_fewshot: int = 3
    seed: int = 0
    min_items: int = 1  # counts stated per question
    max_items: int = 1
    task_name: str = "gsm8k_offline"

    def validate(self) -> None:
        if self.n_train < self.num_fewshot or self.n_test < 1 or self.num_fewshot < 0:
            raise ValueError("need n_test >= 1, num_fewshot >= 0 and n_train >= num_fewshot")
        if not 1 <= self.min_items <= self.max_items <= min(len(ITEMS), MAX_N - MIN_N + 1):
            raise ValueError("need 1 <= min_items <= max_items <= number of distinct items")
        # Splits are drawn without repeats; leave ample room so drawing stays quick.
        if 2 * (self.n_train + self.n_test) > question_space(self.min_items, self.max_items):
            raise ValueError("n_train + n_test is too large for the question space")

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "generator": GENERATOR_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def dirname(self) -> str:
        return f"{self.task_name}-{self.key()}"


def question_space(min_items: int, max_items: int) -> int:
    """How many distinct questions the generator can produce."""
    n_num = MAX_N - MIN_N + 1
    return sum(len(NAMES) * math.perm(len(ITEMS), k) * math.perm(n_num, k) * k for k in range(min_items, max_items + 1))


def _rng(seed: int, stream: str) -> random.Random:
    # One independent, stable generator per (seed, split): string seeds of
    # random.Random are hashed with sha512, so this does not depend on PYTHONHASHSEED.
    return random.Random(f"gsm8k_offline:{seed}:{stream}")


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def make_example(rng: random.Random, min_items: int = 1, max_items: int = 1) -> dict[str, str]:
    name = rng.choice(NAMES)
    items = rng.sample(ITEMS, rng.randint(min_items, max_items))
    counts = rng.sample(range(MIN_N, MAX_N + 1), len(items))  # distinct, so the asked count is unambiguous
    asked = rng.randrange(len(items))
    facts = _join([f"{n} {item}" for n, item in zip(counts, items, strict=True)])
    question = f"{name} has {facts}. How many {items[asked]} does {name} have?"
    answer = f"{name} has {counts[asked]} {items[asked]}.\n#### {counts[asked]}"
    return {"question": question, "answer": answer}


def stream(
    seed: int, name: str, min_items: int = 1, max_items: int = 1, exclude: Iterable[str] = ()
) -> Iterator[dict[str, str]]:
    """Endless distinct examples of one named stream, skipping questions in ``exclude``."""
    rng = _rng(seed, name)
    seen = set(exclude)
    while True:
        ex = make_example(rng, min_items, max_items)
        if ex["question"] not in seen:
            seen.add(ex["question"])
            yield ex


def _take(it: Iterator[dict[str, str]], n: int) -> list[dict[str, str]]:
    return [next(it) for _ in range(n)]


def splits(spec: TaskSpec = TaskSpec()) -> dict[str, list[dict[str, str]]]:
    """The train and test splits; no test question is also a train question."""
    spec.validate()
    train = _take(stream(spec.seed, "train", spec.min_items, spec.max_items), spec.n_train)
    test = _take(
        stream(spec.seed, "test", spec.min_items, spec.max_items, exclude=[e["question"] for e in train]), spec.n_test
    )
    return {"train": train, "test": test}


def answer_number(answer: str) -> str | None:
    """The ``#### N`` number of an answer text (what strict-match extracts), or None."""
    m = re.search(ANSWER_REGEX, answer)
    return m.group(1) if m else None


def render_example(ex: dict[str, str], with_answer: bool) -> str:
    """One example as lm-eval renders it with this task's YAML."""
    text = f"Question: {ex['question']}\nAnswer:"
    return text + TARGET_DELIMITER + " " + ex["answer"] if with_answer else text


def render_prompt(fewshot: list[dict[str, str]], ex: dict[str, str]) -> str:
    """The generation prompt lm-eval sends: few-shot examples, then the question."""
    return FEWSHOT_DELIMITER.join([render_example(s, True) for s in fewshot] + [render_example(ex, False)])


def task_config(spec: TaskSpec, train_file: Path, test_file: Path) -> dict:
    """The lm-eval task config; data files are absolute so any cwd works."""
    return {
        "task": spec.task_name,
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {"train": str(Path(train_file).resolve()), "test": str(Path(test_file).resolve())}
        },
        "output_type": "generate_until",
        "training_split": "train",
        "fewshot_split": "train",
        "test_split": "test",
        "doc_to_text": DOC_TO_TEXT,
        "doc_to_target": DOC_TO_TARGET,
        "target_delimiter": TARGET_DELIMITER,
        "fewshot_delimiter": FEWSHOT_DELIMITER,
        # first_n: every prompt gets the first num_fewshot train examples, so
        # runs are comparable prompt by prompt.
        "fewshot_config": {"sampler": "first_n"},
        "num_fewshot": spec.num_fewshot,
        "generation_kwargs": {"until": list(UNTIL), "do_sample": False, "temperature": 0.0},
        "repeats": 1,
        "filter_list": [
            {
                "name": "strict-match",
                "filter": [{"function": "regex", "regex_pattern": ANSWER_REGEX}, {"function": "take_first"}],
            },
        ],
        # As builtin gsm8k: the target is reduced to its "#### N" number.
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                "ignore_punctuation": False,
                "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"],
            }
        ],
        "metadata": {"version": GENERATOR_VERSION, "seed": spec.seed, "n_train": spec.n_train, "n_test": spec.n_test},
    }


def _jsonl(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=True) + "\n" for r in rows)


def write_task(spec: TaskSpec, out: Path) -> Path:
    """Write ``train.jsonl``, ``test.jsonl`` and ``<task_name>.yaml`` into ``out``; return the YAML path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = splits(spec)
    for name, rows in data.items():
        (out / f"{name}.jsonl").write_text(_jsonl(rows))
    return write_yaml(spec, out, out / "train.jsonl", out / "test.jsonl")


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Double quotes keep "\n" visible instead of YAML's blank-line folding.
    style = '"' if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def write_yaml(spec: TaskSpec, out: Path, train_file: Path, test_file: Path) -> Path:
    cfg = task_config(spec, train_file, test_file)
    path = Path(out) / f"{spec.task_name}.yaml"
    path.write_text(yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, allow_unicode=False, width=1000))
    return path


def ensure_task(spec: TaskSpec = TaskSpec(), cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return the cached task folder for ``spec`` (an lm-eval ``include_path``), writing it first if needed."""
    spec.validate()
    target = Path(cache_dir).resolve() / spec.dirname()

    def complete(folder: Path) -> bool:
        return all((folder / f).exists() for f in ("train.jsonl", "test.jsonl", f"{spec.task_name}.yaml"))

    def build(tmp: Path) -> None:
        write_task(spec, tmp)
        # The YAML names the final paths, which exist once the rename is done.
        write_yaml(spec, tmp, target / "train.jsonl", target / "test.jsonl")

    # Written once even when two runs ask at the same time; never seen half-written (see core.cache.build_cached).
    return build_cached(target, complete, build)


def main(argv: list[str] | None = None) -> int:
    p = HarnessArgumentParser(description="Write the offline GSM8K-format task (an lm-eval include_path).")
    p.add_argument("--out", type=Path, help="folder to write; default: the cache under .cache/tasks/")
    p.add_argument("--n-train", type=int, default=TaskSpec.n_train)
    p.add_argument("--n-test", type=int, default=TaskSpec.n_test)
    p.add_argument("--num-fewshot", type=int, default=TaskSpec.num_fewshot)
    p.add_argument("--seed", type=int, default=TaskSpec.seed)
    a = p.parse_args(argv)
    spec = TaskSpec(n_train=a.n_train, n_test=a.n_test, num_fewshot=a.num_fewshot, seed=a.seed)
    if a.out:
        spec.validate()
        write_task(spec, a.out)
        print(Path(a.out).resolve())
    else:
        print(ensure_task(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
