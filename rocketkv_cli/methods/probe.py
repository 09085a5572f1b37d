"""SnapKV++ with a probe: the tail window plus a generic question-like text (prompts/probe.txt)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import register
from .tail import TailWindow


@register
@dataclass(frozen=True)
class ProbeWindow(TailWindow):
    """As `TailWindow`, with the queries of a generic probe question appended after the document
    in the observation window (scored, then dropped: the file keeps document tokens only), so that
    the scores lean toward what questions attend to rather than toward the document's end."""

    name = "probe"
    summary = "SnapKV++, the last W queries plus those of a generic probe question"
    observation = "probe"
    capture = "probe"
