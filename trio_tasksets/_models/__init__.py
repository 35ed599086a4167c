"""Model clients: the offline `EchoClient` and the HTTP `OpenAIClient`, and what they share
(`Sampling`, `Completion`, the `ModelClient` protocol, `ModelClientBase` and the
`ClientDescription` a client gives of itself, `ModelContext`, the model errors, and
`EndpointCalls`, the retry, limits and outcome loop of every HTTP client).

Rooms: `base` (the shared types and errors), `calls` (the loop), `echo`, `openai`, `pool`
(many endpoints behind one client), `engine` (an engine's own `/metrics`), `stream`
(a streamed reply assembled as it arrives, and what a caller keeps of a cut one).

A client for another provider is one module here: its request, headers and reply, on
`EndpointCalls`, and its `describe` (docs/models.md, "A client for another provider").
"""

from .base import (
    ClientDescription,
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
    VersionSpan,
    api_key_from_env,
    describe,
    observe_completions,
)
from .calls import EndpointCalls
from .echo import EchoClient
from .openai import OpenAIClient
from .policy import (
    EngineControl,
    Policy,
    TokenContinuation,
    VLLMControl,
)
from .stream import ReplyBuilder, attach_reply

# duplicates: base.__all__ and the flat API list these names too; each list is its module's own
__all__ = [
    "ClientDescription",
    "Completion",
    "EchoClient",
    "EndpointCalls",
    "EngineControl",
    "ModelClient",
    "ModelClientBase",
    "ModelConnectionError",
    "ModelContext",
    "ModelError",
    "ModelHTTPError",
    "ModelResponseError",
    "ModelTimeoutError",
    "OpenAIClient",
    "Policy",
    "ReplyBuilder",
    "Sampling",
    "TokenContinuation",
    "Tokens",
    "ToolCall",
    "VLLMControl",
    "VersionSpan",
    "api_key_from_env",
    "attach_reply",
    "describe",
    "observe_completions",
]
