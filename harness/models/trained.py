"""A tiny Llama trained on CPU on the offline GSM8K-format task.

A random-weights model scores 0 through P/D and through the baseline alike,
which proves nothing about the KV transfer. This model answers the
``gsm8k_offline`` questions by copying the count stated in the question it is
asked (the few-shot examples before it state other counts), which needs that
question's KV, so a decode side reading a corrupted KV cache loses score.

Conventions follow ``harness.models.tiny``: the architecture is a
``TinyModelSpec`` (default 4 attention heads, K=1 KV head, so TP 2 reaches GQA
replication), the tokenizer is a byte-level BPE trained here (on the task's
text, so every name, item and number 2..99 is one token and copying a number
is copying one token), and the folder is cached under ``.cache/models/`` keyed by
every parameter, built beside its target and renamed.

Training is seeded and uses deterministic algorithms; it runs on sequences
rendered exactly as lm-eval renders the prompts (few-shot examples from the
train split, then a question and its answer) with the loss on the answers.
Bit-identical weights are expected for the same parameters, torch build and
thread count; float summation order may differ elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.core.argtypes import HarnessArgumentParser
from harness.core.cache import build_cached
from harness.models.tiny import DEFAULT_CACHE, TinyModelSpec, build_model, train_tokenizer
from harness.tasks.gsm8k_offline import (
    FEWSHOT_DELIMITER,
    GENERATOR_VERSION,
    UNTIL,
    TaskSpec,
    answer_number,
    question_space,
    render_example,
    render_prompt,
    splits,
    stream,
)

# The name the trained model is served under; it marks a run whose accuracy baseline must be meaningful.
TRAINED_NAME = "tiny-llama-trained"
TRAINER_VERSION = 2  # bump when the recipe changes, so caches are rebuilt
META_FILE = "harness_trained_model.json"
DEFAULT_TASK = TaskSpec()  # the offline task at its defaults (a frozen dataclass, shared)


def default_arch() -> TinyModelSpec:
    # head_dim 32 is the smallest head size vLLM's CPU attention supports.
    return TinyModelSpec(kv_heads=1, heads=4, layers=2, head_dim=32, intermediate=512, vocab=1024, init_std=0.02)


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 400  # 1.0 held-out accuracy was reached after 300; the rest is margin
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    # Most sequences get a random number (0..max_shots) of random train
    # examples as shots, so the model copies from the last question rather
    # than memorising one context; the rest get lm-eval's exact first_n prefix.
    max_shots: int = 6
    exact_prefix_share: float = 0.2
    # One thread: on a busy 2-core box two OpenMP threads ran 2-3x slower
    # (they spin on each other), and it fixes the summation order.
    threads: int = 1
    seed: int = 0


@dataclass(frozen=True)
class TrainedModelSpec:
    arch: TinyModelSpec = field(default_factory=default_arch)
    task: TaskSpec = field(default_factory=TaskSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    eval_limit: int | None = None  # test examples scored after training (None: the whole test split)

    def validate(self) -> None:
        self.arch.validate()
        self.task.validate()
        if min(self.train.steps, self.train.batch_size, self.train.threads) < 1 or self.train.max_shots < 0:
            raise ValueError("steps, batch_size and threads must be >= 1, max_shots >= 0")
        if not 0.0 <= self.train.exact_prefix_share <= 1.0:
            raise ValueError("exact_prefix_share must be in [0, 1]")
        space = question_space(self.task.min_items, self.task.max_items)
        if 2 * (self.train.steps * self.train.batch_size + self.task.n_test) > space:
            raise ValueError("steps * batch_size is too large for the task's question space")

    def key(self) -> str:
        # The generator version too: the training text comes from it.
        blob = json.dumps(
            {**asdict(self), "arch": self.arch.record(), "trainer": TRAINER_VERSION, "generator": GENERATOR_VERSION},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def dirname(self) -> str:
        a = self.arch
        return f"trained-llama-h{a.heads}-k{a.kv_heads}-l{a.layers}-d{a.head_dim}-{self.key()}"


# ---------------------------------------------------------------- tokenizer


def tokenizer_corpus(task: TaskSpec, n: int = 3000) -> list[str]:
    """Task text for the tokenizer (rendered examples from a stream of its own), plus the text of
    the harness's fixed prompt set, so that its words are single tokens here too: a one-word
    prompt stays a one-token prompt and the longest prompt fits the CPU context."""
    from harness.workload.prompts import prompt_set

    it = stream(task.seed, "tokenizer", task.min_items, task.max_items)
    # A few examples per line, joined as in a prompt, so "\n\n" is always
    # followed by text there, as it is in every prompt.
    examples = [FEWSHOT_DELIMITER.join(render_example(next(it), True) for _ in range(3)) for _ in range(n // 3)]
    return examples + [p.text for seed in range(10) for p in prompt_set(seed)]


# ---------------------------------------------------------------- training data


def _answer_spans(text: str) -> list[tuple[int, int]]:
    # Each answer runs from the space after "Answer:" to the end of its
    # "#### N" line plus the following delimiter (so the model learns to stop).
    return [(m.start(1), m.end(1)) for m in re.finditer(r"Answer:( [^\n]*\n#### -?\d+(?:\n\n)?)", text)]


def training_texts(spec: TrainedModelSpec) -> list[str]:
    """Every training sequence, in order: few-shot prompt + question + answer + delimiter."""
    t, task = spec.train, spec.task
    data = splits(task)
    train, test_q = data["train"], [e["question"] for e in data["test"]]
    fresh = stream(task.seed, f"model-train-{t.seed}", task.min_items, task.max_items, exclude=test_q)
    rng = random.Random(f"trained_model:{t.seed}")
    texts = []
    for _ in range(t.steps * t.batch_size):
        ex = next(fresh)
        if rng.random() < t.exact_prefix_share:
            shots = train[: task.num_fewshot]  # what lm-eval's first_n sampler sends
        else:
            shots = rng.sample(train, rng.randint(0, min(t.max_shots, len(train))))
        # The trailing "Question:" makes the delimiter tokenize as it does
        # between examples; it is the stop string, so it gets no loss.
        texts.append(render_prompt(shots, ex) + " " + ex["answer"] + FEWSHOT_DELIMITER + "Question:")
    return texts


def encode(tokenizer, text: str) -> tuple[list[int], list[bool]]:
    """Token ids and, per token, whether it is part of an answer (gets loss)."""
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    spans = _answer_spans(text)
    mask = [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def _batch(rows: list[tuple[list[int], list[bool]]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (tok, mask) in enumerate(rows):
        n = len(tok)
        ids[i, :n] = torch.tensor(tok)
        attn[i, :n] = 1
        labels[i, :n] = torch.tensor([t if m else -100 for t, m in zip(tok, mask, strict=True)])
    return ids, attn, labels


# ---------------------------------------------------------------- model


@dataclass(frozen=True)
class TrainResult:
    seconds: float
    steps: int
    final_loss: float  # mean answer-token loss over the last 10% of steps
    losses: list[float]


def _lr(step: int, t: TrainSpec) -> float:
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    progress = (step - t.warmup) / max(1, t.steps - t.warmup)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@contextmanager
def torch_settings(threads: int):
    """Deterministic algorithms and a fixed thread count, restored afterwards."""
    import torch

    old = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(old[0])
        torch.use_deterministic_algorithms(old[1])


def train(spec: TrainedModelSpec, model, tokenizer, log_every: int = 50) -> TrainResult:
    import torch

    t = spec.train
    torch.manual_seed(t.seed)
    rows = [encode(tokenizer, s) for s in training_texts(spec)]
    # No weight decay on norms (the only 1-d parameters of a Llama).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(0.9, 0.98),
    )
    model.train()
    losses: list[float] = []
    start = time.monotonic()
    for step in range(t.steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, t)
        ids, attn, labels = _batch(rows[step * t.batch_size : (step + 1) * t.batch_size], tokenizer.eos_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(
                f"step {step + 1}/{t.steps} loss {sum(losses[-log_every:]) / log_every:.4f} "
                f"{time.monotonic() - start:.0f}s",
                flush=True,
            )
    seconds = time.monotonic() - start
    model.eval()
    tail = losses[-max(1, t.steps // 10) :]
    return TrainResult(seconds=seconds, steps=t.steps, final_loss=sum(tail) / len(tail), losses=losses)


# ---------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    correct: int
    n: int
    seconds: float
    samples: list[dict[str, str]]  # prompt-free: question, target, completion


def cut_at_stops(text: str, until: list[str] = UNTIL) -> str:
    """The completion as lm-eval keeps it: up to the first stop sequence."""
    cut = len(text)
    for s in until:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def greedy_accuracy(
    model_dir: Path,
    task: TaskSpec = DEFAULT_TASK,
    limit: int | None = None,
    batch_size: int = 25,
    max_new_tokens: int = 24,
) -> EvalResult:
    """Greedy strict-match accuracy on the test split with lm-eval's exact few-shot prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    return evaluate(model, tokenizer, task, limit, batch_size, max_new_tokens)


def evaluate(
    model, tokenizer, task: TaskSpec, limit: int | None = None, batch_size: int = 25, max_new_tokens: int = 24
) -> EvalResult:
    import torch

    data = splits(task)
    shots, docs = data["train"][: task.num_fewshot], data["test"][:limit]
    start = time.monotonic()
    samples = []
    model.eval()
    for i in range(0, len(docs), batch_size):
        chunk = docs[i : i + batch_size]
        # Left padding, so every prompt in the batch ends at the same position
        # and generation continues all of them at once.
        enc = [tokenizer(render_prompt(shots, d), add_special_tokens=False)["input_ids"] for d in chunk]
        width = max(map(len, enc))
        ids = torch.tensor([[tokenizer.eos_token_id] * (width - len(e)) + e for e in enc])
        attn = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        for d, row in zip(chunk, out[:, width:], strict=True):
            completion = cut_at_stops(tokenizer.decode(row, skip_special_tokens=True))
            samples.append(
                {"question": d["question"], "target": answer_number(d["answer"]) or "", "completion": completion}
            )
    correct = sum(answer_number(s["completion"]) == s["target"] for s in samples)
    return EvalResult(
        accuracy=correct / max(1, len(samples)),
        correct=correct,
        n=len(samples),
        seconds=time.monotonic() - start,
        samples=samples,
    )


# ---------------------------------------------------------------- cache


def is_built(folder: Path) -> bool:
    return (
        (folder / "model.safetensors").exists()
        and (folder / "tokenizer.json").exists()
        and (folder / META_FILE).exists()
    )


def build(spec: TrainedModelSpec, out: Path, log_every: int = 50) -> dict:
    """Train and save into ``out``; return what goes into the metadata file."""
    import torch
    from transformers import AutoTokenizer

    vocab_size = train_tokenizer(spec.arch, out, tokenizer_corpus(spec.task))
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch_settings(spec.train.threads):
        model = build_model(spec.arch, vocab_size)
        result = train(spec, model, tokenizer, log_every)
        print(
            f"training: {result.steps} steps in {result.seconds:.1f}s, final loss {result.final_loss:.4f}", flush=True
        )
        ev = evaluate(model, tokenizer, spec.task, spec.eval_limit)
    print(f"held-out greedy accuracy {ev.accuracy:.3f} ({ev.correct}/{ev.n}) in {ev.seconds:.1f}s", flush=True)
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    meta = {
        "spec": asdict(spec),
        "trainer": TRAINER_VERSION,
        "generator": GENERATOR_VERSION,
        "train_seconds": round(result.seconds, 1),
        "steps": result.steps,
        "final_train_loss": round(result.final_loss, 5),
        "heldout_accuracy": ev.accuracy,
        "heldout_correct": ev.correct,
        "heldout_n": ev.n,
        "torch": torch.__version__,
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def ensure_trained_model(
    spec: TrainedModelSpec = TrainedModelSpec(), cache_dir: Path = DEFAULT_CACHE, log_every: int = 50
) -> Path:
    """Return the cached trained model folder for ``spec``, training it first if needed."""
    spec.validate()
    # Trained once even when two runs ask at the same time; never seen half-written (see core.cache.build_cached).
    return build_cached(Path(cache_dir) / spec.dirname(), is_built, lambda tmp: build(spec, tmp, log_every))


def read_meta(folder: Path) -> dict:
    return json.loads((Path(folder) / META_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    p = HarnessArgumentParser(description="Train (or reuse) the tiny model for the gsm8k_offline task.")
    p.add_argument("--kv-heads", type=int, default=default_arch().kv_heads)
    p.add_argument("--steps", type=int, default=TrainSpec.steps)
    p.add_argument("--eval", action="store_true", help="also score the saved folder with HF greedy decoding")
    a = p.parse_args(argv)
    arch = default_arch()
    spec = TrainedModelSpec(
        arch=TinyModelSpec(**{**asdict(arch), "kv_heads": a.kv_heads}), train=TrainSpec(steps=a.steps)
    )
    path = ensure_trained_model(spec)
    print(path)
    print(json.dumps({k: v for k, v in read_meta(path).items() if k != "spec"}, sort_keys=True))
    if a.eval:
        ev = greedy_accuracy(path, spec.task, spec.eval_limit)
        print(f"HF greedy accuracy on the test split: {ev.accuracy:.3f} ({ev.correct}/{ev.n})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
