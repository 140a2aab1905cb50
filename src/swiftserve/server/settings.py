"""ServerSettings: every ``swiftserve serve`` option that is not an engine option.

The ``serve`` flags are generated from this dataclass (cli_args.py), as the engine flags are
from EngineConfig: one source of truth for names, defaults and validation.
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftserve._options import check_range, reject_unknown_options

ENGINE_MODES = ("process", "thread")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # server/tool_calls.py PARSERS


@reject_unknown_options
@dataclass(frozen=True)
class ServerSettings:
    """HTTP-level identity, limits and timeouts.

    ``max_queued_requests``: past ``max_num_seqs`` + this many sequences (prompts x n) in
    flight, new requests get 503 + Retry-After. ``header_timeout`` / ``body_timeout``: seconds
    a client has to send its request headers / body (408 after; 0 = no limit);
    ``keep_alive_timeout``: idle seconds between requests on one connection.
    ``allowed_hosts``: when set, the Host header (and Origin, when sent) must name one of
    these hosts (a DNS-rebinding guard); 403 otherwise. ``disable_web_ui``: no chat page or
    dashboard at ``/`` (the ``/v1/stats`` data endpoint stays, behind the API key like the rest).
    ``chat_template``: a Jinja chat template (a file, or the template text itself, as in
    vLLM) used instead of the checkpoint's. ``embedding_workers``: encoder batches run side
    by side (default: one single-threaded forward per core). ``enable_auto_tool_choice`` and
    ``tool_call_parser`` (hermes, llama3_json): as in vLLM, ``tool_choice="auto"`` needs both;
    "required" and named functions work without (server/tool_calls.py).
    """

    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = None
    shutdown_timeout: float = 30.0
    max_n: int = 16
    max_prompts: int = 64
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    allowed_hosts: tuple[str, ...] | None = None
    embedding_model: str | None = None
    embedding_model_name: str | None = None
    engine_mode: str = "process"
    log_level: str = "info"
    disable_web_ui: bool = False
    chat_template: str | None = None
    embedding_workers: int | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        own = "ServerSettings"
        if self.engine_mode not in ENGINE_MODES:
            raise ValueError(f"{own}.engine_mode must be one of {ENGINE_MODES}, got {self.engine_mode!r}")
        for name in ("max_n", "max_prompts", "max_stop_strings", "max_stop_length", "max_body_bytes"):
            check_range(own, name, getattr(self, name), 1)
        check_range(own, "max_header_bytes", self.max_header_bytes, 1024)
        check_range(own, "port", self.port, 0, 65535)
        for name in ("shutdown_timeout", "header_timeout", "body_timeout", "keep_alive_timeout"):
            check_range(own, name, getattr(self, name), 0)
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"{own}.tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"{own}.enable_auto_tool_choice needs tool_call_parser")
        if self.embedding_workers is not None:
            check_range(own, "embedding_workers", self.embedding_workers, 1, 64)
        if self.max_queued_requests is not None:
            check_range(own, "max_queued_requests", self.max_queued_requests, 0)
