"""A chat template given in ``data.chat_template`` is untrusted input: what is checked before the run starts.

Rendering is sandboxed already: the template reaches the tokenizer's ``apply_chat_template``, which renders it in
transformers' Jinja ``ImmutableSandboxedEnvironment`` (``ChatFormat.render``; nothing here renders it otherwise),
where a Python object's internals are out of reach. That sandbox turns many such accesses into an empty string
(``{{ ''.__class__ }}`` rendered nothing, and the run started). ``unsafe_access`` finds every such name written
out, and computed ones on the path of a prompt it renders, so the template is refused at start naming them and their
line; what it cannot see stays inside transformers' sandbox. ``check_structure`` refuses a template that would train
on prompts that are not what the user asked: one that drops the user's message or the system prompt, or writes no
generation prompt (the policy would go on writing the user's turn). ``ignores_tools`` finds a template that renders no
tools at all (SmolLM2's ChatML), which a run with tools refuses.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateSyntaxError, Undefined, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from typing_extensions import override

#: The question of the prompt the template is tried on: text no template adds by itself.
PROBE_QUESTION = "What is 17 + 25?"
PROBE_REPLY = "It is 42."


class _GenerationBlock(Extension):
    """Reads transformers' ``{% generation %} ... {% endgeneration %}`` block as its body, so the scan sees inside."""

    tags = {"generation"}

    @override
    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, where reaching for an internal raises instead of rendering nothing."""

    @override
    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        raise SecurityError(f"{attribute!r} of a {type(obj).__name__!r} when rendered")


def unsafe_access(template: str, variables: dict[str, Any]) -> str | None:
    """Where ``template`` names Python internals, as ``'__class__' at line 1, ...``; ``None`` when it names none.

    Written out: an attribute starting with ``_`` (what the sandbox refuses: ``x.__class__``, ``x|attr('_y')``) or
    an item key starting with ``__`` (``x['__class__']``; a single ``_`` can be a dictionary's own key). Computed
    (``x['__cla' ~ 'ss__']``): found by rendering with ``variables`` in a sandbox that raises where transformers'
    renders nothing.
    """
    env = _StrictSandbox(extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    try:
        tree = env.parse(template)
    except TemplateSyntaxError:
        return None  # the render check says what is wrong with it
    found = set()
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        name, prefix = _named(node)
        if name is not None and name.startswith(prefix):
            found.add((node.lineno, name))
    if found:
        return ", ".join(f"{name!r} at line {line}" for line, name in sorted(found))
    env.globals.update(raise_exception=lambda message: "", strftime_now=lambda fmt: "")
    try:
        env.from_string(template).render(**variables)
    except SecurityError as err:
        return str(err)
    except Exception:  # noqa: BLE001 - anything else is for the real render to report
        return None
    return None


def _named(node: nodes.Node) -> tuple[str | None, str]:
    """The name an attribute access, item access or ``attr`` filter uses (when written out), and its unsafe prefix."""
    if isinstance(node, nodes.Getattr):
        return node.attr, "_"
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
        return node.arg.value, "__"
    if isinstance(node, nodes.Filter) and node.name == "attr" and node.args and isinstance(node.args[0], nodes.Const):
        return str(node.args[0].value), "_"
    return None, "_"


def check_structure(tokenizer, template: str, system_prompt: str | None, kwargs: dict[str, Any]) -> str | None:
    """What is wrong with the prompts ``template`` renders, in a sentence; ``None`` when nothing is.

    It is tried on a prompt of one user message (after the system prompt, if any) with and without
    ``add_generation_prompt``, and on that conversation followed by an assistant's reply.

    Args:
        tokenizer: The policy's tokenizer (its special tokens are the template's variables).
        template: The Jinja text of ``data.chat_template``.
        system_prompt: ``data.system_prompt``.
        kwargs: ``data.chat_template_kwargs``.
    """
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    user = [*system, {"role": "user", "content": PROBE_QUESTION}]

    def text(messages: list[dict[str, str]], generation: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=generation, tokenize=False, **kwargs
        )

    prompt, bare = text(user, True), text(user, False)
    if PROBE_QUESTION not in prompt:
        return f"drops the user's message: the prompt for the question {PROBE_QUESTION!r} is {prompt!r:.200}"
    if system_prompt and system_prompt.strip() not in prompt:
        return f"drops the system message (data.system_prompt): the prompt is {prompt!r:.200}"
    if prompt != bare:
        return None
    try:
        answered = text([*user, {"role": "assistant", "content": PROBE_REPLY}], False)
    except Exception:  # noqa: BLE001 - a template may refuse a conversation; the prompt itself rendered
        return None
    before_reply = answered.split(PROBE_REPLY)[0] if PROBE_REPLY in answered else ""
    header = before_reply[len(bare) :] if before_reply.startswith(bare) else ""
    if not header.strip():
        return None  # the template writes no header before an assistant's text (plain text), or always writes it
    return (
        f"writes no generation prompt: with add_generation_prompt the prompt ends as without it, before the "
        f"assistant's header {header!r} that it writes for a reply, so the policy would go on with the user's turn "
        f"(end it with {{% if add_generation_prompt %}}{{{{ {header!r} }}}}{{% endif %}})"
    )


def ignores_tools(tokenizer, template: str | None, kwargs: dict[str, Any], messages, tools) -> bool:
    """Whether ``template`` (``None``: the tokenizer's) renders the prompt of ``messages`` the same with ``tools``.

    A template that never reads ``tools`` shows the policy no schema: it could only guess at the tools' names and
    arguments, and what it learns to call is not what the template of a later inference shows.
    """

    def prompt(shown) -> str:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tools=shown, add_generation_prompt=True, tokenize=False, **kwargs
        )

    return prompt(tools) == prompt(None)
