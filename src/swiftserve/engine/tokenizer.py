"""Tokenizer loading (Hugging Face tokenizer files; never remote code).

Where the checkpoint's tokenizer is a generic fast tokenizer (tokenizer.json plus a
tokenizer_config.json that asks for nothing class-specific), it is loaded straight from
tokenizer.json with the ``tokenizers`` library: the same Rust tokenizer that transformers
wraps, without the ~2 s it takes to import transformers. Anything else, or
``tokenizer_mode="hf"``, goes through ``transformers.AutoTokenizer``.
tests/test_tokenizer.py checks both give the same ids, text and chat prompts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from swiftserve.engine.chat_template import render_chat
from swiftserve.errors import CheckpointError

logger = logging.getLogger(__name__)

# Tokenizer classes that are nothing but tokenizer.json (transformers 4 and 5 names).
GENERIC_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, else the one in tokenizer_config.json."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (path / "chat_template.json").is_file():
        template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
    return template if isinstance(template, str) else None


class FastTokenizer:
    """The slice of the transformers tokenizer API swiftserve uses, over ``tokenizers``."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        self.backend_tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens_map = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None
        }
        self.chat_template = _chat_template(path, config)
        self.name_or_path = str(path)

    def _id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as transformers counts it)."""
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Render (and optionally tokenize) one conversation with the checkpoint's template
        (or ``chat_template=``, as transformers takes it)."""
        source = kwargs.pop("chat_template", None) or self.chat_template
        if source is None:
            raise ValueError(f"{self.name_or_path}: the tokenizer has no chat template")
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        text = render_chat(
            source,
            conversation,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens_map,
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def fast_path_refusal(path: Path) -> str | None:
    """Why this checkpoint's tokenizer needs transformers (None: tokenizer.json is enough)."""
    if not (path / "tokenizer.json").is_file():
        return "no tokenizer.json"
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')} may change tokenizer.json's behaviour"
    if "add_bos_token" in config or "add_eos_token" in config:
        return "add_bos_token / add_eos_token rewrite the post-processor"
    if config.get("clean_up_tokenization_spaces"):
        return "clean_up_tokenization_spaces"
    if config.get("auto_map"):
        return "custom tokenizer code"
    return None


def load_tokenizer(path: str | Path, mode: str = "auto") -> Any:
    """The tokenizer of a local checkpoint directory.

    ``mode``: "auto" (``tokenizers`` where that is exact, else transformers) or "hf"
    (always ``transformers.AutoTokenizer``).
    """
    if mode not in ("auto", "hf"):
        raise ValueError(f"tokenizer_mode must be 'auto' or 'hf', got {mode!r}")
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path}: no tokenizer.json or tokenizer_config.json")
    refusal = fast_path_refusal(path) if mode == "auto" else "tokenizer_mode='hf'"
    if refusal is None:
        return FastTokenizer(path)
    logger.info("tokenizer through transformers (%s)", refusal)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
