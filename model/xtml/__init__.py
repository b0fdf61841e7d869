"""XTML, the K3 chat format (DESIGN.md §1.10): the prompt renderer and the streaming output parser.

``render`` / ``render_ids`` turn an OpenAI-style conversation into the prompt string or its token ids
(reserved ids only from structure); ``StreamParser`` / ``parse`` read the model's answer back into
reasoning, content and typed tool calls.
"""

from k3.model.xtml.errors import XTMLParseError, XTMLRenderError
from k3.model.xtml.parse import (
    ArgumentDelta,
    Delta,
    ParsedMessage,
    StreamParser,
    TextDelta,
    ToolCallDelta,
    parse,
)
from k3.model.xtml.render import render, render_ids, render_segments

__all__ = [
    "ArgumentDelta",
    "Delta",
    "ParsedMessage",
    "StreamParser",
    "TextDelta",
    "ToolCallDelta",
    "XTMLParseError",
    "XTMLRenderError",
    "parse",
    "render",
    "render_ids",
    "render_segments",
]
