"""`blocklab.text._checks`: the list of texts and the token ids of
`evaluate_text` (and of any text function), refused by name; the messages
written out by hand."""

import numpy as np
import pytest

from blocklab import ConfigError
from blocklab.text._checks import check_ids_in_vocab, check_text_list


def test_a_list_or_tuple_of_str_comes_back_as_a_list():
    assert check_text_list("f", "texts", ("a", "")) == ["a", ""]
    given = ["x"]
    out = check_text_list("f", "texts", given)
    assert out == given and out is not given


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            [],
            "f: texts must be a non-empty str or a non-empty list of str, got [] "
            "of type list.",
        ),
        (
            {"a": 1},
            "f: texts must be a non-empty str or a non-empty list of str, got "
            "{'a': 1} of type dict.",
        ),
        (["a", 3], "f: texts[1] must be a str, got 3 of type int."),
        (
            ("a", b"x" * 100),  # the repr cut at 60 characters: b' and 58 x
            "f: texts[1] must be a str, got b'" + "x" * 58 + " of type bytes.",
        ),
    ],
)
def test_refusals_name_the_argument_the_entry_and_what_came(value, message):
    with pytest.raises(ConfigError) as info:
        check_text_list("f", "texts", value)
    assert str(info.value) == message


def test_ids_in_the_vocabulary_come_back_as_int32():
    out = check_ids_in_vocab("f", "tokenizer.encode(texts)", np.array([0, 4, 9]), 10)
    assert out.dtype == np.int32 and out.tolist() == [0, 4, 9]


@pytest.mark.parametrize(("ids", "bad", "at"), [([0, 10, 3], 10, 1), ([-1, 12], -1, 0)])
def test_the_first_id_outside_the_vocabulary_is_named(ids, bad, at):
    with pytest.raises(ConfigError) as info:
        check_ids_in_vocab("f", "tokenizer.encode(texts)", np.array(ids), 10)
    assert str(info.value) == (
        f"f: tokenizer.encode(texts) gave token id {bad} at index {at}, outside the "
        "model's vocabulary [0, vocab_size=10); use the tokenizer the model was "
        "trained with."
    )
