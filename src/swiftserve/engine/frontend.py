"""Frontend: what the offline LLM and the server's AsyncLLM share on the frontend side.

The tokenizer, EOS ids, input processing (prompt forms, character budget, tokenization,
validation), output processing (detokenization, stop strings) and the n-way fan-out of a
request into core-level child requests. Built from the checkpoint and the engine's CoreInfo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swiftserve.core.messages import CoreInfo, EngineCoreRequest
from swiftserve.engine.generation_config import default_sampling
from swiftserve.engine.inputs import InputProcessor, InvalidRequestError, ProcessedPrompt, max_token_chars
from swiftserve.engine.output_processor import OutputProcessor
from swiftserve.sampling_params import SamplingParams
from swiftserve.structured.grammar import GrammarCompiler, GrammarError, tokenizer_json


def child_seed(seed: int | None, index: int, n: int) -> int | None:
    """Distinct, reproducible seeds for the n sequences of one seeded request."""
    if seed is None or n == 1:
        return seed
    return (seed * 1_000_003 + index * 7_919 + 1) % (2**63)


class Frontend:
    """Tokenizer, input and output processing of one served model."""

    def __init__(self, tokenizer: Any, model_path: str | Path, info: CoreInfo):
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.inputs = InputProcessor(
            tokenizer, info.vocab_size, info.max_model_len, max_token_chars(tokenizer)
        )
        eos = tokenizer.eos_token_id
        self.eos_token_ids = info.eos_token_ids or ((eos,) if eos is not None else ())
        self.processor = OutputProcessor(tokenizer)
        self.default_sampling = default_sampling(model_path)
        self.grammars = GrammarCompiler(
            lambda: tokenizer_json(tokenizer.backend_tokenizer), info.vocab_size, self.eos_token_ids
        )

    def check_structured(self, params: SamplingParams, field: str = "structured_outputs") -> None:
        """Compile the request's grammar (cached per spec) or raise InvalidRequestError naming
        ``field``: a bad schema is a 400 before any engine work. Blocking: call it off the loop."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            self.grammars.validate(spec)
        except GrammarError as e:
            param = field if field != "structured_outputs" else f"{field}.{e.param}"
            raise InvalidRequestError(f"{field}: {e}", param) from e
        except AttributeError as e:  # a slow tokenizer without tokenizer.json
            raise InvalidRequestError(f"{field}: needs a fast tokenizer (tokenizer.json)", field) from e

    def add_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        max_tokens: int,
        priority: int,
        arrival_time: float,
        deadline: float | None = None,
        cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """Register a request with the output processor; its core requests (one per sequence)."""
        params = self.token_rules(params)
        children = self.processor.add_request(request_id, processed.prompt, processed.token_ids, params)
        return [
            EngineCoreRequest(
                child,
                processed.token_ids,
                params if params.n == 1 else params.replace(n=1, seed=child_seed(params.seed, i, params.n)),
                max_tokens,
                self.eos_token_ids,
                priority,
                arrival_time,
                deadline,
                cache_salt,
            )
            for i, child in enumerate(children)
        ]

    def token_rules(self, params: SamplingParams) -> SamplingParams:
        """Check the token ids that logit_bias / allowed_token_ids name against the
        vocabulary, and turn bad_words into token sequences (each word alone and after a
        space, as vLLM does, since BPE vocabularies spell the two differently)."""
        vocab = self.inputs.vocab_size
        for field, token in params.token_ids_named:
            if token >= vocab:
                raise InvalidRequestError(f"{field}: token id {token} is out of range [0, {vocab})", field)
        if not params.bad_words or params.bad_words_token_ids:
            return params
        sequences: list[tuple[int, ...]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return params.replace(bad_words_token_ids=tuple(sequences))
