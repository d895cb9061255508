"""Character-level tokenizer for the tiny / small profiles.

A real :class:`transformers.PreTrainedTokenizerFast` backed by a ``tokenizers`` WordLevel model whose
vocabulary is one token per character, so it saves with ``save_pretrained`` and reloads with
``AutoTokenizer.from_pretrained(local_dir)`` without any download.

Vocabulary (fixed, so ids are stable across runs and machines)::

    0 <pad>   1 <bos>   2 <eos>   3 <unk>
    4 "\\n"
    5.. 99    printable ASCII 32 (" ") .. 126 ("~"), in code-point order

Design choices (deliberate, relied on by tests and downstream code):

* No normalizer, a pre-tokenizer that isolates every single character (including spaces and newlines),
  and a ``Fuse`` decoder that concatenates pieces with nothing in between; together with
  ``clean_up_tokenization_spaces=False`` this makes ``decode(encode(s)) == s`` exactly for every
  string over the charset.
* **No special tokens are added automatically** (no post-processor): ``tok(s).input_ids`` is exactly the
  character ids. Callers prepend ``tok.bos_token_id`` / append ``tok.eos_token_id`` themselves.
* ``split_special_tokens=True``: literal text such as ``"<eos>"`` in a prompt is encoded as the five
  characters, never as the special token, so user/environment text cannot inject control tokens.
  Special ids only come from code (``tok.eos_token_id``) or from the model's samples.
* Characters outside the charset map to ``<unk>`` (id 3); decode of ``<unk>`` gives ``"<unk>"`` unless
  ``skip_special_tokens=True``.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
CHARSET: str = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE: int = len(SPECIAL_TOKENS) + len(CHARSET)  # 4 + 1 + 95 = 100

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def char_vocab() -> dict[str, int]:
    """The fixed token -> id map (specials first, then the charset)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab[ch] = len(vocab)
    return vocab


def build_tokenizer(model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer (no I/O, deterministic)."""
    vocab = char_vocab()
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    kwargs = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
        padding_side="right",
        **kwargs,
    )
    # Sanity: the specials must keep their fixed ids (vocab order above).
    assert tok.pad_token_id == PAD_ID and tok.bos_token_id == BOS_ID
    assert tok.eos_token_id == EOS_ID and tok.unk_token_id == UNK_ID
    assert len(tok) == VOCAB_SIZE, len(tok)
    return tok


__all__ = [
    "BOS", "BOS_ID", "CHARSET", "EOS", "EOS_ID", "PAD", "PAD_ID", "SPECIAL_TOKENS", "UNK", "UNK_ID",
    "VOCAB_SIZE", "build_tokenizer", "char_vocab",
]
