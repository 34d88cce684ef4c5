"""A synthetic model written out as a Hugging Face checkpoint folder, with a tokenizer of its
vocabulary: what a server that loads a folder (vLLM, the peers) needs from a model that
exists only as a config and a seed.

The tokenizer is word-level ("t<id>" per id): the bench sends token ids, so a tokenizer
only has to exist and cover the vocabulary for the server to start and count tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .model import load_model


def write_checkpoint(source: str, out: Path, *, seed: int = 0) -> dict[str, Any]:
    """Write `source` (synthetic:NAME[,layers=N]) to `out`; the facts of what was written."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(source, seed=seed)
    config = loaded.config
    loaded.model.save_pretrained(out)
    # The special tokens take their ids from the config, every other id a word: one token
    # per id, none beyond the model's vocabulary (a server indexes its logits with them).
    specials = {"<unk>": 0, "<s>": _id(config.bos_token_id, 1), "</s>": _id(config.eos_token_id, 2)}
    taken = set(specials.values())
    vocab = {**specials, **{f"t{i}": i for i in range(config.vocab_size) if i not in taken}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<unk>").save_pretrained(out)
    facts = {"source": source, "seed": seed, "params": loaded.facts["params"],
             "weight_bytes": loaded.weight_bytes, "kv_bytes_per_token": loaded.kv_bytes_per_token}
    (out / "vcfslm-model.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def _id(value, default: int) -> int:
    return value if isinstance(value, int) else default
