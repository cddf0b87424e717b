"""Prompt ids and the token budget."""

from __future__ import annotations

from orpheus_tts_plugin.spec import ENGLISH
from orpheus_tts_plugin.speech.prompt import prompt_ids, token_budget


class _Tok:
    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ENGLISH.bos, *(ord(c) for c in text)]}


def test_prompt_ids_layout_has_one_bos() -> None:
    ids = prompt_ids(_Tok(), ENGLISH, "Hi", "tara")
    assert ids[0] == ENGLISH.start_of_human
    assert ids[1] == ENGLISH.bos and ids.count(ENGLISH.bos) == 1
    assert "".join(map(chr, ids[2:-4])) == "tara: Hi"
    assert ids[-4:] == (128009, 128260, 128261, 128257)


def test_token_budget_names_the_limit_that_applies() -> None:
    assert token_budget("hello", per_char=10, base=100, max_tokens=6144) == (154, "budget")
    assert token_budget("hello", per_char=10, base=100, max_tokens=100) == (100, "max_tokens")
