"""Tiny random-weights models (Llama by default, other families on request) with a locally trained tokenizer, built
offline.

Nothing comes from a hub: the tokenizer is a byte-level BPE trained on a
corpus generated here, the weights are drawn from a seeded generator. The
result is cached under ``.cache/models/`` keyed by every parameter, so a second
call with the same parameters is instant and gives the same files.

The default (4 attention heads, K=1 KV head) lets TP 1 and 2 reach the
GQA-replication regime: at TP 2 each rank has 2 query heads but K=1 < 2, so the
single KV head is replicated.

Other families (``TinyModelSpec.family``) have the same shape knobs plus what
makes each family different for the KV cache: q/k norms and a head_dim apart
from the hidden size (qwen3), qkv bias (qwen2), a sliding window on every layer
(mistral) or on every other layer (gemma3), MLA (deepseek_v2: one latent KV
"head" per token, replicated on every TP rank), routed experts (qwen3_moe: every MLP a mixture of 4, which
expert parallelism splits over ranks), multi-token prediction (mimo: a Qwen2 with an MTP layer whose KV P/D moves
too, models/mtp.py), and a hybrid (granitemoehybrid: Mamba2 layers, whose per-request
SSM/conv state NIXL moves apart from the attention KV, interleaved with attention layers).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness.core.cache import build_cached
from harness.core.paths import CACHE_ROOT

if TYPE_CHECKING:
    from harness.models.config import ModelEntry

DEFAULT_CACHE = CACHE_ROOT / "models"
BUILDER_VERSION = 2  # bump when the recipe changes, so caches are rebuilt

_WORDS = [
    "the",
    "a",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "red",
    "blue",
    "green",
    "cat",
    "dog",
    "bird",
    "tree",
    "river",
    "stone",
    "house",
    "city",
    "road",
    "cloud",
    "rain",
    "sun",
    "moon",
    "star",
    "light",
    "dark",
    "fast",
    "slow",
    "big",
    "small",
    "old",
    "new",
    "first",
    "last",
    "north",
    "south",
    "east",
    "west",
    "paris",
    "rome",
    "berlin",
    "london",
    "tokyo",
    "water",
    "fire",
    "earth",
    "wind",
    "gold",
    "silver",
    "iron",
    "apple",
    "bread",
    "milk",
    "cheese",
    "book",
    "page",
    "word",
    "number",
    "answer",
    "question",
    "sum",
    "total",
    "plus",
    "minus",
    "times",
    "equals",
    "is",
    "are",
    "was",
    "were",
    "has",
    "have",
    "had",
    "will",
    "can",
    "may",
    "and",
    "or",
    "but",
    "if",
    "then",
    "so",
    "because",
    "when",
    "where",
    "who",
    "what",
    "how",
]


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
    family: str = "llama"  # a key of FAMILIES
    sliding_window: int | None = None  # tokens; None: the family's default (SLIDING_DEFAULT), or none

    def __post_init__(self) -> None:
        if self.sliding_window is None and self.family in SLIDING_DEFAULT:
            object.__setattr__(self, "sliding_window", SLIDING_DEFAULT[self.family])

    def validate(self) -> None:
        for name in ("kv_heads", "heads", "layers", "head_dim", "intermediate", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.vocab < 300:
            raise ValueError("vocab must be >= 300 (byte-level alphabet plus merges)")
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.sliding_window is not None and self.family not in SLIDING_DEFAULT:
            raise ValueError(f"family {self.family} has no sliding window (only {', '.join(SLIDING_DEFAULT)})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
        if self.family in MLA_FAMILIES and self.kv_heads != self.heads:
            # MLA has no GQA: num_key_value_heads is written as the attention heads, as DeepSeek does.
            raise ValueError(f"family {self.family} (MLA) needs kv_heads == heads")
        if self.family in HYBRID_FAMILIES and self.layers < 2:
            # one Mamba2 layer and one attention layer at least, else it is no hybrid
            raise ValueError(f"family {self.family} (hybrid) needs layers >= 2")

    def record(self) -> dict:
        """The parameters that name the model (key, harness_tiny_model.json). A Llama's record has no family
        fields, so the caches built before families existed keep their keys and files."""
        d = asdict(self)
        if self.family == "llama":
            del d["family"], d["sliding_window"]
        return d

    def key(self) -> str:
        blob = json.dumps({**self.record(), "builder": BUILDER_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def dirname(self) -> str:
        window = f"-w{self.sliding_window}" if self.sliding_window else ""
        return f"tiny-{self.family}-h{self.heads}-k{self.kv_heads}-l{self.layers}-d{self.head_dim}{window}-{self.key()}"


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
    """The Llama of ``spec`` with seeded random weights, float32 (other families: build_family_model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # A repro bundle inlines this function and passes a namespace without `family` for a Llama.
    if getattr(spec, "family", "llama") != "llama":
        return build_family_model(spec, vocab_size)
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
    return LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # wraps()-typed .to() drops self


# ---------------------------------------------------------------- other families
# Each returns the transformers config of its family; the shape knobs mean what they mean for the Llama.

SLIDING_DEFAULT = {"mistral": 64, "gemma3": 64}  # small, so the harness prompts (up to ~250 tokens) cross it
MLA_FAMILIES = ("deepseek_v2",)
HYBRID_FAMILIES = ("granitemoehybrid",)
MTP_FAMILIES = ("mimo",)  # a Qwen2 with multi-token-prediction layers (models/mtp.py)
# vLLM's CPU MLA decode kernel only compiles for a 576-wide latent (kv_lora_rank 512 + rope 64, as DeepSeek).
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64


def _common(spec: TinyModelSpec, vocab_size: int) -> dict:
    return {
        "vocab_size": vocab_size,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": spec.max_positions,
        "initializer_range": spec.init_std,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def qwen3_config(spec: TinyModelSpec, vocab_size: int):
    from transformers import Qwen3Config

    # hidden size half of heads * head_dim: Qwen3's head_dim is its own setting, and this shows it is read as such.
    return Qwen3Config(
        **_common(spec, vocab_size),
        hidden_size=spec.heads * spec.head_dim // 2,
        head_dim=spec.head_dim,
        use_sliding_window=False,
    )


def qwen2_config(spec: TinyModelSpec, vocab_size: int):
    from transformers import Qwen2Config

    # Qwen2 derives head_dim from the hidden size; the qkv projections carry a bias.
    return Qwen2Config(**_common(spec, vocab_size), hidden_size=spec.heads * spec.head_dim, use_sliding_window=False)


def mistral_config(spec: TinyModelSpec, vocab_size: int):
    from transformers import MistralConfig

    return MistralConfig(
        **_common(spec, vocab_size),
        hidden_size=spec.heads * spec.head_dim,
        head_dim=spec.head_dim,
        sliding_window=spec.sliding_window,
    )


def gemma3_config(spec: TinyModelSpec, vocab_size: int):
    from transformers import Gemma3TextConfig

    # Text-only Gemma3ForCausalLM; every other layer slides (sliding first), so 2 layers hold one of each.
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)]
    return Gemma3TextConfig(
        **_common(spec, vocab_size),
        hidden_size=spec.heads * spec.head_dim,
        head_dim=spec.head_dim,
        query_pre_attn_scalar=spec.head_dim,
        sliding_window=spec.sliding_window,
        layer_types=layer_types,
    )


def deepseek_v2_config(spec: TinyModelSpec, vocab_size: int):
    from transformers import DeepseekV2Config

    # MLA without q compression (as V2-Lite); every layer dense (first_k_dense_replace = layers) keeps MoE out.
    return DeepseekV2Config(
        **_common(spec, vocab_size),
        hidden_size=spec.heads * spec.head_dim,
        q_lora_rank=None,
        kv_lora_rank=MLA_KV_LORA_RANK,
        qk_rope_head_dim=MLA_ROPE_DIM,
        qk_nope_head_dim=spec.head_dim,
        v_head_dim=spec.head_dim,
        head_dim=MLA_ROPE_DIM,
        first_k_dense_replace=spec.layers,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=64,
    )


def qwen3_moe_config(spec: TinyModelSpec, vocab_size: int):
    from transformers import Qwen3MoeConfig

    # Every layer's MLP a mixture of routed experts (no shared expert, as Qwen3-MoE): 4 experts, top 2, so expert
    # parallelism over 2 ranks places 2 on each. GQA attention as qwen3, so its KV moves as the other families' does.
    # Qwen3-MoE reads head_dim as Qwen3 does, though transformers' signature leaves it to **kwargs
    return Qwen3MoeConfig(  # type: ignore[call-arg]
        **_common(spec, vocab_size),
        hidden_size=spec.heads * spec.head_dim // 2,
        head_dim=spec.head_dim,
        use_sliding_window=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )


def granitemoehybrid_config(spec: TinyModelSpec, vocab_size: int):
    from transformers import GraniteMoeHybridConfig

    # Granite 4.0-H style, the hybrid vLLM 0.32.0 still serves (Bamba was removed in 0.23.0): Mamba2 first, then
    # attention, alternating, so 2 layers hold one of each. No experts (a dense shared MLP), RoPE on the attention
    # layers so the transferred KV is position-dependent, the usual 1/sqrt(head_dim) scale (Granite's default is 1).
    # Mamba heads are 2 x heads of head_dim each (intermediate 2 x hidden): they divide by any TP the heads divide by.
    # One B/C group, as Granite 4.0-H: vLLM replicates it on every TP rank, where NIXL's conv-state slicing errs.
    layer_types = ["attention" if i % 2 else "mamba" for i in range(spec.layers)]
    return GraniteMoeHybridConfig(
        **_common(spec, vocab_size),
        hidden_size=spec.heads * spec.head_dim,
        layer_types=layer_types,
        position_embedding_type="rope",
        attention_multiplier=spec.head_dim**-0.5,
        num_local_experts=0,
        shared_intermediate_size=spec.intermediate,
        mamba_n_heads=2 * spec.heads,
        mamba_d_head=spec.head_dim,
        mamba_expand=2,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
    )


FAMILIES = {
    "llama": None,  # build_model's own recipe
    "qwen3": qwen3_config,
    "qwen2": qwen2_config,
    "mimo": qwen2_config,  # the Qwen2 recipe; write_model adds the MTP layers
    "mistral": mistral_config,
    "gemma3": gemma3_config,
    "deepseek_v2": deepseek_v2_config,
    "qwen3_moe": qwen3_moe_config,
    "granitemoehybrid": granitemoehybrid_config,
}


def build_family_model(spec: TinyModelSpec, vocab_size: int):
    """The model of a non-Llama ``spec`` with seeded random weights, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    config_fn = FAMILIES[spec.family]
    if config_fn is None:  # the Llama: build_model's own recipe
        raise TypeError(f"{spec.family} has no family config: build_model builds it")
    config = config_fn(spec, vocab_size)
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config).to(torch.float32)


def spec_for_model_entry(entry: ModelEntry, kv_heads: int | None = None) -> TinyModelSpec:
    """The tiny model of a configs/models.yaml entry with ``hub_id: null`` (its family, heads, head_dim, window);
    ``kv_heads`` overrides the entry's K (a matrix entry's K). MLA ignores it: it has no K to choose."""
    family = entry.family or "llama"
    k = entry.attention_heads if family in MLA_FAMILIES else (kv_heads or entry.kv_heads)
    # An MLA entry's head_dim is its latent width (heads.py), not this recipe's knob.
    extra = {"head_dim": entry.head_dim} if entry.head_dim and family not in MLA_FAMILIES else {}
    return TinyModelSpec(
        kv_heads=k, heads=entry.attention_heads, family=family, sliding_window=entry.sliding_window, **extra
    )


def write_model(spec: TinyModelSpec, out: Path, vocab_size: int) -> None:
    build_model(spec, vocab_size).save_pretrained(out, safe_serialization=True)
    if spec.family in MTP_FAMILIES:  # the MTP layers transformers' Qwen2 does not know, added to its checkpoint
        from harness.models.mtp import add_mtp_layers

        add_mtp_layers(out, spec.seed)


def is_built(folder: Path) -> bool:
    return all((Path(folder) / f).exists() for f in ("model.safetensors", "tokenizer.json", "harness_tiny_model.json"))


def ensure_tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return the cached model folder for ``spec``, building it first if needed (once, atomically; see build_cached)."""
    spec.validate()

    def build(tmp: Path) -> None:
        vocab_size = train_tokenizer(spec, tmp)
        write_model(spec, tmp, vocab_size)
        (tmp / "harness_tiny_model.json").write_text(
            json.dumps({**spec.record(), "builder": BUILDER_VERSION}, indent=2)
        )

    return build_cached(Path(cache_dir) / spec.dirname(), is_built, build)


def export(spec: TinyModelSpec, out: Path, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Build (or reuse) the cached model and copy it to ``out``."""
    src = ensure_tiny_model(spec, cache_dir)
    out = Path(out)
    if out.resolve() == src.resolve():
        return out
    if out.exists() and any(out.iterdir()):
        existing = out / "harness_tiny_model.json"
        if not existing.exists() or json.loads(existing.read_text()) != json.loads(
            (src / "harness_tiny_model.json").read_text()
        ):
            raise FileExistsError(f"{out} exists and holds something else; choose an empty folder")
        return out
    shutil.copytree(src, out, dirs_exist_ok=True)
    return out
