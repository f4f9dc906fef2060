"""build_model.py of a bundle: the tiny model's recipe (harness/models/tiny.py) written out as a standalone script.

The script is generated from the recipe's own source, so the bundle builds the same model the run served
(same tokenizer corpus, same seeded weights) without importing this project. It checks the weights it
wrote against the run's: with the torch and transformers versions of the run they are byte-identical.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import pprint
from pathlib import Path

from harness.models import mtp, perturb, tiny

SPEC_FILE = "harness_tiny_model.json"  # written next to a tiny model by the recipe

HEADER = '''#!/usr/bin/env python3
"""Builds the tiny random-weights model the run served: a byte-level BPE tokenizer trained on a generated
corpus and seeded random weights (float32). Nothing is downloaded. Needs torch, transformers, tokenizers
and safetensors (the venv repro.sh makes has them).

usage: python build_model.py OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import types
from pathlib import Path

'''

FOOTER = """

def main(out: Path) -> int:
    spec = types.SimpleNamespace(**SPEC)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = train_tokenizer(spec, out)
    build_model(spec, vocab_size).save_pretrained(out, safe_serialization=True)
    if SPEC.get("family") in MTP_FAMILIES:
        add_mtp_layers(out, spec.seed)
    (out / "model_spec.json").write_text(json.dumps(SPEC, indent=2))
    got = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    if RUN_WEIGHTS_SHA256 is None:
        print(f"model: {out} (weights sha256 {got[:16]}; the run's weights were not available to compare)")
    elif got == RUN_WEIGHTS_SHA256:
        print(f"model: {out} (weights identical to the run's, sha256 {got[:16]})")
    else:
        print(f"model: {out} (weights differ from the run's: sha256 {got[:16]} vs {RUN_WEIGHTS_SHA256[:16]}; "
              "same shapes and recipe, another torch/transformers draws other random values)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
"""


def tiny_spec(model_dir: Path) -> dict | None:
    """The recipe's parameters of a tiny model folder (None: not a model the recipe built)."""
    p = Path(model_dir) / SPEC_FILE
    if not p.exists():
        return None
    spec = json.loads(p.read_text())
    spec.pop("builder", None)
    return spec


def weights_sha256(model_dir: Path) -> str | None:
    p = Path(model_dir) / "model.safetensors"
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None


def builder_script(spec: dict, run_weights_sha256: str | None) -> str:
    """The standalone script's text: the recipe's corpus, tokenizer and model functions with the run's parameters."""
    parts = [
        HEADER,
        f"SPEC = {pprint.pformat(spec, indent=4)}\n",  # a Python literal (a JSON null is not one)
        f"RUN_WEIGHTS_SHA256 = {run_weights_sha256!r}\n",
        f"_WORDS = {list(tiny._WORDS)!r}\n\n",
    ]
    for fn in (tiny.corpus, tiny.train_tokenizer, tiny.build_model):
        parts.append("\n" + inspect.getsource(fn))
    family = spec.get("family", "llama")
    if family != "llama":  # the family's own config recipe, and what build_model hands it to
        config_fn = tiny.FAMILIES[family]
        assert config_fn is not None  # only the Llama has no config recipe of its own
        parts.append(f"\n\nMLA_KV_LORA_RANK = {tiny.MLA_KV_LORA_RANK}\nMLA_ROPE_DIM = {tiny.MLA_ROPE_DIM}\n")
        for recipe in (tiny._common, config_fn):
            parts.append("\n" + inspect.getsource(recipe))
        parts.append(f"\n\nFAMILIES = {{{family!r}: {config_fn.__name__}}}\n")
        parts.append("\n" + inspect.getsource(tiny.build_family_model))
    parts.append(f"\n\nMTP_FAMILIES = {tiny.MTP_FAMILIES!r}\n")
    if family in tiny.MTP_FAMILIES:  # the MTP layers the run's model carries, added to the checkpoint as there
        parts.append(
            f"MTP_ARCHITECTURE = {mtp.MTP_ARCHITECTURE!r}\nMTP_LAYERS = {mtp.MTP_LAYERS}\nNOISE = {perturb.NOISE}\n"
        )
        for mtp_fn in (perturb.perturbed_layer, mtp.add_mtp_layers):
            parts.append("\n" + inspect.getsource(mtp_fn))
    return "".join(parts) + FOOTER
