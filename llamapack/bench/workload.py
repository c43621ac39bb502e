"""The benchmark's prompts: token lists of given lengths cut from a fixed text (random-weight models make
any text as good as another; lengths are what matter: a short chat turn, a ~500-token context)."""
from __future__ import annotations

TEXT = ("You are a helpful assistant. The user asks about the history of the printing press, how movable type "
        "changed the spread of knowledge across Europe, and what the first printed books were; answer in a "
        "few clear paragraphs, with dates, names and places where they are known. ")

DEFAULT_PROMPT_LENGTHS = (32, 512)


def prompt_tokens(llm, n_tokens: int) -> list[int]:
    """``n_tokens`` tokens of the text repeated, starting with BOS (``llm``: anything with ``tokenize``)."""
    if n_tokens < 1:
        raise ValueError(f"a prompt needs at least one token, not {n_tokens}")
    tokens = llm.tokenize(TEXT.encode(), add_bos=True)
    piece = llm.tokenize(TEXT.encode(), add_bos=False)
    while len(tokens) < n_tokens:
        tokens += piece
    return tokens[:n_tokens]
