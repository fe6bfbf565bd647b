"""A ``data.chat_template`` is untrusted input (issue 39, item 5): refused at start, in one line naming the key, when
it reaches for Python internals, drops the user's message or the system prompt, or writes no generation prompt.

The cases render SmolLM2's tokenizer (bundled, offline) through ``ChatFormat.check``, what the data module runs at
start; one runs ``amir fit`` in this process on ``configs/tiny.yaml``.
"""

import pytest
from test_faults import fit_here

from amir_lightning.data.base import Prompt
from amir_lightning.data.templates import ChatFormat

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
SYSTEM = "You are terse."
INTERNALS = "data.chat_template reaches for Python internals ("
SANDBOX = "): a chat template is rendered sandboxed and may not use names starting with '_'"


# (case, template, what main did, the error now)
REFUSED = [
    ("''.__class__", "{{ ''.__class__ }}" + CHATML + GENERATION, "rendered nothing, started", "'__class__' at line 1"),
    (
        "''.__class__.__mro__",
        "{{ ''.__class__.__mro__ }}" + CHATML + GENERATION,
        "refused: does not render (SecurityError)",
        "'__class__' at line 1, '__mro__' at line 1",
    ),
    ("''['__class__']", "{{ ''['__class__'] }}" + CHATML + GENERATION, "rendered nothing", "'__class__' at line 1"),
    ("|attr('__class__')", "{{ ''|attr('__class__') }}" + CHATML + GENERATION, "rendered nothing",
     "'__class__' at line 1"),
    (
        "cycler.__init__.__globals__ on line 4",
        CHATML + "\n{{ cycler.__init__.__globals__ }}" + GENERATION,
        "refused: does not render (SecurityError)",
        "'__globals__' at line 4, '__init__' at line 4",  # CHATML holds 2 newlines
    ),
    ("inside {% generation %}", "{% for m in messages %}{% generation %}{{ m.__class__ }}{% endgeneration %}"
     "{% endfor %}", "rendered nothing", "'__class__' at line 1"),
    ("computed name", "{{ ''['__cla' ~ 'ss__'] }}" + CHATML + GENERATION, "rendered nothing",
     "'__class__' of a 'str' when rendered"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "template", "before", "names"), REFUSED, ids=[c[0] for c in REFUSED])
def test_a_template_that_reaches_for_python_internals_is_refused(case, template, before, names, smollm2):
    with pytest.raises(ValueError) as info:
        ChatFormat(SYSTEM, template).check(smollm2)
    assert str(info.value) == INTERNALS + names + SANDBOX


def test_the_templates_render_in_transformers_sandbox():
    """What no check at start sees (a computed name on a branch the check's prompt does not take) still cannot reach
    an object: the prompt is rendered by transformers in its ``ImmutableSandboxedEnvironment``."""
    from amir_lightning.models.tiny import PRINTABLE_ALPHABET, build_char_tokenizer

    template = (
        "{% for m in messages %}{{ m['content'] }}"
        "{% if m['content'] == 'open' %}{{ ''['__cla' ~ 'ss__'].mro() }}{% endif %}{% endfor %}"
    )
    tokenizer = build_char_tokenizer(PRINTABLE_ALPHABET)
    chat = ChatFormat(None, template)
    chat.check(tokenizer)  # the check's prompt does not open the branch
    with pytest.raises(Exception, match=r"access to attribute '__class__' of 'str' object is unsafe"):
        chat.render(tokenizer, Prompt(question="open", answer=""))


SHAPES = [
    (
        "no generation prompt",
        CHATML,
        "writes no generation prompt: with add_generation_prompt the prompt ends as without it, before the "
        "assistant's header '<|im_start|>assistant\\n' that it writes for a reply, so the policy would go on with the "
        "user's turn (end it with {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %})",
    ),
    (
        "the user's message dropped",
        CHATML.replace("{% for m in messages %}", "{% for m in messages if m['role'] != 'user' %}") + GENERATION,
        "drops the user's message: the prompt for the question 'What is 17 + 25?' is "
        "'<|im_start|>system\\nYou are terse.<|im_end|>\\n<|im_start|>assistant\\n'",
    ),
    (
        "the system prompt dropped",
        CHATML.replace("{% for m in messages %}", "{% for m in messages if m['role'] != 'system' %}") + GENERATION,
        "drops the system message (data.system_prompt): the prompt is "
        "'<|im_start|>user\\nWhat is 17 + 25?<|im_end|>\\n<|im_start|>assistant\\n'",
    ),
]


@pytest.mark.parametrize(("case", "template", "wrong"), SHAPES, ids=[c[0] for c in SHAPES])
def test_a_template_that_drops_part_of_the_prompt_is_refused(case, template, wrong, smollm2):
    """Before: each started, and trained on prompts that were not the ones asked."""
    with pytest.raises(ValueError) as info:
        ChatFormat(SYSTEM, template).check(smollm2)
    assert str(info.value) == "data.chat_template " + wrong


ACCEPTED = [
    ("ChatML", CHATML + GENERATION, "<|im_start|>user\n2+3<|im_end|>\n<|im_start|>assistant\n"),
    ("a header written always", CHATML + "<|im_start|>assistant", "2+3<|im_end|>\n<|im_start|>assistant"),
    ("plain text, no roles", "{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "You are terse.\n2+3\n"),
    ("a dictionary key of one '_'", "{% set d = {'_k': 'x'} %}{{ d['_k'] }}" + CHATML + GENERATION, "x<|im_start|>"),
]


@pytest.mark.parametrize(("case", "template", "part"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_a_sound_template_is_accepted(case, template, part, smollm2):
    chat = ChatFormat(SYSTEM, template)
    chat.check(smollm2)
    assert part in smollm2.decode(chat.render(smollm2, Prompt(question="2+3", answer="")))


def test_the_tokenizers_own_template_given_as_data_chat_template_is_accepted(smollm2):
    chat = ChatFormat(SYSTEM, smollm2.chat_template)
    chat.check(smollm2)
    assert chat.render(smollm2, Prompt(question="2+3", answer="")) == ChatFormat(SYSTEM).render(
        smollm2, Prompt(question="2+3", answer="")
    )


def test_amir_fit_refuses_such_a_template_at_start(tmp_path, monkeypatch, capsys):
    template = "{{ ''.__class__ }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    code, err = fit_here(tmp_path, monkeypatch, capsys, ["--data.chat_template", str(tmp_path / "chat.jinja")])
    assert code == 2, err[-2000:]
    assert f"amir: error: {INTERNALS}'__class__' at line 1{SANDBOX}" in err
    assert "Traceback" not in err and not (tmp_path / "runs" / "run" / "version_0" / "checkpoints").exists()
