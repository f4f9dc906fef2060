"""A tiny random-weights Llama with a locally trained tokenizer, built offline.

Nothing comes from a hub: the tokenizer is a byte-level BPE trained on a
corpus generated here, the weights are drawn from a seeded generator. The
result is cached under ``.cache/models/`` keyed by every parameter, so a second
call with the same parameters is instant and gives the same files.

The default (4 attention heads, K=1 KV head) lets TP 1 and 2 reach the
GQA-replication regime: at TP 2 each rank has 2 query heads but K=1 < 2, so the
single KV head is replicated.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.core.cache import build_cached
from harness.core.paths import CACHE_ROOT

DEFAULT_CACHE = CACHE_ROOT / "models"
BUILDER_VERSION = 2  # bump when the recipe changes, so caches are rebuilt

_WORDS = (
    "the a one two three four five six seven eight nine ten red blue green cat dog bird tree river "
    "stone house city road cloud rain sun moon star light dark fast slow big small old new first last "
    "north south east west paris rome berlin london tokyo water fire earth wind gold silver iron "
    "apple bread milk cheese book page word number answer question sum total plus minus times equals "
    "is are was were has have had will can may and or but if then so because when where who what how"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    kv_heads: int = 1
    heads: int = 4
    layers: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 1024
    max_positions: int = 2048
    init_std: float = 0.1  # larger than usual so greedy choices have clear margins
    seed: int = 0

    def validate(self) -> None:
        for name in ("kv_heads", "heads", "layers", "head_dim", "intermediate", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.vocab < 300:
            raise ValueError("vocab must be >= 300 (byte-level alphabet plus merges)")

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "builder": BUILDER_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def dirname(self) -> str:
        return f"tiny-llama-h{self.heads}-k{self.kv_heads}-l{self.layers}-d{self.head_dim}-{self.key()}"


def corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.5:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return lines


def train_tokenizer(spec: TinyModelSpec, out: Path, lines: list[str] | None = None) -> int:
    """A byte-level BPE trained on ``lines`` (default: the generated corpus); returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=spec.seed) if lines is None else lines, trainer=trainer)
    # No BOS post-processor: a one-word prompt is then a one-token prompt.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.model_max_length = spec.max_positions
    # A plain template, so /v1/chat/completions works against the tiny model too.
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def build_model(spec: TinyModelSpec, vocab_size: int):
    """The Llama of ``spec`` with seeded random weights, float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.heads * spec.head_dim,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(config).to(torch.float32)


def write_model(spec: TinyModelSpec, out: Path, vocab_size: int) -> None:
    build_model(spec, vocab_size).save_pretrained(out, safe_serialization=True)


def is_built(folder: Path) -> bool:
    return all((Path(folder) / f).exists() for f in ("model.safetensors", "tokenizer.json", "harness_tiny_model.json"))


def ensure_tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return the cached model folder for ``spec``, building it first if needed (once, atomically; see build_cached)."""
    spec.validate()

    def build(tmp: Path) -> None:
        vocab_size = train_tokenizer(spec, tmp)
        write_model(spec, tmp, vocab_size)
        (tmp / "harness_tiny_model.json").write_text(json.dumps({**asdict(spec), "builder": BUILDER_VERSION}, indent=2))

    return build_cached(Path(cache_dir) / spec.dirname(), is_built, build)


def export(spec: TinyModelSpec, out: Path, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Build (or reuse) the cached model and copy it to ``out``."""
    src = ensure_tiny_model(spec, cache_dir)
    out = Path(out)
    if out.resolve() == src.resolve():
        return out
    if out.exists() and any(out.iterdir()):
        existing = out / "harness_tiny_model.json"
        if not existing.exists() or json.loads(existing.read_text()) != json.loads((src / "harness_tiny_model.json").read_text()):
            raise FileExistsError(f"{out} exists and holds something else; choose an empty folder")
        return out
    shutil.copytree(src, out, dirs_exist_ok=True)
    return out
