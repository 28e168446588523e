"""The encoders of the OpenAI APIs simengine serves, by the API name its routes use."""

from __future__ import annotations

from simengine.encoders import chat, completions
from simengine.encoders.interface import ApiEncoder, EncoderTools


def create_encoders(tools: EncoderTools) -> dict[str, ApiEncoder]:
    """One encoder per API (a new API is a module plus one line here)."""
    return {
        completions.API: completions.create(tools),
        chat.API: chat.create(tools),
    }
