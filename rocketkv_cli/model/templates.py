"""Prompt templates from `prompts/` and their split into a document part and a question part.

The document part (everything up to the end of the document) is prefilled once at ingest; the
question part (rest of the framing + question + generation prompt) is prefilled per question on top
of the stored cache. Models with a chat template get it; others get the plain framing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from pathlib import Path

_DOC = "\x00ROCKETKV_DOCUMENT\x00"
_QUESTION = "\x00ROCKETKV_QUESTION\x00"
PLAIN_STOP_STRINGS = ("\n\n", "\nQuestion:")
ECHO_PREFIX_CHARS = 32  # how much of the question an echo must repeat to be cut (`PromptFormat.echo_stops`)
SUMMARY_PLAIN_STOP_STRINGS = ("\n\n",)  # the continuation is one paragraph


@cache
def read_prompt(name: str) -> str:
    """Text of `prompts/<name>` (installed as `rocketkv_cli.prompts`), trailing newline removed."""
    try:
        text = resources.files("rocketkv_cli.prompts").joinpath(name).read_text(encoding="utf-8")
    except ModuleNotFoundError:  # running from a source tree without installing
        text = (Path(__file__).resolve().parents[2] / "prompts" / name).read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


@dataclass(frozen=True)
class PromptFormat:
    """A template split around the document and the question (all strings)."""

    template_id: str
    before_document: str
    before_question: str
    after_question: str
    add_special_tokens: bool  # plain framing: the tokenizer adds BOS; chat: the template does
    stop_strings: tuple[str, ...]
    summary_after: str | None = None  # plain framing: what follows the document to ask for a summary
    summary_stops: tuple[str, ...] = ()

    def document_text(self, document: str) -> str:
        return self.before_document + document

    def question_text(self, question: str) -> str:
        return self.before_question + question + self.after_question

    def echo_stops(self, question: str) -> tuple[str, ...]:
        """Stop strings that cut an echo of `question`'s prompt line after an answer: the chat
        prompt ends "Question: {question}", and a chat model may go on, after a blank line, to
        repeat it (SmolLM2: "… object code.\\n\\nQuestion: What must I provide …?"). Only that
        line with this question's first `ECHO_PREFIX_CHARS` characters (as written, or with its
        spaces tidied), after a blank line, so a
        Q&A-style answer that quotes other questions, or restates this one before answering, is
        kept. The plain framing needs none (its stop strings end an answer at any blank line)."""
        if not self.template_id.startswith("chat") or not question.strip():
            return ()
        forms = (question, question.strip(), " ".join(question.split()))  # as written, or its spaces tidied
        return tuple(dict.fromkeys(f"\n\nQuestion: {form[:ECHO_PREFIX_CHARS]}" for form in forms))


def follow_up(tokenizer, prompt: PromptFormat, template: str) -> str:
    """The text that follows a stored document to make the request `template` asks.

    template: a prompt with `{document}` and no `{question}` (for a model with a chat template,
    the user message; the assistant's turn follows). Its text before `{document}` must frame the
    document exactly as `prompt` does, so that a cache built with `prompt` can serve it.
    Raises:
        ValueError: a template whose text before `{document}` differs from `prompt`'s.
    """
    body = template.replace("{document}", _DOC)
    if prompt.template_id.startswith("chat"):
        messages = [{"role": "user", "content": body}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        rendered = body
    before, sep, after = rendered.partition(_DOC)
    if not sep or before != prompt.before_document:
        raise ValueError("the template frames the document differently from the stored cache's prompt")
    return after


def prompt_format(tokenizer) -> PromptFormat:
    """The prompt format for `tokenizer`: chat template if it has one, else `prompts/plain.txt`."""
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    raw = read_prompt("chat.txt" if has_chat else "plain.txt")
    body = raw.replace("{document}", _DOC).replace("{question}", _QUESTION)
    if has_chat:
        messages = [{"role": "user", "content": body}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        rendered = body
    before_doc, rest = rendered.split(_DOC)
    before_q, after_q = rest.split(_QUESTION)
    digest = hashlib.sha256(rendered.encode()).hexdigest()[:12]
    fmt = PromptFormat(
        template_id=f"{'chat' if has_chat else 'plain'}-{digest}",
        before_document=before_doc,
        before_question=before_q,
        after_question=after_q,
        add_special_tokens=not has_chat,
        stop_strings=() if has_chat else PLAIN_STOP_STRINGS,
    )
    if has_chat:  # a chat model is asked `summarize.txt` as a question (docs/framings.md)
        return fmt
    # a base model continues the document with `summarize_plain.txt` (docs/framings.md: it scored best of six
    # framings; asked as a question it echoed the prompt). Not part of template_id: caches stay valid.
    return replace(fmt, summary_after=follow_up(tokenizer, fmt, read_prompt("summarize_plain.txt")),
                   summary_stops=SUMMARY_PLAIN_STOP_STRINGS)  # fmt: skip
