"""Model clients: the offline `EchoClient` and the HTTP `OpenAIClient`, and what they share
(`Sampling`, `Completion`, the `ModelClient` protocol, `ModelContext`, the model errors).

Rooms: `base` (the shared types and errors), `echo`, `openai`.
"""

from .base import (
    Completion,
    ModelClient,
    ModelClientBase,
    ModelConnectionError,
    ModelContext,
    ModelError,
    ModelHTTPError,
    ModelResponseError,
    ModelTimeoutError,
    Sampling,
    Tokens,
    ToolCall,
    api_key_from_env,
    observe_completions,
)
from .echo import EchoClient
from .openai import OpenAIClient

__all__ = [
    "Completion",
    "EchoClient",
    "ModelClient",
    "ModelClientBase",
    "ModelConnectionError",
    "ModelContext",
    "ModelError",
    "ModelHTTPError",
    "ModelResponseError",
    "ModelTimeoutError",
    "OpenAIClient",
    "Sampling",
    "Tokens",
    "ToolCall",
    "api_key_from_env",
    "observe_completions",
]
