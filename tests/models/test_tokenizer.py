"""Character tokenizer: fixed vocabulary, exact round trip, special-token handling, save/load."""
import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trace.models.tokenizer import (
    BOS_ID,
    CHARSET,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    VOCAB_SIZE,
    build_tokenizer,
)

charset_text = st.text(alphabet=st.sampled_from(list(CHARSET)), max_size=200)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_vocab_layout(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(CHARSET) == 96 and VOCAB_SIZE == 100 == len(tok)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == list(SPECIAL_TOKENS)
    ids = [tok.convert_tokens_to_ids(c) for c in CHARSET]
    assert sorted(ids) == list(range(4, 100))  # one distinct id per character
    assert tok.convert_tokens_to_ids("\n") == 4 and tok.convert_tokens_to_ids(" ") == 5
    assert tok.convert_tokens_to_ids("~") == 99


@given(charset_text)
def test_round_trip_exact(s):
    tok = _TOK
    ids = tok(s)["input_ids"]
    assert len(ids) == len(s)  # one token per character, nothing added
    assert all(4 <= i < VOCAB_SIZE for i in ids)
    assert tok.decode(ids) == s
    assert tok.decode(ids, skip_special_tokens=True) == s
    assert tok.decode([BOS_ID] + ids + [EOS_ID], skip_special_tokens=True) == s


_TOK = build_tokenizer()


@pytest.mark.parametrize(
    "s", ["", " ", "  leading and trailing  ", "\n", "\n\na\n b \n", "x = 1 + 2\nprint(x)\n", "~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./"]
)
def test_whitespace_and_punctuation_preserved(tok, s):
    assert tok.decode(tok.encode(s)) == s
    assert tok.tokenize(s) == list(s)


def test_literal_special_text_is_not_a_special_token(tok):
    ids = tok("a<eos>b<pad>")["input_ids"]
    assert len(ids) == len("a<eos>b<pad>")
    assert EOS_ID not in ids and PAD_ID not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "a<eos>b<pad>"


def test_special_ids_decode(tok):
    ids = [BOS_ID] + tok.encode("hi") + [EOS_ID, PAD_ID]
    assert tok.decode(ids) == "<bos>hi<eos><pad>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_out_of_charset_maps_to_unk(tok):
    ids = tok("a\tb\u00e9")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids("a"), UNK_ID, tok.convert_tokens_to_ids("b"), UNK_ID]
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_padding_right_with_pad_id(tok):
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][2:] == [PAD_ID, PAD_ID]
    assert batch["attention_mask"][0] == [1, 1, 0, 0]


@pytest.mark.parametrize("loader", [AutoTokenizer, PreTrainedTokenizerFast])
def test_save_load(tok, tmp_path, loader):
    tok.save_pretrained(tmp_path)
    tok2 = loader.from_pretrained(tmp_path, local_files_only=True)
    assert len(tok2) == VOCAB_SIZE
    assert (tok2.pad_token_id, tok2.bos_token_id, tok2.eos_token_id, tok2.unk_token_id) == (0, 1, 2, 3)
    for s in ["", "hello world\n", " <eos> x  \n\n", CHARSET]:
        assert tok2(s)["input_ids"] == tok(s)["input_ids"]
        assert tok2.decode(tok2(s)["input_ids"]) == s
    assert tok2.get_vocab() == tok.get_vocab()
