"""Chat templates: rendering them (``compile_template``, used by ``Tokenizer.apply_chat_template``),
and the templates for model files that ship without one.

The Gemma 3 270M GGUF (converted by llama.cpp's GGUF-my-repo from ``google/gemma-3-270m``)
has no ``tokenizer.chat_template``. ``GEMMA3`` is the text part of the template in Google's
``gemma-3`` ``tokenizer_config.json``: a system message is prepended to the first user turn,
``assistant`` is called ``model``, each turn is ``<start_of_turn>ROLE\\n...<end_of_turn>\\n``.
Generation ends at ``<end_of_turn>`` (id 106), which the model's ``generation_config.json``
lists as an EOS id next to ``<eos>`` (id 1).
"""

from __future__ import annotations

import json
from datetime import datetime

GEMMA3_END_OF_TURN = "<end_of_turn>"

GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def fill_gaps(meta: dict) -> dict:
    """GGUF metadata with a known family's missing chat template and end-of-turn id filled in
    (Gemma 3: ``GEMMA3`` and ``<end_of_turn>`` as ``tokenizer.ggml.eot_token_id``); other
    files are returned unchanged."""
    if meta.get("general.architecture") != "gemma3":
        return meta
    meta = dict(meta)
    meta.setdefault("tokenizer.chat_template", GEMMA3)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if "tokenizer.ggml.eot_token_id" not in meta and GEMMA3_END_OF_TURN in tokens:
        meta["tokenizer.ggml.eot_token_id"] = tokens.index(GEMMA3_END_OF_TURN)
    return meta


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(source: str):
    """``source``, a Jinja chat template, compiled in a sandboxed environment as transformers
    renders it (``tojson``, ``raise_exception``, ``strftime_now``, ``{% generation %}``,
    loop controls)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (HF assistant masks): render the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
