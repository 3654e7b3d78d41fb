"""Which ``chat_template_kwargs`` a request may pass: the variables the model's own chat template
reads, and nothing else.

transformers' ``apply_chat_template`` treats some keyword arguments as its own options
(``chat_template``, ``tokenize``, ``padding``, ``max_length``, ``return_tensors``, ...) and
forwards the rest to the template. An allow-list of the template's free variables (read with
Jinja's ``meta.find_undeclared_variables``), minus those the renderer itself supplies, keeps a
request from choosing the template or the tokenizer's behaviour.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateSyntaxError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Set by the renderer (transformers' apply_chat_template / mlx-lm), never by a request.
RENDERER_VARS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens", "raise_exception", "strftime_now",
})
# apply_chat_template's own options: refused even if a template happened to read the name.
RENDERER_OPTIONS = frozenset({
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "conversation",
})


def template_variables(chat_template: Any) -> frozenset[str]:
    """The variables a request may set through ``chat_template_kwargs`` for ``chat_template``
    (a Jinja source, a ``{name: source}`` mapping of several, or None: no variables)."""
    if isinstance(chat_template, str):
        sources = [chat_template]
    elif isinstance(chat_template, dict):
        sources = [t for t in chat_template.values() if isinstance(t, str)]
    elif isinstance(chat_template, list):  # [{"name": ..., "template": ...}] in tokenizer configs
        sources = [t.get("template") for t in chat_template
                   if isinstance(t, dict) and isinstance(t.get("template"), str)]
    else:
        return frozenset()
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    names: set[str] = set()
    for source in sources:
        try:
            names |= meta.find_undeclared_variables(env.parse(source))
        except TemplateSyntaxError:
            continue  # such a template cannot render; it allows nothing
    return frozenset(names - RENDERER_VARS - RENDERER_OPTIONS - set(env.globals))


def tokenizer_template_variables(tokenizer: Any) -> frozenset[str]:
    """:func:`template_variables` of a (wrapped) tokenizer's ``chat_template``."""
    return template_variables(getattr(tokenizer, "chat_template", None))
