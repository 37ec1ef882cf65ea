"""Options of the ``openai`` generator (imported only when a run validates them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_KEY_ENV = "OPENAI_API_KEY"


class OpenAICompatOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(
        description="The server's OpenAI API root, e.g. http://127.0.0.1:8000/v1 (requests go to "
        "<base_url>/completions).",
        pattern=r"^https?://",
    )
    api_key_env: str = Field(
        DEFAULT_KEY_ENV,
        description="Name of the environment variable holding the API key (sent as a bearer token). "
        f"Unset {DEFAULT_KEY_ENV}: no key is sent; any other name must be set.",
    )
    model: str | None = Field(
        None, description="Model name the server serves (default: the first one its /models lists)."
    )
    request_timeout: float = Field(600.0, gt=0, le=7 * 24 * 3600, description="Seconds one request may take.")
    max_concurrency: int = Field(32, ge=1, le=4096, description="Requests in flight at once.")
    max_retries: int = Field(
        2, ge=0, le=100, description="Times a request is sent again after a connection error or a 5xx answer."
    )
    send_seed: bool = Field(
        True, description="Send each request's sampling seed (the server decides whether sampling repeats)."
    )
    extra_body: dict[str, Any] = Field(
        default_factory=dict, description="More fields for every request body (server-specific parameters)."
    )
