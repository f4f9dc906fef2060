import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from harness.tasks.gsm8k_offline import TaskSpec, answer_number, ensure_task, render_prompt, splits, write_task

SMALL = TaskSpec(n_train=40, n_test=30)
ANSWER = re.compile(r"^(\w+) has (\d+) (\w+)\.\n#### (\d+)$")
QUESTION = re.compile(r"^(\w+) has (.+)\. How many (\w+) does \1 have\?$")


def asked_count(question: str) -> tuple[str, str, int]:
    """(name, item, count) that the question asks for, parsed from its own text."""
    asked = QUESTION.match(question)
    assert asked is not None, question
    name, facts, item = asked.groups()
    counts = {it: int(n) for n, it in re.findall(r"(\d+) (\w+)", facts)}
    return name, item, counts[item]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_spec_same_bytes_other_seed_other_data(tmp_path):
    a, b = write_task(SMALL, tmp_path / "a"), write_task(SMALL, tmp_path / "b")
    for name in ("train.jsonl", "test.jsonl"):
        assert (a.parent / name).read_bytes() == (b.parent / name).read_bytes()
    # The YAMLs differ only in the folder they name.
    assert a.read_text().replace(str(a.parent.resolve()), "X") == b.read_text().replace(str(b.parent.resolve()), "X")
    other = splits(TaskSpec(n_train=40, n_test=30, seed=1))
    assert other["test"] != splits(SMALL)["test"]


@pytest.mark.parametrize("spec", [SMALL, TaskSpec(n_train=40, n_test=30, min_items=2, max_items=4)])
def test_every_answer_is_the_count_the_question_asks(spec):
    data = splits(spec)
    assert [len(data["train"]), len(data["test"])] == [40, 30]
    for ex in data["train"] + data["test"]:
        name, item, count = asked_count(ex["question"])
        m = ANSWER.match(ex["answer"])
        assert m, ex
        assert m.groups() == (name, str(count), item, str(count))
        assert answer_number(ex["answer"]) == str(count)
    assert not {e["question"] for e in data["train"]} & {e["question"] for e in data["test"]}


def test_answers_need_the_question():
    # A constant or few-shot-copied guess must not score: the counts vary.
    data = splits(TaskSpec())
    answers = [answer_number(e["answer"]) for e in data["test"]]
    assert max(answers.count(a) for a in set(answers)) / len(answers) < 0.05
    shots = {answer_number(e["answer"]) for e in data["train"][:3]}
    assert sum(a in shots for a in answers) / len(answers) < 0.1


def test_yaml_names_absolute_data_files_and_builtin_gsm8k_settings(tmp_path):
    path = write_task(SMALL, tmp_path / "task")
    cfg = yaml.safe_load(path.read_text())
    files = cfg["dataset_kwargs"]["data_files"]
    assert cfg["dataset_path"] == "json" and set(files) == {"train", "test"}
    for split, f in files.items():
        assert Path(f).is_absolute() and Path(f) == (tmp_path / "task" / f"{split}.jsonl").resolve()
        assert read_jsonl(Path(f)) == splits(SMALL)[split]
    assert cfg["task"] == "gsm8k_offline" and cfg["output_type"] == "generate_until"
    assert cfg["doc_to_text"] == "Question: {{question}}\nAnswer:" and cfg["doc_to_target"] == " {{answer}}"
    assert cfg["generation_kwargs"] == {"until": ["Question:", "</s>", "\n\n"], "do_sample": False, "temperature": 0.0}
    assert (
        cfg["fewshot_split"] == "train" and cfg["fewshot_config"] == {"sampler": "first_n"} and cfg["num_fewshot"] == 3
    )
    strict = cfg["filter_list"][0]
    assert strict["name"] == "strict-match" and strict["filter"][0]["regex_pattern"] == r"#### (\-?[0-9\.\,]+)"
    assert cfg["metric_list"][0]["metric"] == "exact_match"


def test_ensure_task_is_cached_and_names_its_final_folder(tmp_path):
    folder = ensure_task(SMALL, tmp_path)
    cfg = yaml.safe_load((folder / "gsm8k_offline.yaml").read_text())
    assert Path(cfg["dataset_kwargs"]["data_files"]["test"]) == folder / "test.jsonl"
    before = hashlib.sha256((folder / "test.jsonl").read_bytes()).hexdigest()
    assert ensure_task(SMALL, tmp_path) == folder
    assert hashlib.sha256((folder / "test.jsonl").read_bytes()).hexdigest() == before
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no build folder left behind
    assert ensure_task(TaskSpec(n_train=41, n_test=30), tmp_path) != folder


def test_lm_eval_renders_the_expected_few_shot_prompt_and_scores_the_number(tmp_path):
    from lm_eval.tasks import TaskManager

    write_task(SMALL, tmp_path / "task")
    # Only the include_path: indexing lm-eval's builtin tasks takes seconds.
    manager = TaskManager(include_path=str(tmp_path / "task"), include_defaults=False)
    task = manager.load(["gsm8k_offline"])["tasks"]["gsm8k_offline"]
    task.build_all_requests(limit=2, rank=0, world_size=1)
    data = splits(SMALL)
    prompt, gen = task.instances[0].args
    assert prompt == render_prompt(data["train"][:3], data["test"][0])
    ex = data["train"][0]
    assert prompt.startswith(f"Question: {ex['question']}\nAnswer: {ex['answer']}\n\nQuestion: ")
    assert prompt.endswith(f"Question: {data['test'][0]['question']}\nAnswer:")
    assert gen["until"] == ["Question:", "</s>", "\n\n"]
    doc = task.dataset["test"][0]
    right = answer_number(doc["answer"])
    assert right is not None
    assert task.process_results(doc, [right]) == {"exact_match": 1.0}
    assert task.process_results(doc, [str(int(right) + 1)]) == {"exact_match": 0.0}
