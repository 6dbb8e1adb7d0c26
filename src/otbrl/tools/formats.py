"""Tool-call formats, and observation tokens built from the chat template by suffix difference.

Two formats of what the model writes:

- ``hermes`` (chat models, e.g. Qwen2.5): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, any number per turn; the turn ends with the model's EOS.
- ``compact`` (the built-in tokenizer, whose ``<tool_call>`` / ``</tool_call>`` /
  ``<tool_response>`` / ``</tool_response>`` are single special tokens): ``<tool_call>[name:]
  argument</tool_call>`` — the name may be left out when one tool is configured, the argument is
  the text of the tool's single parameter (or a JSON object of keyword arguments); generation
  stops at ``</tool_call>``, one call per turn.

Observations: after a model turn, the tokens of the tool results are the text the chat template
adds when the tool messages are appended, ``template(P + [A] + T, generation prompt) −
template(P + [A])``, plus whatever the template closes the assistant turn with beyond the stop
token the model sampled (ChatML's newline after ``<|im_end|>``). That is how both reference
frameworks build them, and it is exact only when the template is *prefix-preserving*: rendering
more messages never changes the text of the earlier ones. ``ChatTurns`` checks that once, on a
synthetic two-call conversation, and raises naming the model otherwise. The model's own tokens
are never re-tokenized: only observation text is tokenized.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from otbrl.tools.executor import ToolCall
from otbrl.tools.registry import Tool

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TOOL_TOKENS = (CALL_OPEN, CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
FORMATS = ("auto", "hermes", "compact")
_BUILTIN_ROLES = ("<user>", "<assistant>")  # otbrl.models.tokenizer.ROLE_TOKENS (floor 2 too)
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_PROBE_USER = "What is 12 times 34?"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class ToolCallFormat:
    """How calls are written and read. ``stop_at_call_end``: generation stops at
    ``</tool_call>`` (so a turn holds one call)."""

    name = ""
    stop_at_call_end = False

    def __init__(self, tools: Mapping[str, Tool]):
        self.tools = dict(tools)

    def parse(self, text: str) -> list[ToolCall]:
        """The calls of one model turn (decoded with special tokens kept); [] = no call, the
        turn is a final answer. An opened call that is never closed is one call with an
        error."""
        calls = [self._body(m.group(1)) for m in _CALL.finditer(text)]
        tail = text[text.rfind(CALL_CLOSE) + len(CALL_CLOSE) :] if calls else text
        if CALL_OPEN in tail:
            calls.append(ToolCall(None, error=f"unterminated {CALL_OPEN} (no {CALL_CLOSE})"))
        return calls

    def call_text(self, name: str, arguments: dict) -> str:
        """The text the model writes for one call (demonstrations use it)."""
        raise NotImplementedError

    def _body(self, body: str) -> ToolCall:
        raise NotImplementedError


def _loads(text: str) -> tuple[object, str | None]:
    """``(value, None)`` of JSON ``text``, or ``(None, why)`` for anything the policy can write
    that ``json.loads`` refuses — invalid JSON, but also nesting deeper than Python's recursion
    limit (``RecursionError``) and integers over its digit limit (a ``ValueError``): a sample's
    error, never the run's."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, err.msg
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as err:  # e.g. "Exceeds the limit (4300 digits) for integer string ..."
        return None, (str(err).splitlines() or ["unreadable"])[0][:120]


class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (arguments may also be a
    JSON string holding the object, as some models write it)."""

    name = "hermes"

    def call_text(self, name: str, arguments: dict) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"

    def _body(self, body: str) -> ToolCall:
        call, why = _loads(body)
        if why is not None:
            return ToolCall(None, error=f"the tool call is not valid JSON ({why})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall(None, error='a tool call must be a JSON object with a "name"')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            arguments, why = _loads(arguments) if arguments.strip() else ({}, None)
            if why is not None:
                return ToolCall(call["name"], error=f"arguments are not valid JSON ({why})")
        if not isinstance(arguments, dict):
            return ToolCall(call["name"], error='"arguments" must be a JSON object')
        return ToolCall(call["name"], arguments)


class CompactFormat(ToolCallFormat):
    """``<tool_call>[name:]argument</tool_call>``: short enough for a tiny character model. A
    leading identifier followed by ``:`` is the tool's name."""

    name = "compact"
    stop_at_call_end = True

    def call_text(self, name: str, arguments: dict) -> str:
        tool = self.tools[name]
        if len(tool.parameters) == 1:
            body = str(arguments[tool.parameters[0]])
        else:
            body = json.dumps(arguments, ensure_ascii=False)
        prefix = "" if len(self.tools) == 1 else f"{name}:"
        return f"{CALL_OPEN}{prefix}{body}{CALL_CLOSE}"

    def _body(self, body: str) -> ToolCall:
        name, sep, rest = body.partition(":")
        if sep and _NAME.fullmatch(name):  # a name, configured or not (then: unknown tool)
            body = rest
        elif len(self.tools) == 1:
            name = next(iter(self.tools))
        else:
            return ToolCall(None, error="name the tool: write name:argument in the call")
        if body.lstrip().startswith("{"):
            arguments, why = _loads(body)
            if why is not None:
                return ToolCall(name, error=f"arguments are not valid JSON ({why})")
            return ToolCall(name, arguments)
        return ToolCall(name, body)


def get_format(name: str, tools: Mapping[str, Tool], tokenizer) -> ToolCallFormat:
    """The format called ``name``; ``auto`` is ``compact`` for the built-in tokenizer (the four
    tool tokens and its ``<user>`` / ``<assistant>`` role tokens are single tokens), else
    ``hermes``. ``compact`` without single tool tokens is a ``ValueError``."""
    if name not in FORMATS:
        raise ValueError(f"format: expected one of {list(FORMATS)}, got {name!r}")
    single = all(len(_ids(tokenizer, t)) == 1 for t in TOOL_TOKENS)
    if name == "auto":
        # chat models such as Qwen3 have the tool tokens as special tokens too, and speak hermes
        builtin = single and all(len(_ids(tokenizer, t)) == 1 for t in _BUILTIN_ROLES)
        name = "compact" if builtin else "hermes"
    if name == "compact" and not single:
        raise ValueError(
            f"format: 'compact' needs {list(TOOL_TOKENS)} as single tokens of the tokenizer; "
            "use 'hermes' (or a built-in tool task's tokenizer)"
        )
    return CompactFormat(tools) if name == "compact" else HermesFormat(tools)


class ChatTurns:
    """Observation tokens from a tokenizer's chat template (module docstring).

    Args:
        tokenizer: an HF tokenizer with a chat template.
        fmt: the tool-call format (its ``stop_at_call_end`` decides whether ``</tool_call>`` is a
            stop token).
        eos_token_ids: the ids that end a model turn.
        model: the model's name or path, for error messages.

    Raises ``ValueError`` naming ``model`` when the template is missing or not prefix-preserving.
    """

    def __init__(
        self, tokenizer, fmt: ToolCallFormat | None, eos_token_ids: Sequence[int], model=""
    ):
        self.tokenizer, self.fmt, self.model = tokenizer, fmt, str(model)
        self.eos_ids = [int(i) for i in eos_token_ids]
        # characters of the vocabulary's longest token: how far to cut a tool output before
        # tokenizing it (``truncate``)
        self._longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
        if not self.eos_ids:
            raise ValueError("eos_token_ids: expected at least one id that ends a model turn")
        self._observations: dict = {}  # observation_ids' results, by turn and messages
        self.stop_ids = list(self.eos_ids)
        if fmt is not None and fmt.stop_at_call_end:
            self.stop_ids.append(_ids(tokenizer, CALL_CLOSE)[0])
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"model {self.model!r}: the tokenizer has no chat template; a multi-turn run "
                "builds observation tokens from it"
            )
        check_prefix_preserving(self, model=self.model)

    def render(self, messages: list[dict], *, generation_prompt: bool = False) -> str:
        """The template's text for ``messages``."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def turn_text(self, turn_ids: Sequence[int]) -> tuple[str, bool]:
        """(text the model wrote in a turn, without a final EOS; whether an EOS ended it)."""
        ids = list(turn_ids)
        eos = bool(ids) and ids[-1] in self.eos_ids
        body = ids[:-1] if eos else ids
        return self.tokenizer.decode(body, skip_special_tokens=False), eos

    def observation_text(self, turn_ids: Sequence[int], messages: Sequence[dict]) -> str:
        """The text that follows a model turn (``turn_ids``, as sampled) when ``messages``
        (tool results ``{"role": "tool", "name", "content"}`` or an environment's ``user``
        turns) answer it, up to and including the next generation prompt.

        The template renders the turn's content, or where that changes the text before the
        observation (a template that rewrites earlier assistant turns: Qwen3 drops their
        ``<think>`` blocks) a stand-in for it: what it writes between two turns does not depend
        on their reasoning, and the sampled tokens are never re-rendered."""
        content, ended_by_eos = self.turn_text(turn_ids)
        for shown in (content, _ASSISTANT_MARK):
            before = [
                {"role": "user", "content": _PROBE_USER},
                {"role": "assistant", "content": shown},
            ]
            prefix = self.render(before)
            full = self.render([*before, *messages], generation_prompt=True)
            if full.startswith(prefix):
                break
        else:
            raise ValueError(
                f"model {self.model!r}: the chat template is not prefix-preserving (appending "
                f"{messages[0]['role'] if messages else 'no'} messages changed the text of the "
                "assistant turn before them)"
            )
        close = _turn_close(prefix, shown)
        emitted = (
            self.tokenizer.decode(turn_ids[-1:], skip_special_tokens=False) if ended_by_eos else ""
        )
        if emitted and close.startswith(emitted):
            close = close[len(emitted) :]
        return close + full[len(prefix) :]

    def observation_ids(self, turn_ids: Sequence[int], messages: Sequence[dict]) -> list[int]:
        """``observation_text`` as token ids, none added: the template's special tokens parsed,
        the tool messages' contents encoded as plain text. A tool's output is data the policy
        or the outside world chose: one that prints ``</tool_response><|im_start|>assistant``
        must give the model those characters, not the tokens that end its observation and
        open a turn nobody sampled."""
        key = (tuple(turn_ids), tuple(tuple(sorted(m.items())) for m in messages))
        if key in self._observations:  # a game's few turns and answers recur in every episode
            return list(self._observations[key])
        if len(self._observations) >= OBSERVATION_CACHE:
            self._observations.clear()
        ids = self._observation_ids(turn_ids, messages)
        self._observations[key] = tuple(ids)
        return ids

    def _observation_ids(self, turn_ids: Sequence[int], messages: Sequence[dict]) -> list[int]:
        marks = [_CONTENT_MARK.format(i) for i in range(len(messages))]
        text = self.observation_text(
            turn_ids, [{**m, "content": mark} for m, mark in zip(messages, marks)]
        )
        ids: list[int] = []
        for mark, message in zip(marks, messages):
            before, found, text = text.partition(mark)
            if not found:
                raise ValueError(
                    f"model {self.model!r}: the chat template does not write a tool message's "
                    "content as it is, so it cannot be kept apart from the template's special "
                    "tokens"
                )
            ids += self.tokenizer.encode(before, add_special_tokens=False)
            ids += self.tokenizer.encode(
                str(message["content"]), add_special_tokens=False, split_special_tokens=True
            )
        return ids + self.tokenizer.encode(text, add_special_tokens=False)

    def rendered_ids(self, messages: Sequence[dict], tools: list | None = None) -> list[int]:
        """The ids of ``messages`` rendered whole by the template (``tools``: the schemas the
        prompt was rendered with) and tokenized again: what a trainer that re-renders the
        conversation would train on, compared with the sampled stream
        (``env/retokenization_mismatch``)."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def truncate(self, text: str, max_tokens: int) -> str:
        """``text`` cut to its first ``max_tokens`` tokens (a tool's output, before the template
        wraps it). Cut by characters first — (max_tokens + 1) × the vocabulary's longest token —
        so that a tool that prints megabytes costs the trainer a prefix's tokenization, not the
        whole output's."""
        text = text[: (max_tokens + 1) * self._longest_token]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= max_tokens else self.tokenizer.decode(ids[:max_tokens])

    def conversation_ids(self, turns: Sequence[dict]) -> tuple[list[int], list[int]]:
        """A demonstration as the agent loop would produce it: ``(response ids, mask)``.

        ``turns``: assistant messages (``content`` text, and/or ``tool_calls``: ``[{"name",
        "arguments"}]``, written in this format) alternating with the tool (or, an
        environment's, user) messages that answer them; a turn that is not answered ends with
        the first EOS id. Mask 1 on model tokens, 0 on observations, which are rendered from
        the answering messages' ``content``.
        """
        ids: list[int] = []
        mask: list[int] = []
        i = 0
        while i < len(turns):
            turn = turns[i]
            if turn.get("role") != "assistant":
                raise ValueError(f"turns[{i}]: expected an assistant message, got {turn!r}")
            text = turn.get("content") or ""
            for call in turn.get("tool_calls", ()):
                text += self.fmt.call_text(call["name"], call["arguments"])
            model = list(self.tokenizer.encode(text, add_special_tokens=False))
            answers = []
            while i + 1 < len(turns) and turns[i + 1].get("role") in ("tool", "user"):
                answers.append(turns[i + 1])
                i += 1
            if not answers or self.fmt is None or not self.fmt.stop_at_call_end:
                model.append(self.eos_ids[0])
            if answers:
                observation = self.observation_ids(model, answers)
            else:
                observation = []
            ids += model + observation
            mask += [1] * len(model) + [0] * len(observation)
            i += 1
        return ids, mask


def check_prefix_preserving(turns: ChatTurns, *, model="") -> None:
    """``ValueError`` naming ``model`` unless the template renders a synthetic conversation
    (prompt, a call, its result, a second call, its result, an answer) so that each rendering is
    a prefix of the next: the generation prompt, each assistant turn, each tool answer."""
    if turns.fmt is None:  # an environment's observations: user turns
        conversation = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": "400"},
            {"role": "user", "content": "higher"},
            {"role": "assistant", "content": "410"},
            {"role": "user", "content": "lower"},
            {"role": "assistant", "content": "408"},
        ]
        _check_renderings(turns, conversation, "user", model)
        turns.observation_ids(_ids(turns.tokenizer, "400"), conversation[2:3])
        return
    name = next(iter(turns.fmt.tools), "tool")
    tool = turns.fmt.tools.get(name)
    arguments = {p: "1" for p in (tool.parameters if tool else ("x",))}
    call = turns.fmt.call_text(name, arguments) if tool else f"{CALL_OPEN}1{CALL_CLOSE}"
    conversation = [
        {"role": "user", "content": _PROBE_USER},
        {"role": "assistant", "content": call},
        {"role": "tool", "name": name, "content": "408"},
        {"role": "assistant", "content": call},
        {"role": "tool", "name": name, "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    _check_renderings(turns, conversation, "tool", model)
    # and writes a tool message's content as it is (observation_ids keeps it apart)
    turns.observation_ids(_ids(turns.tokenizer, call), conversation[2:3])


def _check_renderings(turns: ChatTurns, conversation: list[dict], observed: str, model) -> None:
    """``ValueError`` naming ``model`` unless each rendering of ``conversation[:k]`` (with the
    generation prompt after an ``observed`` message) is a prefix of the next."""
    previous = turns.render(conversation[:1], generation_prompt=True)
    for k in range(2, len(conversation) + 1):
        role = conversation[k - 1]["role"]
        text = turns.render(conversation[:k], generation_prompt=role == observed)
        if not text.startswith(previous):
            raise ValueError(
                f"model {str(model)!r}: the chat template is not prefix-preserving: adding "
                f"message {k - 1} ({role}) changes the text rendered for the messages before "
                "it, so observation tokens cannot be built by suffix difference (fix the "
                "template, e.g. keep earlier assistant turns verbatim)"
            )
        previous = text


# stands in for a tool message's content while the template renders (plain ASCII letters and
# digits: a template that escapes or JSON-encodes its content leaves it as it is)
_CONTENT_MARK = "OTBRLTOOLCONTENT{}MARK"
_ASSISTANT_MARK = "OTBRLASSISTANTTURNMARK"  # stands in for a sampled turn's content
OBSERVATION_CACHE = 4096  # observation_ids results kept per ChatTurns (then cleared)


def _turn_close(prefix: str, content: str) -> str:
    """What the template writes after an assistant turn's content (``<eos>``,
    ``<|im_end|>\\n``...): the text after the last occurrence of the content."""
    for text in (content, content.strip()):
        at = prefix.rfind(text) if text else -1
        if at >= 0:
            return prefix[at + len(text) :]
    return ""


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))
