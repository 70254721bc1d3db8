"""Tiny Hugging Face artefacts built locally for the tests: nothing is downloaded.

:func:`make_tokenizer` trains a word-level tokenizer (the ``tokenizers`` library) over a fixed
word list, so every word of :data:`WORDS` is exactly one token and a test can compute the
expected ids by hand; it saves it as a ``transformers`` tokenizer directory with BOS, EOS and pad
tokens and, by default, a small chat template.
"""

from __future__ import annotations

from pathlib import Path

#: The vocabulary's ordinary words (one token each); the tests' texts use only these.
_WORD_TEXT = """
the a an and or of to in on at is was are be it this that with for as by from
cat dog bird fish tree sky sun moon red blue green big small fast slow runs sits
flies swims sings hello hi yes no what why how who please thanks good bad one two three
"""
WORDS = _WORD_TEXT.split()
#: Special tokens, in id order from 0.
SPECIALS = ["<unk>", "<bos>", "<eos>", "<pad>"]
#: Words the chat template writes around each message.
TEMPLATE_WORDS = ["user", "assistant", "system", ":"]

#: A prefix-stable template: ``<bos>``, then ``role : content`` per message, each assistant turn
#: closed by ``<eos>``; the generation prompt is ``assistant :``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ m['role'] }} : {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}{{ eos_token }} {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def make_tokenizer(directory: Path, *, chat_template: bool = True) -> str:
    """Train a word-level tokenizer over :data:`WORDS` (ids: :data:`SPECIALS` first, then the
    template words, then the words), add BOS to every encoded text (as Llama's tokenizers do),
    save it with ``save_pretrained`` into ``directory`` and return ``str(directory)``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + TEMPLATE_WORDS + WORDS)}
    assert len(vocab) <= 128
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return str(directory)
